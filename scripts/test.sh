#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite. Extra arguments go to pytest
# (e.g. `-m "not slow"` for the quick tests, `-m slow` for the tritonserver ones).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q "$@"
