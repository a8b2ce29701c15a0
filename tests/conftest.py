"""Shared fixtures: small Qwen3 checkpoints in the real formats, built once per test session."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import HUB_ID, HUB_REVISION, SERVER_ENGINE, make_engine, make_hub_cache  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU here: the Triton kernel set runs through Triton's interpreter. The variable must be set before any
# module defines the @triton.jit kernels (whichever test module imports them first); the AOT test compiles
# the GPU code path in a subprocess without it.
os.environ.setdefault("TRITON_INTERPRET", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)


class CheckpointFactory:
    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, Path] = {}

    def get(self, name: str, fmt: str = "bf16", size: str = "tiny", seed: int = 0, **overrides) -> Path:
        if name not in self._built:
            from backend_lib.tools.make_demo_checkpoint import build

            self._built[name] = build(self.root / name, size, fmt, seed, **overrides)
        return self._built[name]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def bf16_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-bf16", "bf16")


@pytest.fixture(scope="session")
def a8w8_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-a8w8", "a8w8")


@pytest.fixture(scope="session")
def embed_ckpt(ckpts) -> Path:
    """A tiny Qwen3-Embedding checkpoint (bare Qwen3Model tensors and the sentence-transformers files)."""
    return ckpts.get("tiny-embed", "bf16", task="embed")


@pytest.fixture(scope="session")
def embed_a8w8_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-embed-a8w8", "a8w8", task="embed")


@pytest.fixture(scope="session")
def bf16_engine(bf16_ckpt):
    return make_engine(bf16_ckpt)


@pytest.fixture(scope="session")
def a8w8_engine(a8w8_ckpt):
    return make_engine(a8w8_ckpt, dtype="bfloat16")


@pytest.fixture(scope="session")
def triton(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    """The real tritonserver serving every model of model_repository/ on the tiny test checkpoints. qwen3_tq and
    the tokenizer model name the bf16 one by Hugging Face id (main, and pinned to its revision), resolved in
    an offline Hub cache in the hub's own layout."""
    from harness.triton_server import TritonServer, make_repository

    root = tmp_path_factory.mktemp("triton")
    make_hub_cache(root / "hub", HUB_ID, bf16_ckpt, HUB_REVISION)
    repo = make_repository(root / "models", {
        "qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt)},
        "qwen3_tq": {**SERVER_ENGINE, "checkpoint": HUB_ID},
        "qwen3_tokenizer": {"checkpoint": f"{HUB_ID}@{HUB_REVISION}", "max_model_len": SERVER_ENGINE["max_model_len"]},
        "qwen3_a8w8_ensemble": {},
        "qwen3_tq_ensemble": {},
    })
    server = TritonServer(repo, root / "tritonserver.log",
                          env={"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moe_bf16_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-moe-bf16", "bf16", "tiny-moe")


@pytest.fixture(scope="session")
def moe_a8w8_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-moe-a8w8", "a8w8", "tiny-moe")


# The tiny checkpoints with 3,000 tokens instead of Qwen3's 151,936 (the tokenizer stays the real one: prompts
# must encode below 3,000), for the tests of the Triton kernels through the interpreter, where the LM head's
# float linear over the whole vocabulary was about half of every step's time.
SMALL_VOCAB = 3000


@pytest.fixture(scope="session")
def a8w8_small_vocab_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-a8w8-v3000", "a8w8", vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def moe_a8w8_small_vocab_ckpt(ckpts) -> Path:
    return ckpts.get("tiny-moe-a8w8-v3000", "a8w8", "tiny-moe", vocab_size=SMALL_VOCAB)
