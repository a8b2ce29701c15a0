#!/usr/bin/env bash
# One command from a fresh clone to a running server: sets up .venv, builds the demo checkpoints
# when none is configured (A8W8 for qwen3_a8w8, bf16 for qwen3_tq), and starts tritonserver with
# every model of model_repository/ on localhost, and beside it the OpenAI front with the chat playground
# (http://127.0.0.1:9000/). Extra arguments go to tritonserver.
#   DEMO_SIZE=tiny ./scripts/serve.sh     # a seconds-to-build toy model instead of the Qwen3-0.6B shape
#   BIND_ADDRESS=0.0.0.0 ./scripts/serve.sh   # listen on every interface (default: 127.0.0.1 only)
#   OPENAI_FRONT=0 ./scripts/serve.sh     # tritonserver only; FRONT_PORT=9001 moves the front
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
SIZE="${DEMO_SIZE:-0.6b}"
build_demo() {  # $1 = format, $2 = env var that would point elsewhere
    local dir="demo_checkpoints/qwen3-${SIZE}-$1"
    if [ -n "${!2:-}" ]; then
        echo "[serve] $2=${!2}"
        return
    fi
    if [ ! -f "$dir/config.json" ]; then
        echo "[serve] building the $SIZE $1 demo checkpoint in $dir (random weights, real Qwen vocabulary)"
        python -m backend_lib.tools.make_demo_checkpoint "$dir" --size "$SIZE" --format "$1" --overwrite
    fi
    export "$2=$PWD/$dir"
}
build_demo a8w8 QWEN3_A8W8_CHECKPOINT
build_demo bf16 QWEN3_TQ_CHECKPOINT
# qwen3_embed: a Qwen3-Embedding-shaped demo (sentence-transformers files); qwen3_rerank reads the bf16 one
if [ -z "${QWEN3_EMBED_CHECKPOINT:-}" ]; then
    dir="demo_checkpoints/qwen3-embedding-${SIZE}-bf16"
    if [ ! -f "$dir/config.json" ]; then
        echo "[serve] building the $SIZE embedding demo checkpoint in $dir"
        python -m backend_lib.tools.make_demo_checkpoint "$dir" --size "$SIZE" --task embed --overwrite
    fi
    export QWEN3_EMBED_CHECKPOINT="$PWD/$dir"
fi
export QWEN3_RERANK_CHECKPOINT="${QWEN3_RERANK_CHECKPOINT:-$QWEN3_TQ_CHECKPOINT}"
export QWEN3_TOKENIZER_CHECKPOINT="${QWEN3_TOKENIZER_CHECKPOINT:-$QWEN3_TQ_CHECKPOINT}"
HTTP_PORT="${HTTP_PORT:-8000}"; GRPC_PORT="${GRPC_PORT:-8001}"; METRICS_PORT="${METRICS_PORT:-8002}"
BIND_ADDRESS="${BIND_ADDRESS:-127.0.0.1}"
FRONT_PORT="${FRONT_PORT:-9000}"
cat <<MSG
[serve] starting tritonserver on $BIND_ADDRESS (HTTP :$HTTP_PORT, gRPC :$GRPC_PORT, metrics :$METRICS_PORT).
        BIND_ADDRESS=0.0.0.0 exposes it beyond this machine. Once the models are READY,
        in another terminal:
          . .venv/bin/activate
          python -m client.stream --model qwen3_a8w8 --prompt "Hello" --url localhost:$GRPC_PORT
          python -m client.chat --url localhost:$GRPC_PORT          # chat through qwen3_a8w8_ensemble
          curl -N -X POST localhost:$HTTP_PORT/v2/models/qwen3_tq/generate_stream -d '{"text_input": "Hello", "max_tokens": 32, "stream": true}'
MSG
if [ "${OPENAI_FRONT:-1}" != 0 ]; then
    cat <<MSG
[serve] chat playground: http://$BIND_ADDRESS:$FRONT_PORT/   OpenAI API: http://$BIND_ADDRESS:$FRONT_PORT/v1
        (the OpenAI front, python -m openai_frontend; it lists the models once they are READY)
MSG
    python -m openai_frontend --triton-url "127.0.0.1:$GRPC_PORT" --host "$BIND_ADDRESS" --port "$FRONT_PORT" \
        --triton-metrics-url "http://127.0.0.1:$METRICS_PORT/metrics" --log-level warning &
    front=$!
    # The front lives as long as the server: after the exec below this shell's pid ($$) is the server's command.
    ( while kill -0 $$ 2>/dev/null && kill -0 "$front" 2>/dev/null; do sleep 1; done; kill "$front" 2>/dev/null ) &
else
    cat <<MSG
        The chat playground and the OpenAI API: python -m openai_frontend --triton-url localhost:$GRPC_PORT --port $FRONT_PORT,
        then http://127.0.0.1:$FRONT_PORT/
MSG
fi
# --exit-on-error=false: a model that fails to load stays UNAVAILABLE (with its error in the log) while the
# others serve, instead of taking the whole server down.
exec tritonserver --model-repository model_repository --exit-on-error=false \
    --http-address "$BIND_ADDRESS" --http-port "$HTTP_PORT" --grpc-address "$BIND_ADDRESS" --grpc-port "$GRPC_PORT" \
    --metrics-address "$BIND_ADDRESS" --metrics-port "$METRICS_PORT" "$@"
