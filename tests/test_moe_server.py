"""A Qwen3-MoE checkpoint (tiny, compressed-tensors W8A8 with the routers ignored) served through the real
tritonserver and the OpenAI front: streamed greedy ids and text equal the in-process engine's."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.openai_front import Front
from harness.triton_server import TritonServer, make_repository
from helpers import PROMPT, SERVER_ENGINE, collect, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.server]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
PROMPTS = [PROMPT, "介绍一下北京故宫", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, moe_a8w8_ckpt):
    root = tmp_path_factory.mktemp("moe_triton")
    repo = make_repository(root / "models", {
        "qwen3_moe": {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(moe_a8w8_ckpt)},
        "qwen3_tokenizer": {"checkpoint": str(moe_a8w8_ckpt), "max_model_len": SERVER_ENGINE["max_model_len"]},
    })
    server = TritonServer(repo, root / "tritonserver.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(moe_a8w8_ckpt):
    eng = make_engine(moe_a8w8_ckpt, **{k: int(v) for k, v in SERVER_ENGINE.items() if k != "dtype" and v.isdigit()},
                      dtype="bfloat16")
    params = eng.make_params(GREEDY)
    return {p: eng.generate([eng.tokenizer.encode(p)], params)[0] for p in PROMPTS}


def test_triton_streams_the_engines_ids_concurrently(server, offline):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: collect(server.grpc_url, "qwen3_moe", prompt=p,
                                                  sampling_parameters=GREEDY), PROMPTS))
    for p, res in zip(PROMPTS, results):
        assert res[-1][2] and res[-1][0] != "ERROR", res
        assert len(res) > 2, "not streamed"
        assert [i for _, ids, _ in res for i in ids] == offline[p]["output_ids"]


def test_openai_front_streams_the_engines_text(server, offline, tmp_path_factory, moe_a8w8_ckpt):
    front = Front(server.grpc_url, tmp_path_factory.mktemp("moe_front") / "front.log", "--tokenizer",
                  str(moe_a8w8_ckpt))
    try:
        client = front.client()
        for p in PROMPTS[:2]:
            stream = client.completions.create(model="qwen3_moe", prompt=p, max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            chunks = [c.choices[0].text for c in stream if c.choices]
            assert len(chunks) > 2 and "".join(chunks) == offline[p]["text"]
    finally:
        front.stop()
