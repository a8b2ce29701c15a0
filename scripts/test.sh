#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite. Extra arguments go to pytest
# (e.g. `-m "not slow"` for the quick tests, `-m slow` for the tritonserver ones).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The playground's browser test drives headless Chromium (Debian's chromium package); without it that test skips,
# naming the package. Installed here when this is a root shell with apt-get (CI containers); never fatal.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing chromium for the playground's browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
        >/dev/null 2>&1 || echo "[test] could not install chromium: tests/test_playground.py will skip"
fi
# The benchmark clients of tests/test_real_clients.py (aiperf, genai-perf, perf_analyzer), each in its own venv
# under .venv/clients (their numpy 2 conflicts with the project's): about a minute the first time, then instant;
# never fatal (a tool left out skips its tests, or fails them under CI=true).
./scripts/setup_clients.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q --durations=30 "$@"
