"""Embeddings and rerank scores from a Qwen3 checkpoint, over the decoder the LLM models run.

Each text is its own ragged sequence of one flattened forward (the LLM's prefill: `query_start_loc` says
where each sequence's rows are), never a padded batch: the kernels are batch invariant, so a text's hidden
states, and its vector, are the bits it gets alone, whatever else shares the forward (tests/test_embedding.py
checks that bit for bit). No KV cache outlives a forward: the attention of layer i reads only layer i's keys,
written by the same forward, so every layer shares one scratch page pool (one layer's worth of memory).

    embed:  hidden rows -> pooling (the checkpoint's sentence-transformers config: last token, mean or cls)
            -> fp32 -> [truncated to `dimensions`] -> L2-normalized (when the checkpoint has Normalize)
    rerank: Qwen3-Reranker's prompt (rerank_prompt.py) -> fp32 logits of the last row -> P(yes) over [no, yes]
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint import ModelConfig, WeightStore, parse_quantization_config
from ..checkpoint.errors import CheckpointError
from ..device import bind_device, parse_dtype, resolve_device
from ..kernels import get_kernels
from ..kv_cache.dense import DenseKVCache
from ..kv_cache.metadata import AttentionMetadata
from ..models import Qwen3ForCausalLM
from ..contract.errors import RequestError
from . import rerank_prompt
from .st_config import EmbeddingSpec

log = logging.getLogger(__name__)
TASKS = ("embed", "rerank")


class _ModelPrefix:
    """A Qwen3Model checkpoint (sentence-transformers saves the bare model: `layers.0...`, `norm.weight`) read
    under Qwen3ForCausalLM's names (`model.layers.0...`)."""

    def __init__(self, store: WeightStore):
        self.store = store

    def _name(self, name: str) -> str:
        return name[len("model."):] if name.startswith("model.") else name

    def has(self, name: str) -> bool:
        return self.store.has(self._name(name))

    def get(self, name, shape=None, dtypes=None):
        return self.store.get(self._name(name), shape, dtypes)

    def names(self) -> list[str]:
        return ["model." + n for n in self.store.names()]

    def release(self) -> None:
        self.store.release()


@dataclass
class EmbedConfig:
    checkpoint: str
    task: str = "embed"                   # embed | rerank
    tokenizer: str | None = None          # folder with tokenizer.json; default: the checkpoint
    device: str = "auto"
    dtype: str = "bfloat16"
    kernels: str = "auto"
    kernel_cache_dir: str | None = None
    max_model_len: int | None = None      # tokens per input; default: sentence_bert_config's max_seq_length, else
                                          # the checkpoint's positions
    max_batch_tokens: int = 4096          # tokens of one forward (a batch beyond it runs as several)
    page_size: int = 16
    num_threads: int | None = None
    cpu_cores: str | None = None

    INT_FIELDS = ("max_model_len", "max_batch_tokens", "page_size", "num_threads")

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "EmbedConfig":
        """From string parameters (Triton config.pbtxt); unknown names are an error naming them."""
        known = [f for f in cls.__dataclass_fields__]
        kwargs = {}
        for key, raw in params.items():
            if key not in known:
                raise ValueError(f"parameter {key!r} is not known (known: {', '.join(sorted(known))})")
            value = raw.strip() if isinstance(raw, str) else raw
            if value in ("", None):
                continue
            if key in cls.INT_FIELDS:
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"parameter {key!r}: {value!r} is not an integer") from None
                if value <= 0:
                    raise ValueError(f"parameter {key!r}: must be positive, got {value}")
            kwargs[key] = value
        if "checkpoint" not in kwargs:
            raise ValueError("parameter 'checkpoint' is required")
        cfg = cls(**kwargs)
        if cfg.task not in TASKS:
            raise ValueError(f"parameter 'task': {cfg.task!r} is not one of {', '.join(TASKS)}")
        return cfg


