"""Builds an EAGLE-3 head for a target checkpoint, in the exact layout of the public Qwen3 EAGLE-3 heads
(backend_lib/spec/eagle3.py): random weights, or `--copy`, a hand-built "induction" head that drafts the token
which followed the current token's earlier occurrences (for tests that must see accepted drafts).

    python -m backend_lib.tools.make_eagle3_head TARGET OUT [--draft-vocab N] [--layout eagle3|speculators]
        [--aux-layers A,B,C] [--embed] [--copy] [--seed N]

The head's shapes are the target's (hidden, heads, KV heads, head_dim, intermediate), as the Qwen3-8B heads
mirror Qwen3-8B's (Tengyunw/qwen3_8b_eagle3, AngelSlim/Qwen3-8B_eagle3: hidden 4096, 32 heads, 8 KV heads,
intermediate 12288, draft vocabulary 32000). The draft vocabulary is a random sorted subset of the target's
(the public heads keep the most frequent tokens): d2t[i] = target id - i, t2d marks the kept target ids.

--copy: a trained head predicts the token after next from the target's hidden states; no such head can be built
by hand for random weights (the target's state at position p predicts token p + 1, which the head already reads).
What can be built is an induction head over the head's own cache: aux layer 0 (the target's embeddings: the aux
ids must start with 0) passes through fc, so the key at position p' is the embedding of token p' while its value
is the embedding of token p' + 1 (the head's input there); the query, the embedding of the current token, finds
the earlier positions holding that token and copies what followed it (RoPE made position-blind: rope_theta 1e300
and the first rotary pair unused). Drafts of a loop (the random demo weights fall into loops) are then accepted.
An instrument for tests, in the published layout; not a trained head.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build(target: str | Path, out: str | Path, draft_vocab: int | None = 32000, layout: str = "eagle3",
          aux_layers: list[int] | None = None, embed: bool = False, copy: bool = False, seed: int = 0,
          std: float = 0.02) -> Path:
    from safetensors.torch import save_file

    from ..checkpoint import ModelConfig, WeightStore

    tc = ModelConfig.from_dir(target)
    hid, H, KV, d, inter, V = (tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size,
                               tc.vocab_size)
    if copy:
        aux_layers = aux_layers or [0, 1, 2]
        if min(aux_layers) != 0:
            raise ValueError("--copy: the aux layers must include 0 (the target's embeddings)")
        if hid % d or hid // d > KV:
            raise ValueError(f"--copy: hidden {hid} must be a multiple of head_dim {d}, at most {KV} of them")
        draft_vocab = V
    draft_vocab = min(draft_vocab or V, V)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    p = "layers.0" if layout == "speculators" else "midlayer"
    t = {
        "fc.weight": rand(hid, 3 * hid),
        f"{p}.input_layernorm.weight": ones(hid),
        f"{p}.hidden_norm.weight": ones(hid),
        f"{p}.self_attn.q_proj.weight": rand(H * d, 2 * hid),
        f"{p}.self_attn.k_proj.weight": rand(KV * d, 2 * hid),
        f"{p}.self_attn.v_proj.weight": rand(KV * d, 2 * hid),
        f"{p}.self_attn.o_proj.weight": rand(hid, H * d),
        f"{p}.post_attention_layernorm.weight": ones(hid),
        f"{p}.mlp.gate_proj.weight": rand(inter, hid),
        f"{p}.mlp.up_proj.weight": rand(inter, hid),
        f"{p}.mlp.down_proj.weight": rand(hid, inter),
        "norm.weight": ones(hid),
        "lm_head.weight": rand(draft_vocab, hid),
    }
    if draft_vocab < V:
        ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    else:
        ids = torch.arange(V)
    t["d2t"] = (ids - torch.arange(draft_vocab)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    rope_theta, norm_before_residual = 1_000_000.0, False
    if copy:
        store = WeightStore(target)
        emb = store.get("model.embed_tokens.weight").float()
        store.release()
        m, group, scale = hid // d, H // KV, 4.0
        fc = torch.zeros(hid, 3 * hid)
        fc[:, :hid] = torch.eye(hid)                # aux layer 0: the embedding of token p
        A = torch.randn(d, hid, generator=g) / hid ** 0.5 * scale
        A[0] = A[d // 2] = 0                        # the rotary pair that turns at 1 rad / position: unused
        q, k, v, o = (torch.zeros(H * d, 2 * hid), torch.zeros(KV * d, 2 * hid), torch.zeros(KV * d, 2 * hid),
                      torch.zeros(hid, H * d))
        for j in range(m):                          # kv head j carries hidden dims j*d .. (j+1)*d - 1
            h = j * group
            q[h * d:(h + 1) * d, :hid] = A          # query: the current token's (normed) embedding
            k[j * d:(j + 1) * d, hid:] = A          # key: token p' (fc's aux 0, hidden_norm)
            v[j * d:(j + 1) * d, j * d:(j + 1) * d] = torch.eye(d)   # value: token p' + 1 (the head's input)
            o[j * d:(j + 1) * d, h * d:(h + 1) * d] = torch.eye(d) * 8.0
        for name, val in (("fc.weight", fc), (f"{p}.self_attn.q_proj.weight", q), (f"{p}.self_attn.k_proj.weight", k),
                          (f"{p}.self_attn.v_proj.weight", v), (f"{p}.self_attn.o_proj.weight", o),
                          ("lm_head.weight", emb)):
            t[name] = val.to(torch.bfloat16)
        t[f"{p}.mlp.down_proj.weight"].zero_()
        rope_theta = 1e300
        norm_before_residual = True                 # the residual is the normed hidden: the copied value dominates
    if embed:
        t["embed_tokens.weight"] = rand(V, hid)
    layer = {"architectures": ["LlamaForCausalLM"] if layout == "speculators" else ["LlamaForCausalLMEagle3"],
             "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0, "head_dim": d,
             "hidden_act": "silu", "hidden_size": hid, "initializer_range": std, "intermediate_size": inter,
             "max_position_embeddings": tc.max_position_embeddings, "num_attention_heads": H,
             "num_hidden_layers": 1, "num_key_value_heads": KV, "rms_norm_eps": tc.rms_norm_eps,
             "rope_scaling": None, "rope_theta": rope_theta, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": V}
    if layout == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual, "target_hidden_size": hid,
                  "eagle_aux_hidden_state_layer_ids": aux_layers, "transformer_layer_config": layer,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"architectures": ["Qwen3ForCausalLM"],
                                                      "name_or_path": str(target)}}}
    else:
        config = {**layer, "draft_vocab_size": draft_vocab}
        if norm_before_residual:
            config["norm_before_residual"] = True
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers),
                                      "use_aux_hidden_state": True}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--layout", choices=("eagle3", "speculators"), default="eagle3")
    ap.add_argument("--aux-layers", default=None, help="three target layer ids, e.g. 2,14,25 (default: vLLM's)")
    ap.add_argument("--embed", action="store_true", help="write the head's own embed_tokens.weight")
    ap.add_argument("--copy", action="store_true", help="an induction head: drafts what followed the current token")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    aux = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None
    print(build(a.target, a.out, a.draft_vocab, a.layout, aux, a.embed, a.copy, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
