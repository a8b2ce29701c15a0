"""Embedding throughput and query latency: backend_lib.embedding vs sentence-transformers on the same checkpoint
folder and the same CPU, in one process, interleaved round by round (on a shared host only the ratios mean
something).

    python -m bench.embed --checkpoint DIR [--a8w8 DIR] [--texts 512] [--tokens 128] [--query-tokens 32]
        [--rounds 3] [--st-dtype float32|bfloat16] [--json]

Throughput: `--texts` texts of about `--tokens` tokens each, embedded in one call (ours: tokenize + ragged
forwards of max_batch_tokens; sentence-transformers: encode(batch_size=32), padded batches). Latency: one query
of about `--query-tokens` tokens, the median of 5 calls. Issue 36's targets: throughput >= 2x, latency <= 0.5x.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def make_texts(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    """Texts of random ordinary tokens whose encoding is about `tokens` long (the same texts for both systems)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1000, 30000) for _ in range(tokens - 1)]
        text = tokenizer.decode(ids)
        out.append(text)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a Qwen3-Embedding folder (bf16; sentence-transformers loads it)")
    ap.add_argument("--a8w8", help="the same model as compressed-tensors W8A8 (ours only)")
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--query-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--st-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from backend_lib.embedding.model import EmbedConfig, EmbeddingModel, cosine

    ours = {"ours bf16": EmbeddingModel(EmbedConfig(args.checkpoint, device="cpu",
                                                    max_batch_tokens=args.max_batch_tokens))}
    if args.a8w8:
        ours["ours a8w8"] = EmbeddingModel(EmbedConfig(args.a8w8, device="cpu", max_batch_tokens=args.max_batch_tokens))
    st = SentenceTransformer(args.checkpoint, device="cpu", model_kwargs={"dtype": getattr(torch, args.st_dtype)})
    name_st = f"sentence-transformers {args.st_dtype}"
    any_model = next(iter(ours.values()))
    texts = make_texts(any_model.tokenizer, args.texts, args.tokens, 0)
    query = make_texts(any_model.tokenizer, 1, args.query_tokens, 1)[0]
    lengths = [len(any_model.encode(t)) for t in texts]

    def run_ours(m, batch):
        return m.embed([m.encode(t) for t in batch])

    def run_st(batch):
        with torch.inference_mode():
            return st.encode(batch, batch_size=32, convert_to_tensor=True)

    # warm-up and agreement
    agree = {}
    ref = run_st(texts[:4])
    for name, m in ours.items():
        mine = run_ours(m, texts[:4])
        agree[name] = min(cosine(a, b.float()) for a, b in zip(mine, ref))
    rows = []
    for r in range(args.rounds):
        for name, fn in [(k, (lambda m=m: run_ours(m, texts))) for k, m in ours.items()] + [(name_st,
                                                                                          lambda: run_st(texts))]:
            s = _timed(fn)
            rows.append({"round": r, "system": name, "mode": "throughput", "texts": len(texts), "seconds": s,
                         "texts_per_s": len(texts) / s, "tokens_per_s": sum(lengths) / s})
        for name, fn in [(k, (lambda m=m: run_ours(m, [query]))) for k, m in ours.items()] + [(name_st,
                                                                                            lambda: run_st([query]))]:
            lat = statistics.median(_timed(fn) for _ in range(5))
            rows.append({"round": r, "system": name, "mode": "latency", "seconds": lat})
    summary = {"texts": len(texts), "mean_tokens": sum(lengths) / len(lengths),
               "query_tokens": len(any_model.encode(query)), "threads": torch.get_num_threads(),
               "min_cosine_vs_st": agree}
    for name in ours:
        tp = [x["texts_per_s"] for x in rows if x["system"] == name and x["mode"] == "throughput"]
        tp_st = [x["texts_per_s"] for x in rows if x["system"] == name_st and x["mode"] == "throughput"]
        lat = [x["seconds"] for x in rows if x["system"] == name and x["mode"] == "latency"]
        lat_st = [x["seconds"] for x in rows if x["system"] == name_st and x["mode"] == "latency"]
        summary[name] = {"throughput_ratio": statistics.median(a / b for a, b in zip(tp, tp_st)),
                         "latency_ratio": statistics.median(a / b for a, b in zip(lat, lat_st)),
                         "texts_per_s": statistics.median(tp), "query_ms": statistics.median(lat) * 1e3}
    summary[name_st] = {"texts_per_s": statistics.median(x["texts_per_s"] for x in rows if x["system"] == name_st
                                                         and x["mode"] == "throughput"),
                        "query_ms": statistics.median(x["seconds"] for x in rows if x["system"] == name_st
                                                      and x["mode"] == "latency") * 1e3}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}))
    else:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
