"""Structured output cost: decode tokens/s at batch 8 with every request under a JSON schema vs none, and a
batch mixing 4 constrained with 4 free requests; grammar compile time for a typical schema (cold, cached).

    python -m bench.structured [--checkpoint demo_checkpoints/qwen3-0.6b-a8w8] [--tokens 64] [--repeats 3]

In-process engine, greedy, rounds interleaved (free, constrained, mixed, free, ...) so that the machine's
bandwidth swings hit every case alike. The schema keeps a random-weight model writing (one free string
field), so every request runs its full length and the figures compare equal token counts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["title", "year"]}
TYPICAL = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "emails": {"type": "array", "items": {"type": "string", "format": "email"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                "required": ["street"]},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="demo_checkpoints/qwen3-0.6b-a8w8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine
    from backend_lib.contract.structured import StructuredSpec

    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache_memory="1GiB", max_num_seqs=8,
                                 max_model_len=1024, max_num_batched_tokens=512))
    prompt = eng.tokenizer.encode("Write the record as JSON:")
    free = {"temperature": 0, "max_tokens": args.tokens, "ignore_eos": True}
    constrained = {**free, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}

    t = time.perf_counter()
    eng.grammar.matcher(StructuredSpec.parse({"json": TYPICAL}), False)   # cold: tokenizer view + compile
    first = time.perf_counter() - t
    t = time.perf_counter()
    eng.grammar.matcher(StructuredSpec.parse({"json": {**TYPICAL, "title": "v2"}}), False)   # new schema
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    eng.grammar.matcher(StructuredSpec.parse({"json": TYPICAL}), False)   # cached
    cached_s = time.perf_counter() - t

    def decode_rate(datas) -> tuple[float, list[float]]:
        """Batch tokens/s after the first token of every request (prefill excluded), and each row's rate."""
        params = [eng.make_params(d) for d in datas]
        for i, p in enumerate(params):
            eng.add_request(f"r{time.monotonic_ns()}-{i}", prompt, p)
        first_at, last_at, counts = {}, {}, {}
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.new_token_ids:
                    counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
                    first_at.setdefault(o.request_id, now)
                    last_at[o.request_id] = now
        start, end = max(first_at.values()), max(last_at.values())
        total = sum(counts.values()) - len(counts)
        rows = [(counts[r] - 1) / max(last_at[r] - first_at[r], 1e-9) for r in counts]
        return total / (end - start), rows

    cases = {"free x8": [free] * 8, "json x8": [constrained] * 8, "mixed 4+4": [constrained] * 4 + [free] * 4}
    decode_rate([free] * 8)   # warm-up
    rates: dict[str, list[float]] = {k: [] for k in cases}
    free_rows_mixed: list[float] = []
    free_rows_alone: list[float] = []
    for _ in range(args.repeats):
        for name, datas in cases.items():
            total, rows = decode_rate(datas)
            rates[name].append(total)
            if name == "mixed 4+4":
                free_rows_mixed.append(statistics.mean(rows[4:]))
            if name == "free x8":
                free_rows_alone.append(statistics.mean(rows))
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"checkpoint": args.checkpoint, "tokens": args.tokens, "repeats": args.repeats,
           "decode_tok_s": {k: round(v, 1) for k, v in med.items()},
           "json_vs_free": round(med["json x8"] / med["free x8"], 3),
           "mixed_free_rows_vs_all_free": round(statistics.median(free_rows_mixed) / statistics.median(free_rows_alone), 3),
           "compile_ms": {"first_request_incl_tokenizer_view": round(first * 1e3, 1),
                          "new_schema": round(compile_s * 1e3, 2), "cached": round(cached_s * 1e3, 3)}}
    if args.json:
        print(json.dumps(out))
        return
    for k, v in med.items():
        print(f"{k:>10}: {v:8.1f} decode tok/s (median of {args.repeats})")
    print(f"json x8 / free x8: {out['json_vs_free']:.3f}; free rows in the mixed batch vs an all-free batch: "
          f"{out['mixed_free_rows_vs_all_free']:.3f}")
    print(f"grammar: first request {out['compile_ms']['first_request_incl_tokenizer_view']} ms (builds the "
          f"tokenizer view), a new schema {out['compile_ms']['new_schema']} ms, cached {out['compile_ms']['cached']} ms")


if __name__ == "__main__":
    main()
