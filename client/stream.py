"""Stream tokens from the Triton server over gRPC and print them as they arrive.

    python -m client.stream --model qwen3_a8w8 --prompt "Hello" [--max-tokens N] [--temperature T]
        [--top-p P] [--top-k K] [--seed S] [--stop STR] [--url localhost:8001]

Prints a summary at the end: time to first token, tokens/s, finish reason.
"""
from __future__ import annotations

import argparse
import queue
import sys
import time
import uuid

import tritonclient.grpc as grpcclient

from .triton_inputs import build_inputs, is_final, response_text


def stream_generate(url: str, model: str, prompt: str | None = None, input_ids=None, on_text=None, timeout=600.0,
                    **fields) -> dict:
    """Runs one streaming request; returns text, ids, responses, ttft, total time, finish_reason."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    fields.setdefault("return_finish_reason", True)
    inputs = build_inputs(prompt, input_ids, stream=True, **fields)
    t0 = time.perf_counter()
    client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    text, ids, n_resp, ttft, reason = [], [], 0, None, None
    try:
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            delta, new_ids = response_text(result)
            if new_ids:
                n_resp += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            text.append(delta)
            ids.extend(new_ids)
            fr = result.as_numpy("finish_reason")
            if fr is not None and len(fr):
                reason = fr[0].decode()
            if on_text and delta:
                on_text(delta)
            if is_final(result):
                break
    finally:
        client.stop_stream()
        client.close()
    return {"text": "".join(text), "output_ids": ids, "responses": n_resp, "ttft_s": ttft,
            "total_s": time.perf_counter() - t0, "finish_reason": reason}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_a8w8")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--url", default="localhost:8001", help="gRPC endpoint")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append")
    args = ap.parse_args(argv)
    model = args.model
    sampling = {k: v for k, v in {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                  "seed": args.seed}.items() if v is not None}
    try:
        res = stream_generate(args.url, model, args.prompt, max_tokens=args.max_tokens, stop_words=args.stop,
                              sampling_parameters=sampling or None,
                              on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    except Exception as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    n = len(res["output_ids"])
    decode = (n - 1) / (res["total_s"] - res["ttft_s"]) if n > 1 and res["total_s"] > res["ttft_s"] else 0.0
    print(f"\n[{n} tokens, finish_reason={res['finish_reason']}, time to first token "
          f"{(res['ttft_s'] or 0) * 1000:.0f} ms, {decode:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
