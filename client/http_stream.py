"""Stream from the HTTP generate extension (server-sent events), standard library only.

    python -m client.http_stream --model qwen3_a8w8 --prompt "Hello" [--max-tokens 64] [--url localhost:8000]

The same request with curl:
    curl -N -X POST localhost:8000/v2/models/qwen3_a8w8/generate_stream \\
         -d '{"text_input": "Hello", "max_tokens": 64, "stream": true}'
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys


def generate_stream(url: str, model: str, body: dict):
    """Yields the JSON object of every server-sent event."""
    host, _, port = url.partition(":")
    conn = http.client.HTTPConnection(host, int(port or 8000), timeout=600)
    conn.request("POST", f"/v2/models/{model}/generate_stream", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
    try:
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                event = json.loads(line[5:].strip())
                if "error" in event:
                    raise RuntimeError(event["error"])
                yield event
    finally:
        conn.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_a8w8")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--url", default="localhost:8000", help="HTTP endpoint")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=None)
    args = ap.parse_args(argv)
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "stream": True}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    try:
        for event in generate_stream(args.url, args.model, body):
            sys.stdout.write(event.get("text_output", ""))
            sys.stdout.flush()
    except Exception as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
