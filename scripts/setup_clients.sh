#!/usr/bin/env bash
# Installs the benchmark clients that tests/test_real_clients.py drives unchanged, each apart from the project's
# .venv (they pin numpy 2, pandas, ... against its numpy<2), under .venv/clients/:
#   aiperf/         a venv with aiperf 0.13.0        (scripts/clients/aiperf.txt: all its packages, pinned)
#   genai-perf/     a venv with genai-perf 0.0.16    (scripts/clients/genai-perf.txt)
#   perf_analyzer/  Triton's perf_analyzer 2.51.0, the served tritonserver's own version, from the tritonclient
#                   2.51.0 wheel (PyPI's perf-analyzer package is a placeholder), with the two libraries it
#                   links against: libb64.so.0d (Debian's libb64-0d) and libcudart.so.12 (PyPI's
#                   nvidia-cuda-runtime-cu12; no GPU is needed)
#   bin/perf_analyzer  runs it with those libraries; genai-perf finds it there on PATH
# Idempotent: one stamp per tool, keyed by this script and the tool's lock file, skips what is installed. The two
# venvs install side by side. A tool that fails to install is reported and left out (its tests skip, or fail
# under CI=true); the exit status is 0 unless --strict.
# Cost (cold pip cache): aiperf ~230 MB of wheels, 1.2 GB installed; genai-perf ~190 MB, 0.95 GB; perf_analyzer
# 15 MB, 21 MB; about a minute in all.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST=.venv/clients
STRICT=0
[ "${1:-}" = "--strict" ] && STRICT=1
mkdir -p "$DEST/bin"
key() { cat scripts/setup_clients.sh "$@" | sha256sum | cut -c1-16; }

venv_tool() {   # name lockfile
    local name=$1 lock=$2 stamp
    stamp="$DEST/.installed-$name-$(key "$lock")"
    [ -f "$stamp" ] && return 0
    echo "[clients] installing $name into $DEST/$name"
    rm -rf "${DEST:?}/$name" "$DEST"/.installed-"$name"-*
    if "$PY" -m venv "$DEST/$name" &&
        "$DEST/$name/bin/python" -m pip install -q --upgrade pip &&
        "$DEST/$name/bin/python" -m pip install -q --no-deps -r "$lock" &&
        "$DEST/$name/bin/python" -m pip check >/dev/null; then
        touch "$stamp"
    else
        echo "[clients] could not install $name (log: $DEST/$name.log)"
        return 1
    fi
}

libb64() {   # Debian's libb64-0d into $1 (apt-get download needs no root; the package lists may need an update)
    local tmp
    tmp=$(mktemp -d)
    if ! (cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1); then
        if [ "$(id -u)" = 0 ]; then
            apt-get update -qq >/dev/null 2>&1
            (cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1) || { rm -rf "$tmp"; return 1; }
        else
            rm -rf "$tmp"
            return 1
        fi
    fi
    dpkg-deb -x "$tmp"/libb64-0d_*.deb "$tmp/x" && cp -L "$tmp"/x/usr/lib/*/libb64.so.0d "$1/"
    local rc=$?
    rm -rf "$tmp"
    return $rc
}

perf_analyzer_tool() {
    local stamp="$DEST/.installed-perf_analyzer-$(key)" pa="$DEST/perf_analyzer" pip=(.venv/bin/python -m pip)
    [ -f "$stamp" ] && return 0
    echo "[clients] installing perf_analyzer 2.51.0 into $pa"
    [ -x .venv/bin/python ] || pip=("$PY" -m pip)
    rm -rf "$pa" "$DEST"/.installed-perf_analyzer-*
    mkdir -p "$pa/bin" "$pa/lib" "$pa/wheels"
    if ! "${pip[@]}" download -q --no-deps -d "$pa/wheels" tritonclient==2.51.0 nvidia-cuda-runtime-cu12==12.6.77; then
        echo "[clients] could not download the tritonclient 2.51.0 / nvidia-cuda-runtime-cu12 wheels"
        return 1
    fi
    "$PY" - "$pa" <<'EOF' || return 1
import glob, os, sys, zipfile
pa = sys.argv[1]
for pattern, member, out in [("tritonclient-2.51.0-*.whl", "tritonclient-2.51.0.data/data/bin/perf_analyzer", "bin"),
                             ("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/lib/libcudart.so.12", "lib")]:
    with zipfile.ZipFile(glob.glob(os.path.join(pa, "wheels", pattern))[0]) as whl:
        path = os.path.join(pa, out, os.path.basename(member))
        with open(path, "wb") as f:
            f.write(whl.read(member))
        os.chmod(path, 0o755)
EOF
    rm -rf "$pa/wheels"
    if ! libb64 "$pa/lib"; then
        echo "[clients] could not fetch Debian's libb64-0d (apt-get download libb64-0d): perf_analyzer left out"
        return 1
    fi
    cat > "$DEST/bin/perf_analyzer" <<'EOF'
#!/bin/sh
# Triton's perf_analyzer 2.51.0 with the libraries it links against (scripts/setup_clients.sh)
pa="$(cd "$(dirname "$0")/../perf_analyzer" && pwd)"
LD_LIBRARY_PATH="$pa/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$pa/bin/perf_analyzer" "$@"
EOF
    chmod +x "$DEST/bin/perf_analyzer"
    if ! "$DEST/bin/perf_analyzer" --version >/dev/null 2>&1 && ! "$DEST/bin/perf_analyzer" -h 2>&1 | grep -q Usage; then
        echo "[clients] perf_analyzer does not run: $("$DEST/bin/perf_analyzer" -h 2>&1 | head -1)"
        return 1
    fi
    touch "$stamp"
}

venv_tool aiperf scripts/clients/aiperf.txt >"$DEST/aiperf.log" 2>&1 &
a=$!
venv_tool genai-perf scripts/clients/genai-perf.txt >"$DEST/genai-perf.log" 2>&1 &
g=$!
perf_analyzer_tool
p=$?
wait $a; a=$?
wait $g; g=$?
grep -h "^\[clients\]" "$DEST/aiperf.log" "$DEST/genai-perf.log"
failed=$((a != 0 || g != 0 || p != 0))
[ "$STRICT" = 1 ] && exit $failed
exit 0
