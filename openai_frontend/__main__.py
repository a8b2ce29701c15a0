"""python -m openai_frontend [--triton-url localhost:8001] [--triton-metrics-url URL] [--host 127.0.0.1] [--port 9000]
[--api-key KEY]
[--reasoning-parser qwen3|none] [--responses-store-count N] [--responses-store-mib MIB]
[--lora-modules name=path ...] [--lora-base-model MODEL]
[--request-read-timeout S] [--keep-alive-timeout S] [--max-connections N] [--send-buffer-kib KIB]"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import uvicorn

from backend_lib.contract.errors import RequestError
from .app import create_app
from .connections import (DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, DEFAULT_SEND_BUFFER,
                          bounded_h11)
from .responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openai_frontend",
                                 description="OpenAI-compatible HTTP front over the Triton LLM models.")
    ap.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC endpoint")
    ap.add_argument("--triton-metrics-url", default=None,
                    help="Triton's metrics page, appended to the front's /metrics (default: http://<triton host>:8002"
                         "/metrics; '' for none)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--api-key", default=os.environ.get("QWEN3_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $QWEN3_API_KEY)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for logprob token strings and /detokenize (default: the model's own)")
    ap.add_argument("--model-repository", default="model_repository",
                    help="Triton's model repository folder: a model's relative checkpoint path is resolved in it for "
                         "/detokenize and token strings (default: ./model_repository, as scripts/serve.sh runs)")
    ap.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"],
                    help="qwen3: the think block becomes reasoning_content; none: raw text as content")
    ap.add_argument("--responses-store-count", type=int, default=DEFAULT_MAX_RESPONSES,
                    help="/v1/responses: most responses kept for GET and previous_response_id (oldest evicted)")
    ap.add_argument("--responses-store-mib", type=float, default=DEFAULT_MAX_BYTES / 2**20,
                    help="/v1/responses: most MiB of stored responses (oldest evicted)")
    ap.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="LoRA adapters served as models: name=path or a JSON object {name, path, base_model_name} "
                         "(docs/lora.md); the parent model needs allow_runtime_lora")
    ap.add_argument("--lora-base-model", default=None,
                    help="the Triton LLM model adapters run on when they name none (default: the first one listed)")
    ap.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                    help="seconds a connection has to deliver a whole request (headers and body) after it opens or "
                         "after the previous response; else it is closed (silent and trickling clients)")
    ap.add_argument("--keep-alive-timeout", type=int, default=DEFAULT_KEEP_ALIVE_S,
                    help="seconds an idle keep-alive connection stays open between two requests")
    ap.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                    help="open connections at most; one more is answered 503 and closed at once")
    ap.add_argument("--send-buffer-kib", type=int, default=DEFAULT_SEND_BUFFER // 1024,
                    help="KiB a connection may hold unsent (socket and write buffer) before its response pauses; a "
                         "stream whose client stops reading is then ended after MAX_UNREAD responses")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--shutdown-timeout", type=float, default=3.0,
                    help="seconds a stop signal waits for open responses (after aborting their Triton streams)")
    args = ap.parse_args(argv)
    if args.request_read_timeout <= 0 or args.keep_alive_timeout < 1 or args.max_connections < 1 or \
            args.send_buffer_kib < 4:
        ap.error("--request-read-timeout must be > 0, --keep-alive-timeout and --max-connections >= 1, "
                 "--send-buffer-kib >= 4")
    tokenizer = None
    if args.tokenizer:
        from backend_lib.tokenizer import Tokenizer

        tokenizer = Tokenizer(args.tokenizer)
    if args.responses_store_count < 0 or args.responses_store_mib < 0:
        ap.error("--responses-store-count and --responses-store-mib must be >= 0")
    store = ResponseStore(args.responses_store_count, int(args.responses_store_mib * 2**20))
    from .lora import LoraAdapters, parse_lora_modules_arg

    try:
        loras = LoraAdapters(parse_lora_modules_arg(args.lora_modules), args.lora_base_model)
    except (ValueError, RequestError) as exc:
        ap.error(str(exc))
    app = create_app(args.triton_url, api_key=args.api_key, tokenizer=tokenizer,
                     reasoning=args.reasoning_parser == "qwen3", responses_store=store, loras=loras,
                     triton_metrics_url=args.triton_metrics_url,
                     model_repository=os.path.abspath(args.model_repository) if args.model_repository else None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=args.keep_alive_timeout,
                            http=bounded_h11(args.request_read_timeout, args.max_connections,
                                             args.send_buffer_kib * 1024))
    BoundedShutdownServer(config, app.state.gateway).run()
    return 0


class BoundedShutdownServer(uvicorn.Server):
    """uvicorn, with a stop that does not wait on clients. On SIGTERM/SIGINT uvicorn stops accepting and waits
    for open responses to end, without bound by default, and only then runs the app's shutdown (which aborts
    the Triton streams): a 4,000-token stream is served to its end, and a client that stopped reading holds
    the process for as long as it stays connected. Here the signal aborts every Triton stream at once (each
    open response gets its final chunk, finish_reason "abort"), and uvicorn's graceful wait is bounded
    (--shutdown-timeout): responses still open then, slow readers included, are cancelled."""

    def __init__(self, config, gateway):
        super().__init__(config)
        self._gateway = gateway
        self._loop = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self._gateway.abort_all)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