class EmbeddingModel:
    """Embeddings (task embed) or rerank scores (task rerank) of token id lists. Thread: one caller at a time."""

    def __init__(self, cfg: EmbedConfig):
        from tokenizers import Tokenizer as HFTokenizer

        from .. import cpu_policy

        t0 = time.time()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        bind_device(self.device)
        self.dtype = parse_dtype(cfg.dtype, self.device)
        cpu_policy.apply(cfg.cpu_cores, cfg.num_threads)
        folder = Path(cfg.checkpoint)
        mc = ModelConfig.from_dir(folder)
        scheme = parse_quantization_config(mc.quantization_config)
        store = WeightStore(folder)
        if not store.has("model.embed_tokens.weight") and store.has("embed_tokens.weight"):
            store = _ModelPrefix(store)
        headless = isinstance(store, _ModelPrefix) or not (store.has("lm_head.weight") or mc.tie_word_embeddings)
        if headless and cfg.task == "rerank":
            raise CheckpointError("task rerank: the checkpoint has no lm_head (a Qwen3-Reranker is a "
                                  "Qwen3ForCausalLM whose yes/no logits are read)")
        if headless:
            mc = replace(mc, tie_word_embeddings=True)   # no head is used: the embedding is read from its rows
        self.spec = EmbeddingSpec.from_dir(folder) if cfg.task == "embed" else None
        positions = mc.max_position_embeddings
        default_len = (self.spec.max_seq_length if self.spec and self.spec.max_seq_length else None) or positions
        self.max_model_len = min(cfg.max_model_len or default_len, positions)
        self.kernels = get_kernels(self.device, cfg.kernels, cfg.kernel_cache_dir)
        self.model = Qwen3ForCausalLM.from_checkpoint(store, mc, scheme, self.dtype, self.device, self.kernels,
                                                      self.max_model_len)
        self.model_config = mc
        self.hidden_size = mc.hidden_size
        self.quantization = scheme.kind if scheme else None
        S = self.page_size = cfg.page_size
        self.batch_tokens = max(cfg.max_batch_tokens, self.max_model_len)
        self.num_pages = -(-self.batch_tokens // S) + 64   # each sequence wastes under a page
        scratch = DenseKVCache(1, self.num_pages, S, mc.num_kv_heads, mc.head_dim, self.dtype, self.device,
                               self.kernels)
        scratch.k, scratch.v = scratch.k * mc.num_layers, scratch.v * mc.num_layers   # one pool, every layer
        self.scratch = scratch
        tok_dir = Path(cfg.tokenizer or folder)
        try:
            self.tokenizer = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
        except Exception as exc:
            raise CheckpointError(f"tokenizer: {tok_dir / 'tokenizer.json'} could not be loaded ({exc})") from None
        self.vocab = mc.vocab_size
        if cfg.task == "rerank":
            self.yes_no = [self._single_token(rerank_prompt.NO), self._single_token(rerank_prompt.YES)]
        log.info("%s model ready in %.1fs: %s, %s, max_model_len %d, %d tokens per forward", cfg.task,
                 time.time() - t0, self.quantization or "float", self.dtype, self.max_model_len, self.batch_tokens)

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise CheckpointError(f"task rerank: {text!r} is not one token of the checkpoint's vocabulary")
        return ids[0]

    # ----- tokens ---------------------------------------------------------------------------------------
    def encode(self, text: str, prompt: str = "") -> list[int]:
        """A text's ids as sentence-transformers gets them: the prompt prepended, the tokenizer's special tokens
        (Qwen3-Embedding's post-processor appends <|endoftext|>)."""
        return self.tokenizer.encode(prompt + text, add_special_tokens=True).ids

    def check_ids(self, ids: list[int], field: str) -> None:
        if not ids:
            raise RequestError(f"{field}: is empty")
        if len(ids) > self.max_model_len:
            raise RequestError(f"{field}: has {len(ids)} tokens; the model takes at most {self.max_model_len} "
                               "per input (max_model_len)")
        bad = next((i for i in ids if not 0 <= i < self.vocab), None)
        if bad is not None:
            raise RequestError(f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab})")

    def rerank_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        def enc(text):
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        return (enc(rerank_prompt.PREFIX) + self.tokenizer.encode(
            rerank_prompt.user_message(query, document, instruction), add_special_tokens=True).ids
            + enc(rerank_prompt.SUFFIX))

    # ----- forward --------------------------------------------------------------------------------------
    def _batches(self, seqs: list[list[int]]):
        """Consecutive groups that fit one forward's pages."""
        S, group, pages = self.page_size, [], 0
        for i, ids in enumerate(seqs):
            need = -(-len(ids) // S)
            if group and (pages + need > self.num_pages or sum(len(seqs[j]) for j in group) + len(ids) >
                          self.batch_tokens):
                yield group
                group, pages = [], 0
            group.append(i)
            pages += need
        if group:
            yield group

    @torch.inference_mode()
    def hidden(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Final-normed hidden states [len, hidden] of each sequence (each checked by check_ids first)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        S, dev = self.page_size, self.device
        for group in self._batches(seqs):
            ids, positions, slots, qsl, lens, tables = [], [], [], [0], [], []
            page = 0
            for i in group:
                n = len(seqs[i])
                pages = list(range(page, page + -(-n // S)))
                page += len(pages)
                ids.extend(seqs[i])
                positions.extend(range(n))
                slots.extend(pages[p // S] * S + p % S for p in range(n))
                qsl.append(qsl[-1] + n)
                lens.append(n)
                tables.append(pages)
            width = max(len(t) for t in tables)
            block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
            for b, t in enumerate(tables):
                block_tables[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
            meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                                     block_tables=block_tables.to(dev),
                                     query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                                     seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev))
            h = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                                   torch.tensor(positions, dtype=torch.int64, device=dev), self.scratch, meta)
            for b, i in enumerate(group):
                out[i] = h[qsl[b]:qsl[b + 1]]
        return out

    def embed(self, seqs: list[list[int]], dimensions: list[int | None] | None = None) -> list[torch.Tensor]:
        """fp32 vectors [hidden] (or [dimensions[i]]) of each id list."""
        spec = self.spec
        if spec is None:
            raise RequestError("this model reranks; it does not embed (task rerank)")
        vectors = []
        for i, h in enumerate(self.hidden(seqs)):
            if spec.pooling == "lasttoken":
                v = h[-1].float()
            elif spec.pooling == "cls":
                v = h[0].float()
            else:
                v = h.float().mean(0)
            d = dimensions[i] if dimensions else None
            if d is not None:
                v = v[:d]
            if spec.normalize:
                v = v / v.norm().clamp_min(1e-12)
            vectors.append(v.cpu())
        return vectors

    def check_dimensions(self, d: int | None, field: str = "dimensions") -> None:
        if d is not None and not 1 <= d <= self.hidden_size:
            raise RequestError(f"{field}: {d} is outside [1, {self.hidden_size}] (the model's embedding size)")

    @torch.inference_mode()
    def rerank(self, seqs: list[list[int]]) -> list[float]:
        """P(yes) of each rerank prompt (rerank_ids)."""
        if self.cfg.task != "rerank":
            raise RequestError("this model embeds; it does not rerank (task embed)")
        scores = []
        for h in self.hidden(seqs):
            logits = self.model.logits(h[-1:])[0, self.yes_no]
            scores.append(float(torch.softmax(logits.float(), dim=0)[1]))
        return scores


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() @ b.double()) / max(math.sqrt(float(a.double() @ a.double()) *
                                                           float(b.double() @ b.double())), 1e-300))
