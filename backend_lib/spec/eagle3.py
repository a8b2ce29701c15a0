"""EAGLE-3 heads (vLLM's and SGLang's `eagle3` method): a one-layer draft model over the target's own hidden states.

The layout read here is the one the public Qwen3 EAGLE-3 heads use (Tengyunw/qwen3_8b_eagle3,
AngelSlim/Qwen3-8B_eagle3, the SpecForge heads: `architectures: ["LlamaForCausalLMEagle3"]`, a Llama decoder
layer config with `num_hidden_layers: 1`, `draft_vocab_size`, optionally `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`), and the `speculators` one (RedHatAI/Qwen3-8B-speculator.eagle3:
`architectures: ["Eagle3Speculator"]`, the layer's fields under `transformer_layer_config`, top-level
`draft_vocab_size` / `target_hidden_size` / `norm_before_residual` / `eagle_aux_hidden_state_layer_ids`).
Tensors (bf16 safetensors, names without a `model.` prefix):

    fc.weight                           [hidden, 3 * target_hidden]   the three target hidden states -> one
    midlayer.input_layernorm.weight     [hidden]                      (or layers.0.*: the speculators layout)
    midlayer.hidden_norm.weight         [hidden]
    midlayer.self_attn.{q,k,v}_proj.weight  [heads * head_dim | kv_heads * head_dim, 2 * hidden]
    midlayer.self_attn.o_proj.weight    [hidden, heads * head_dim]
    midlayer.post_attention_layernorm.weight [hidden]
    midlayer.mlp.{gate,up}_proj.weight  [intermediate, hidden];  midlayer.mlp.down_proj.weight [hidden, intermediate]
    norm.weight                         [hidden]
    lm_head.weight                      [draft_vocab, hidden]
    d2t                                 [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                                 [vocab] bool: which target ids the draft vocabulary holds
    embed_tokens.weight                 [vocab, hidden], optional: absent, the head embeds with the target's

The computation (vLLM's llama_eagle3 / SGLang's llama_eagle3, the EAGLE repo's cnets): at position p the head
reads the embedding of token p + 1 and g = fc(concat(a_0, a_1, a_2)), the target's residual stream entering its
aux layers at position p; residual = g (hidden_norm first when norm_before_residual), x = [input_layernorm(e),
hidden_norm(g)] (2 x hidden wide), Llama attention (rotate-half RoPE at p, no q/k norm, causal over the head's
own KV of positions <= p), residual add, post_attention_layernorm, SwiGLU, residual add -> `pre`; norm(pre) ->
lm_head over the draft vocabulary, argmax, mapped to the target vocabulary through d2t. The next draft reads its
own previous `pre` in place of g (no fc) and the embedding of the draft it just made.

Aux layer ids follow vLLM: id j is the residual stream entering target layer j (the output of layer j - 1), the
default (2, L // 2, L - 3) for a target of L layers, or the head's `eagle_aux_hidden_state_layer_ids`; ours
beside: 0 is the embeddings and L the last layer's output before the final norm.

Exactness does not depend on the head: drafts are only proposals, verified by the target (decoder.py), so the
output is the output of plain decoding whatever the head computes; the head only decides how many drafts are
accepted. It runs in the engine's dtype through torch (no batch-invariance needed); its KV is a per-sequence
tensor cache of the positions the target fed it.

Tensor parallel (tensor_parallel_size > 1): the head runs on rank 0 alone, unsharded, where the proposer and
the sampler run; the aux states are rank 0's own (after each row-parallel all-reduce the residual stream is
replicated on every rank), and the target's embedding rows for a head without embed_tokens are gathered from
the ranks that hold them (parallel/runtime.py ShardedModel.forward_aux / embed).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
KEY = "speculative_config.model"
MAX_PENDING = 2048     # target rows kept per sequence before the head reads them (a long prompt: its last ones)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Eagle3Error(ValueError):
    """A head that cannot serve this target; the message names the key, the field or the tensor."""


def _err(folder, what: str) -> Eagle3Error:
    return Eagle3Error(f"{KEY}: {folder}: {what}")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None     # None: vLLM's default for the target's depth
    norm_before_residual: bool
    attention_bias: bool
    layer_prefix: str                         # "midlayer" or "layers.0" (the speculators layout)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Eagle3Config":
        folder = Path(folder)
        path = folder / "config.json"
        if not folder.is_dir():
            raise Eagle3Error(f"{KEY}: {folder} is not a folder (an EAGLE-3 head's config.json and safetensors)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise _err(folder, f"config.json unreadable ({exc})") from None
        if not isinstance(raw, dict):
            raise _err(folder, "config.json is not a JSON object")
        return cls.from_dict(raw, folder)

    @classmethod
    def from_dict(cls, raw: dict, folder="head") -> "Eagle3Config":
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise _err(folder, f"config.json architectures {archs!r} is not an EAGLE-3 head "
                               f"({', '.join(ARCHITECTURES)})")
        speculators = "Eagle3Speculator" in archs
        layer = raw.get("transformer_layer_config") if speculators else raw
        if not isinstance(layer, dict):
            raise _err(folder, "config.json transformer_layer_config: missing (the speculators layout)")
        if speculators:
            algo = (raw.get("speculators_config") or {}).get("algorithm", "eagle3")
            if algo != "eagle3":
                raise _err(folder, f"config.json speculators_config.algorithm {algo!r} is not eagle3")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise _err(folder, "config.json eagle_config: not an object")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise _err(folder, "config.json eagle_config.use_aux_hidden_state: false (an EAGLE-1/2 style head) "
                               "is not implemented")

        def num(src, key, kind=int, default=None, positive=True, where="config.json "):
            v = src.get(key, default)
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    (kind is int and not float(v).is_integer()) or (positive and v <= 0):
                raise _err(folder, f"{where}{key}: must be a positive {'integer' if kind is int else 'number'}, "
                                   f"got {v!r}")
            return kind(v)

        lw = "config.json transformer_layer_config." if speculators else "config.json "
        if num(layer, "num_hidden_layers", default=1, where=lw) != 1:
            raise _err(folder, f"{lw}num_hidden_layers: {layer.get('num_hidden_layers')} decoder layers; EAGLE-3 "
                               "heads have one (midlayer)")
        if layer.get("hidden_act", "silu") != "silu":
            raise _err(folder, f"{lw}hidden_act: {layer.get('hidden_act')!r} is not silu")
        if layer.get("mlp_bias", False):
            raise _err(folder, f"{lw}mlp_bias: true is not implemented")
        if layer.get("rope_scaling") not in (None, {}):
            raise _err(folder, f"{lw}rope_scaling: {layer.get('rope_scaling')!r} is not implemented (null only)")
        hidden = num(layer, "hidden_size", where=lw)
        heads = num(layer, "num_attention_heads", where=lw)
        kv = num(layer, "num_key_value_heads", default=heads, where=lw)
        head_dim = num(layer, "head_dim", default=hidden // heads, where=lw)
        if heads % kv:
            raise _err(folder, f"{lw}num_key_value_heads: {kv} does not divide num_attention_heads {heads}")
        vocab = num(layer, "vocab_size", where=lw)
        dv = raw.get("draft_vocab_size", layer.get("draft_vocab_size"))
        draft_vocab = vocab if dv is None else num({"draft_vocab_size": dv}, "draft_vocab_size")
        if draft_vocab > vocab:
            raise _err(folder, f"config.json draft_vocab_size: {draft_vocab} exceeds vocab_size {vocab}")
        th = raw.get("target_hidden_size", layer.get("target_hidden_size"))
        target_hidden = hidden if th is None else num({"target_hidden_size": th}, "target_hidden_size")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None:
            if not isinstance(ids, list) or len(ids) != 3 or \
                    not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) or \
                    len(set(ids)) != 3:
                raise _err(folder, f"config.json eagle_config.eagle_aux_hidden_state_layer_ids: {ids!r} is not "
                                   "three distinct layer ids >= 0")
            ids = tuple(sorted(ids))
        nbr = raw.get("norm_before_residual", layer.get("norm_before_residual", False))
        if not isinstance(nbr, bool):
            raise _err(folder, f"config.json norm_before_residual: must be true or false, got {nbr!r}")
        bias = layer.get("attention_bias", False)
        return cls(hidden, num(layer, "intermediate_size", where=lw), heads, kv, head_dim,
                   float(num(layer, "rms_norm_eps", float, 1e-6, where=lw)),
                   float(num(layer, "rope_theta", float, 10000.0, where=lw)), vocab, draft_vocab, target_hidden,
                   ids, bool(nbr), bool(bias), "layers.0" if speculators else "midlayer")

    def aux_layers(self, num_layers: int, folder="head") -> tuple[int, ...]:
        """The target layers whose incoming residual stream the head reads (ascending: fc's input order)."""
        if self.aux_layer_ids is not None:
            bad = [i for i in self.aux_layer_ids if i > num_layers]
            if bad:
                raise _err(folder, f"config.json eagle_config.eagle_aux_hidden_state_layer_ids: {bad} beyond the "
                                   f"target's {num_layers} layers (0 .. {num_layers})")
            return self.aux_layer_ids
        ids = (2, num_layers // 2, num_layers - 3)   # vLLM's and SGLang's default
        if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
            raise _err(folder, f"the default aux layers {ids} of a {num_layers}-layer target are not three distinct "
                               "layers: set eagle_config.eagle_aux_hidden_state_layer_ids in its config.json")
        return tuple(sorted(ids))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class Eagle3Head:
    """The head's weights and its forward over a batch of row segments (each one sequence's, contiguous
    positions), writing each segment's K / V into that sequence's cache."""

    LINEARS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")

    def __init__(self, cfg: Eagle3Config, w: dict[str, torch.Tensor], embed, aux_layers: tuple[int, ...],
                 kernels=None):
        """kernels: the engine's kernel set (its float GEMM / GEMV for the linears); None: torch's."""
        self.cfg, self.w, self.embed_fn, self.aux_layers = cfg, w, embed, aux_layers
        self.dtype = w["norm"].dtype
        self.lin = {}
        if kernels is not None:
            from ..layers.linear import FloatLinear

            self.lin = {n: FloatLinear(w.pop(n), kernels) for n in self.LINEARS}
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.inv_freq = inv.float().to(w["norm"].device)
        self.d2t_full = torch.arange(cfg.draft_vocab_size, dtype=torch.int64, device=w["norm"].device) + w["d2t"]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.w.get("embed")
        return (e.index_select(0, ids) if e is not None else self.embed_fn(ids)).to(self.dtype)

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lin = self.lin.get(name)
        y = lin(x.contiguous()) if lin is not None else F.linear(x, self.w[name])
        return y if bias is None else y + bias

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: the three target hidden states [n, 3 * target_hidden] -> [n, hidden]."""
        return self.linear("fc", aux.to(self.dtype))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        f = torch.outer(positions.float(), self.inv_freq)            # [T, d / 2]
        cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, ids, positions, hidden, segments) -> tuple[torch.Tensor, torch.Tensor]:
        """ids / positions [T], hidden [T, hidden]; segments [(state, row0, n)]. Returns (normed, pre) [T, hidden]."""
        c, w = self.cfg, self.w
        eps = c.rms_norm_eps
        e = rms(self.embed(ids), w["input_norm"], eps)
        hidden = hidden.to(self.dtype)
        if c.norm_before_residual:
            hn = rms(hidden, w["hidden_norm"], eps)
            residual = hn
        else:
            residual = hidden
            hn = rms(hidden, w["hidden_norm"], eps)
        qkv = self.linear("qkv", torch.cat([e, hn], dim=-1), w.get("qkv_bias"))
        H, KV, d = c.num_heads, c.num_kv_heads, c.head_dim
        T, scale = ids.shape[0], c.head_dim ** -0.5
        q, k, v = qkv.split([H * d, KV * d, KV * d], dim=-1)
        q = self._rope(q.reshape(T, H, d), positions)
        k = self._rope(k.reshape(T, KV, d), positions)
        v = v.reshape(T, KV, d)
        out = torch.empty((T, H, d), dtype=self.dtype, device=q.device)
        for state, r0, n in segments:
            p0 = int(positions[r0])
            keys, vals = state.write(p0, k[r0:r0 + n], v[r0:r0 + n])     # [L, KV, d] up to p0 + n - 1
            L = keys.shape[0]
            qs = q[r0:r0 + n].transpose(0, 1)                              # [H, n, d]
            ks = keys.transpose(0, 1).repeat_interleave(H // KV, dim=0)   # [H, L, d]
            vs = vals.transpose(0, 1).repeat_interleave(H // KV, dim=0)
            rel = p0 - state.base
            scores = torch.matmul(qs.float(), ks.float().transpose(1, 2)) * scale          # [H, n, L]
            if n > 1:
                mask = torch.arange(L, device=q.device)[None, :] > (rel + torch.arange(n, device=q.device))[:, None]
                scores = scores.masked_fill(mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), vs.float())                     # [H, n, d]
            out[r0:r0 + n] = o.transpose(0, 1).to(self.dtype)
        h = self.linear("o", out.reshape(T, H * d), w.get("o_bias")) + residual
        m = rms(h, w["post_norm"], eps)
        gate, up = self.linear("gate_up", m).chunk(2, dim=-1)
        pre = self.linear("down", F.silu(gate) * up) + h
        return rms(pre, w["norm"], eps), pre

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy drafts in the target's vocabulary: argmax over the draft vocabulary, mapped through d2t."""
        logits = self.linear("lm_head", normed)
        return self.d2t_full[logits.argmax(dim=-1)]


def load_eagle3_head(folder: str | Path, target, dtype: torch.dtype, device: torch.device,
                     embed=None, kernels=None) -> Eagle3Head:
    """The head in `folder` for a target with ModelConfig `target`; every mismatch refused naming the field or
    tensor. embed: the target's embedding (ids -> rows), used when the head has no embed_tokens.weight."""
    from ..checkpoint import CheckpointError, WeightStore

    folder = Path(folder)
    cfg, aux = check_head(folder, target)
    try:
        store = WeightStore(folder)
    except CheckpointError as exc:
        raise _err(folder, str(exc)) from None
    return _load(folder, cfg, aux, store, target, dtype, device, embed, kernels)


def check_head(folder: str | Path, target) -> tuple[Eagle3Config, tuple[int, ...]]:
    """The head's config.json against the target's ModelConfig (before either is loaded): (config, aux layers)."""
    folder = Path(folder)
    cfg = Eagle3Config.from_dir(folder)
    if cfg.target_hidden_size != target.hidden_size:
        raise _err(folder, f"config.json target_hidden_size: {cfg.target_hidden_size} (hidden_size when absent) is "
                           f"not the target's hidden_size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise _err(folder, f"config.json vocab_size: {cfg.vocab_size} is not the target's vocab_size "
                           f"{target.vocab_size}")
    return cfg, cfg.aux_layers(target.num_layers, folder)


def _load(folder, cfg, aux, store, target, dtype, device, embed, kernels) -> Eagle3Head:
    from ..checkpoint import CheckpointError

    hid, H, KV, d, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    p = cfg.layer_prefix
    if not store.has("embed_tokens.weight") and (hid != target.hidden_size or embed is None):
        raise _err(folder, f"tensor 'embed_tokens.weight' is absent and the head's hidden_size {hid} is not the "
                           f"target's {target.hidden_size} (the target's embedding cannot stand in)")

    def get(name, shape, dtypes=FLOATS, cast=True):
        try:
            t = store.get(name, shape, dtypes)
        except CheckpointError as exc:
            raise _err(folder, str(exc)) from None
        return t.to(device=device, dtype=dtype if cast else t.dtype, copy=True).contiguous()

    w: dict[str, torch.Tensor] = {
        "fc": get("fc.weight", (hid, 3 * cfg.target_hidden_size)),
        "input_norm": get(f"{p}.input_layernorm.weight", (hid,)),
        "hidden_norm": get(f"{p}.hidden_norm.weight", (hid,)),
        "qkv": torch.cat([get(f"{p}.self_attn.q_proj.weight", (H * d, 2 * hid)),
                          get(f"{p}.self_attn.k_proj.weight", (KV * d, 2 * hid)),
                          get(f"{p}.self_attn.v_proj.weight", (KV * d, 2 * hid))]),
        "o": get(f"{p}.self_attn.o_proj.weight", (hid, H * d)),
        "post_norm": get(f"{p}.post_attention_layernorm.weight", (hid,)),
        "gate_up": torch.cat([get(f"{p}.mlp.gate_proj.weight", (inter, hid)),
                              get(f"{p}.mlp.up_proj.weight", (inter, hid))]),
        "down": get(f"{p}.mlp.down_proj.weight", (hid, inter)),
        "norm": get("norm.weight", (hid,)),
        "lm_head": get("lm_head.weight", (cfg.draft_vocab_size, hid)),
    }
    if cfg.attention_bias:
        w["qkv_bias"] = torch.cat([get(f"{p}.self_attn.{n}_proj.bias", (s,)) for n, s in
                                   (("q", H * d), ("k", KV * d), ("v", KV * d))])
        if store.has(f"{p}.self_attn.o_proj.bias"):
            w["o_bias"] = get(f"{p}.self_attn.o_proj.bias", (hid,))
    if store.has("embed_tokens.weight"):
        w["embed"] = get("embed_tokens.weight", (cfg.vocab_size, hid))
    ints = (torch.int64, torch.int32)
    if store.has("d2t"):
        w["d2t"] = get("d2t", (cfg.draft_vocab_size,), ints, cast=False).to(torch.int64)
    elif cfg.draft_vocab_size == cfg.vocab_size:
        w["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
    else:
        raise _err(folder, f"tensor 'd2t' is absent and draft_vocab_size {cfg.draft_vocab_size} is not vocab_size "
                           f"{cfg.vocab_size}")
    target_ids = torch.arange(cfg.draft_vocab_size, device=device) + w["d2t"]
    if bool(((target_ids < 0) | (target_ids >= cfg.vocab_size)).any()):
        raise _err(folder, f"tensor 'd2t' maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    if store.has("t2d"):
        t2d = get("t2d", (cfg.vocab_size,), (torch.bool, torch.uint8, torch.int64, torch.int32), cast=False).bool()
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[target_ids].all()):
            raise _err(folder, "tensor 't2d' does not mark exactly the target ids d2t maps the draft vocabulary to")
    unknown = [n for n in store.names() if n not in _known_names(cfg)]
    store.release()
    if unknown:
        raise _err(folder, f"tensors {unknown[:4]} are not part of the EAGLE-3 layout")
    log.info("EAGLE-3 head %s: hidden %d, %d heads, draft vocabulary %d, aux layers %s", folder, hid, H,
             cfg.draft_vocab_size, list(aux))
    return Eagle3Head(cfg, w, embed, aux, kernels)


def _known_names(cfg: Eagle3Config) -> set[str]:
    p = cfg.layer_prefix
    names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
             f"{p}.input_layernorm.weight", f"{p}.hidden_norm.weight", f"{p}.post_attention_layernorm.weight"}
    names |= {f"{p}.self_attn.{n}_proj.{k}" for n in "qkvo" for k in ("weight", "bias")}
    names |= {f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


# ----- the proposer ----------------------------------------------------------------------------------------------
class Eagle3State:
    """One sequence's head state: its KV cache over positions base .. n_kv - 1 (fed with the target's hidden
    states), the target rows not yet fed (positions pend_start ..), and the first draft of the last feed."""

    __slots__ = ("k", "v", "base", "n_kv", "pend", "pend_start", "last")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.k = self.v = None
        self.base = self.n_kv = 0
        self.pend: list[torch.Tensor] = []
        self.pend_start = 0
        self.last = None              # (position, first draft, pre row) of the last target-fed position

    @property
    def pend_end(self) -> int:
        return self.pend_start + sum(t.shape[0] for t in self.pend)

    def observe(self, start: int, rows: torch.Tensor) -> None:
        """The target's aux rows of positions start .. start + n - 1 (they replace any rows from start on; a
        copy: the step's tensor is not held). At most MAX_PENDING rows wait (a paused request's): older ones
        are dropped, and the head's context then starts after them."""
        rows = rows.clone()
        if self.pend and self.pend_start <= start <= self.pend_end:
            keep, out = start - self.pend_start, []
            for t in self.pend:
                if keep <= 0:
                    break
                out.append(t[:keep])
                keep -= t.shape[0]
            self.pend = out + [rows]
        else:
            self.pend, self.pend_start = [rows], start
        excess = self.pend_end - self.pend_start - MAX_PENDING
        if excess > 0:
            flat = torch.cat(self.pend)[excess:]
            self.pend, self.pend_start = [flat], self.pend_start + excess

    def rebase(self, pos: int) -> None:
        """The cache holds positions >= pos only from here (nothing before them is known to the head)."""
        self.k = self.v = None
        self.base = self.n_kv = pos
        self.last = None

    def write(self, p0: int, k: torch.Tensor, v: torch.Tensor):
        """K / V of positions p0 .. p0 + n - 1; returns the cache's rows of positions base .. p0 + n - 1."""
        n = k.shape[0]
        lo, hi = p0 - self.base, p0 - self.base + n
        cap = 0 if self.k is None else self.k.shape[0]
        if hi > cap:
            new = max(hi, 2 * cap, 64)
            kk = k.new_zeros((new,) + tuple(k.shape[1:]))
            vv = v.new_zeros((new,) + tuple(v.shape[1:]))
            if self.k is not None:
                kk[:cap], vv[:cap] = self.k, self.v
            self.k, self.v = kk, vv
        self.k[lo:hi], self.v[lo:hi] = k, v
        return self.k[:hi], self.v[:hi]


class Eagle3Method:
    """The EAGLE-3 proposer behind spec.decoder's Proposer interface (plus `observe`, the target's aux rows)."""

    def __init__(self, head: Eagle3Head, k: int):
        self.head, self.k = head, k
        self.aux_layers = head.aux_layers

    @classmethod
    def build(cls, spec_cfg, ctx) -> "Eagle3Method":
        """From spec.decoder's ProposerContext: the head loaded for the target, and the target's runner told
        which layers to expose (its steps with rows of speculating sequences then return them). At
        tensor_parallel_size > 1 the head is rank 0's, whole (it is not sharded): the runner's model is then
        parallel/runtime.py's ShardedModel, whose forward_aux gives rank 0's aux states (replicated on every rank)
        and whose embed gathers the rows from the ranks that hold them."""
        runner = ctx.runner
        if runner is None:
            raise Eagle3Error("speculative_config.method: eagle3 needs the target's runner")
        head = load_eagle3_head(spec_cfg.model, ctx.model_config, ctx.dtype, ctx.device, embed=runner.model.embed,
                                kernels=ctx.kernels)
        runner.aux_layers = head.aux_layers
        return cls(head, spec_cfg.num_speculative_tokens)

    def new_state(self, seq) -> Eagle3State:
        return Eagle3State()

    def observe(self, seq, state: Eagle3State, start: int, rows: torch.Tensor) -> None:
        state.observe(start, rows)

    def commit(self, seq, state: Eagle3State, accepted: int) -> None:
        pass   # the head's drafted positions are never kept: the next feed starts at the committed end

    def free(self, seq, state: Eagle3State) -> None:
        state.reset()

    def propose(self, rows) -> list[list[int]]:
        """Up to room drafts per row; a head that fails drafts nothing this step (its rows start over), the
        step and the requests go on (verification needs no drafts)."""
        try:
            return self._propose(rows)
        except Exception:   # (a tensor-parallel rank lost in the target's embed: the step's forward then fails)
            log.exception("EAGLE-3 head failed; %d row(s) draft nothing this step", len(rows))
            for r in rows:
                r.state.reset()
            return [[] for _ in rows]

    @torch.inference_mode()
    def _propose(self, rows) -> list[list[int]]:
        head = self.head
        out: list[list[int]] = [[] for _ in rows]
        feed_ids, feed_pos, feed_aux, segs, fed = [], [], [], [], []
        for i, r in enumerate(rows):
            seq, st = r.seq, r.state
            end = seq.num_computed            # positions < end hold committed tokens (and end + 1 tokens exist)
            if st.pend and st.pend_start < end:
                f0 = st.pend_start
                if f0 > st.n_kv or f0 < st.base or st.k is None:
                    st.rebase(f0)             # a gap (prefix-cache hit, preemption): the head starts over at f0
                st.n_kv = f0                  # positions from f0 on are fed again (drafted ones never kept)
                aux = torch.cat(st.pend)[:end - f0] if len(st.pend) > 1 else st.pend[0][:end - f0]
                row0 = sum(len(x) for x in feed_ids)
                feed_ids.append(seq.tokens[f0 + 1:end + 1])
                feed_pos.append(range(f0, end))
                feed_aux.append(aux)
                segs.append((st, row0, end - f0))
                fed.append(i)
                st.pend, st.pend_start = [], end
        dev = head.w["norm"].device
        firsts: dict[int, tuple[int, int, torch.Tensor]] = {}
        if segs:
            ids = torch.tensor([t for x in feed_ids for t in x], dtype=torch.int64, device=dev)
            pos = torch.tensor([p for x in feed_pos for p in x], dtype=torch.int64, device=dev)
            normed, pre = head.forward(ids, pos, head.combine(torch.cat(feed_aux)), segs)
            lasts = torch.tensor([r0 + n - 1 for _, r0, n in segs], dtype=torch.int64, device=dev)
            drafts = head.draft_ids(normed.index_select(0, lasts)).tolist()
            for j, i in enumerate(fed):
                st, r0, n = segs[j]
                st.n_kv = int(pos[r0 + n - 1]) + 1
                st.last = (st.n_kv - 1, drafts[j], pre[r0 + n - 1:r0 + n].clone())
        # every row whose head is current (fed now, or already at the committed end): its first draft
        active = []
        for i, r in enumerate(rows):
            st = r.state
            if st.last is not None and st.last[0] == r.seq.num_computed - 1 and st.n_kv == r.seq.num_computed:
                out[i].append(st.last[1])
                active.append(i)
        prev = {i: rows[i].state.last[2] for i in active}
        step = 1
        while True:
            active = [i for i in active if rows[i].room > step]
            if not active:
                break
            ids = torch.tensor([out[i][-1] for i in active], dtype=torch.int64, device=dev)
            pos = torch.tensor([rows[i].seq.num_computed - 1 + step for i in active], dtype=torch.int64, device=dev)
            segs = [(rows[i].state, j, 1) for j, i in enumerate(active)]
            normed, pre = head.forward(ids, pos, torch.cat([prev[i] for i in active]), segs)
            for j, (i, t) in enumerate(zip(active, head.draft_ids(normed).tolist())):
                out[i].append(t)
                prev[i] = pre[j:j + 1]
            step += 1
        return out
