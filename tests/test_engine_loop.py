"""EngineLoop: the engine driven from its own thread, built there too."""
from __future__ import annotations

import queue
import threading

import pytest

from backend_lib.engine import EngineLoop
from helpers import make_engine


def _run(loop: EngineLoop, rid: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    q: queue.Queue = queue.Queue()
    loop.submit(rid, prompt, loop.engine.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}),
                q.put)
    ids: list[int] = []
    while True:
        out = q.get(timeout=120)
        ids.extend(out.new_token_ids)
        if out.finished:
            assert out.error is None, out.error
            return ids


def test_build_constructs_the_engine_in_the_engine_thread_and_serves(bf16_ckpt, bf16_engine):
    built_in: list[str] = []

    def factory():
        built_in.append(threading.current_thread().name)
        return make_engine(bf16_ckpt)

    loop = EngineLoop.build(factory, name="loop-under-test")
    try:
        assert built_in == ["loop-under-test"]   # one OpenMP team: the engine thread's
        prompt = [9707, 11, 1879, 0, 576]
        expected = bf16_engine.generate([prompt], bf16_engine.make_params(
            {"temperature": 0, "max_tokens": 8, "ignore_eos": True}))[0]["output_ids"]
        assert _run(loop, "a", prompt) == expected
    finally:
        loop.shutdown()


def test_build_raises_the_factory_error_in_the_caller():
    def factory():
        raise ValueError("checkpoint: no such folder")

    with pytest.raises(ValueError, match="no such folder"):
        EngineLoop.build(factory)
