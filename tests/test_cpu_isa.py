"""$QWEN3_CPU_ISA (backend_lib/kernels/cpu/build.py): the CPU kernel set built for fewer instructions than the host
has, so that the AVX2 paths (AVX2 + FMA; AVX2 + AVX-VNNI) are built, run and tested on an AVX-512 host too.
"""
from __future__ import annotations

import platform

import pytest

from backend_lib.kernels.cpu import build


def test_an_unknown_isa_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("QWEN3_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="QWEN3_CPU_ISA='avx9000'"):
        build.cpu_isa()
    for isa in build.ISA_FLAGS:
        monkeypatch.setenv("QWEN3_CPU_ISA", isa.upper())
        assert build.cpu_isa() == isa
    monkeypatch.delenv("QWEN3_CPU_ISA")
    assert build.cpu_isa() == "native"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA builds are x86-64 ones")
def test_each_isa_has_its_own_flags_and_build_key(monkeypatch):
    sources = sorted(p for p in build.CSRC.iterdir() if p.suffix == ".cpp")
    keys = set()
    for isa, extra in build.ISA_FLAGS.items():
        monkeypatch.setenv("QWEN3_CPU_ISA", isa)
        flags = build._cflags()
        assert flags == build._cflags(isa) and "-march=native" in flags and set(extra) <= set(flags)
        keys.add(build._build_key(sources, flags))
    assert len(keys) == len(build.ISA_FLAGS)
