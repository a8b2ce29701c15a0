#!/usr/bin/env bash
# Creates .venv at the repo root and installs the project into it: the runtime, the demo checkpoint builder
# (serve.sh), the OpenAI front and the test tools (pyproject.toml's demo, openai and test extras).
# Idempotent: a stamp keyed by pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing the project into .venv (torch 2.13.0 CPU, Triton server from nvidia-pytriton, ...)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[demo,openai,test]"
    rm -f .venv/.installed-*
    touch "$stamp"
fi
