"""Compiles the C++ CPU kernels at load (torch.utils.cpp_extension + ninja), cached on disk.

The build is keyed by the sources, the compiler flags, the torch version and the CPU's
instruction-set flags, so a cache folder can be shared across restarts (warm load: well under a
second) and a different machine never picks up a binary built for other instructions.

`$QWEN3_CPU_ISA` picks the instruction set the kernels are built for: `native` (the default: all this host
has, `-march=native`), `avx2vnni` (AVX2 + FMA + 256-bit AVX-VNNI, no AVX-512: an Alder Lake+ / Zen 5 client
host), `avx2` (AVX2 + FMA only, no AVX-512 and no AVX-VNNI: a Haswell..Zen 3 host) or `scalar` (no AVX2, no
FMA). Each only takes instructions away from `-march=native` (ISA_FLAGS), so any of them runs on this host, and
the AVX2 / scalar paths of csrc/ can be built, tested and measured on an AVX-512 machine. The builds differ
from one another in their float sums (16, 8 or 1 lanes), each is batch invariant and deterministic; the A8W8
GEMV's int32 sums are exact on all of them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
LIB_NAME = "qwen3_cpu"
_lock = threading.Lock()
_state: dict = {}


def default_cache_dir() -> Path:
    env = os.environ.get("QWEN3_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen3_triton" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return platform.processor()


# The compiler flags of each $QWEN3_CPU_ISA build, added after -march=native (one home: tests/isa_bits.py uses them).
ISA_FLAGS = {
    "native": [],
    "avx2vnni": ["-mno-avx512f"],
    "avx2": ["-mno-avx512f", "-mno-avxvnni"],
    "scalar": ["-mno-avx512f", "-mno-avxvnni", "-mno-avx2", "-mno-fma"],
}


def cpu_isa() -> str:
    """$QWEN3_CPU_ISA (default native); an unknown value is an error naming the variable, never ignored."""
    isa = os.environ.get("QWEN3_CPU_ISA", "").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"QWEN3_CPU_ISA={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"QWEN3_CPU_ISA={isa!r}: only x86-64 builds take an ISA (this is {platform.machine()})")
    return isa


def _cflags(isa: str | None = None) -> list[str]:
    """The kernel set's compiler flags for `isa` (default: $QWEN3_CPU_ISA)."""
    flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
        flags += ISA_FLAGS[isa or cpu_isa()]
    else:
        flags.append("-mcpu=native")
    return flags


def _build_key(sources: list[Path], cflags: list[str]) -> str:
    h = hashlib.sha256()
    for src in sorted(CSRC.iterdir()):
        if src.suffix in (".cpp", ".h"):
            h.update(src.name.encode())
            h.update(src.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def load_cpu_extension(cache_dir: str | os.PathLike | None = None) -> bool:
    """Builds (or loads from cache) the CPU kernels; returns False where no compiler can build them."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        _state["ok"] = _load(Path(cache_dir) if cache_dir else default_cache_dir())
        return _state["ok"]


def _load(cache_dir: Path) -> bool:
    if hasattr(torch.ops, LIB_NAME) and hasattr(getattr(torch.ops, LIB_NAME), "float_linear"):
        return True
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: using the pure-PyTorch reference kernels (slower)")
        return False
    sources = sorted(p for p in CSRC.iterdir() if p.suffix == ".cpp")
    cflags = _cflags()   # a bad $QWEN3_CPU_ISA raises here, before the fallback below
    key = _build_key(sources, cflags)
    build_dir = cache_dir / f"{LIB_NAME}_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    so = build_dir / f"{LIB_NAME}.so"
    t0 = time.time()
    try:
        if so.exists():
            torch.ops.load_library(str(so))
            log.info("loaded cached CPU kernels from %s (%.2fs)", build_dir, time.time() - t0)
            return True
        log.info("compiling CPU kernels (%d files, %s) into %s; the first build takes about a minute",
                 len(sources), " ".join(cflags), build_dir)
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=LIB_NAME,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        log.info("compiled CPU kernels in %.1fs", time.time() - t0)
        return True
    except Exception as exc:  # a broken toolchain must not take the server down
        log.warning("could not build the CPU kernels (%s); using the pure-PyTorch reference kernels", exc)
        return False
