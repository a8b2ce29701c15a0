"""LoRA through the real tritonserver (multi_lora.json, lora_name in sampling_parameters, a lora_path loaded on
first use) and through the OpenAI front (--lora-modules, the adapter as `model`, load/unload at run time), with
the openai SDK. Every result is compared by ids / text with the offline engine running the same adapter alone."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from helpers import PROMPT, SERVER_ENGINE, collect, make_engine, make_peft_adapter
from harness.openai_front import Front
from harness.triton_server import TritonServer, make_repository

pytestmark = [pytest.mark.slow, pytest.mark.server]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def loras(tmp_path_factory, bf16_ckpt):
    root = tmp_path_factory.mktemp("loras")
    return {name: make_peft_adapter(bf16_ckpt, root / name, r=8, seed=seed, std=0.15)[0]
            for name, seed in (("a", 11), ("b", 12), ("c", 13))}


@pytest.fixture(scope="module")
def server(tmp_path_factory, a8w8_ckpt, loras):
    root = tmp_path_factory.mktemp("lora_triton")
    repo = make_repository(root / "models", {
        "qwen3_lora": {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(a8w8_ckpt),
                       "allow_runtime_lora": "true", "max_loras": "2"},
        "qwen3_tokenizer": {"checkpoint": str(a8w8_ckpt), "max_model_len": SERVER_ENGINE["max_model_len"]},
    })
    (repo / "qwen3_lora" / "1" / "multi_lora.json").write_text(json.dumps({"a": str(loras["a"])}))
    server = TritonServer(repo, root / "tritonserver.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(a8w8_ckpt, loras):
    eng = make_engine(a8w8_ckpt, **{k: int(v) for k, v in SERVER_ENGINE.items() if k != "dtype" and v.isdigit()},
                      dtype="bfloat16", lora_modules={k: str(v) for k, v in loras.items()}, max_loras=3)

    def run(lora=None, prompt=PROMPT):
        params = eng.make_params({**GREEDY, **({"lora_name": lora} if lora else {})})
        return eng.generate([eng.tokenizer.encode(prompt)], params)[0]
    return run


def _ids(responses):
    assert responses[-1][2] and responses[-1][0] != "ERROR", responses
    return [i for _, ids, _ in responses for i in ids]


def test_lora_name_beside_base_requests_equals_each_alone(server, offline, loras):
    jobs = [{}, {"lora_name": "a"}, {}, {"lora_name": "a"},
            {"lora_name": "b", "lora_path": str(loras["b"])}]    # loaded on first use (allow_runtime_lora)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda sp: collect(server.grpc_url, "qwen3_lora", prompt=PROMPT,
                                                   sampling_parameters={**GREEDY, **sp}), jobs))
    expected = {None: offline()["output_ids"], "a": offline("a")["output_ids"], "b": offline("b")["output_ids"]}
    assert len({tuple(v) for v in expected.values()}) == 3
    for sp, res in zip(jobs, results):
        assert _ids(res) == expected[sp.get("lora_name")]


def test_bad_lora_requests_fail_alone_naming_the_field(server, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    cases = [({"lora_name": "zzz"}, "lora_name: unknown LoRA adapter 'zzz' (known: "),
             ({"lora_name": "d", "lora_path": str(tmp_path)}, "use_dora (True) is not supported (DoRA)"),
             ({"lora_name": 5}, "lora_name must be a non-empty string"),
             ({"lora_path": str(tmp_path)}, "lora_path: needs lora_name")]
    for sp, message in cases:
        (res,) = collect(server.grpc_url, "qwen3_lora", prompt=PROMPT, sampling_parameters={**GREEDY, **sp})
        assert res[0] == "ERROR" and message in res[1], res
    assert _ids(collect(server.grpc_url, "qwen3_lora", prompt=PROMPT, sampling_parameters={**GREEDY, "lora_name": "a"}))


@pytest.fixture(scope="module")
def front(server, loras, tmp_path_factory, a8w8_ckpt):
    f = Front(server.grpc_url, tmp_path_factory.mktemp("lora_front") / "front.log", "--lora-modules",
              f"b={loras['b']}", '{"name": "a", "base_model_name": "qwen3_lora"}', "--lora-base-model", "qwen3_lora",
              "--tokenizer", str(a8w8_ckpt))
    yield f
    f.stop()


def test_openai_front_adapters_as_models_loaded_and_unloaded_at_run_time(front, offline, loras, tmp_path):
    client = front.client()
    cards = {m.id: m for m in client.models.list().data}
    assert cards["b"].parent == "qwen3_lora" and cards["b"].root == str(loras["b"]) and "qwen3_lora" in cards
    done = client.completions.create(model="b", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.model == "b" and done.choices[0].text == offline("b")["text"]
    assert done.choices[0].text != offline()["text"]
    # "a" has no path: the Triton model serves it by name (multi_lora.json)
    assert cards["a"].parent == "qwen3_lora" and cards["a"].root is None
    assert client.models.retrieve("a").parent == "qwen3_lora"
    assert client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == offline("a")["text"]

    r = requests.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(loras["c"])})
    assert r.status_code == 200 and "c" in r.text
    assert requests.post(f"{front.url}/v1/load_lora_adapter",
                         json={"lora_name": "c", "lora_path": str(loras["c"])}).status_code == 400
    chat = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
    deltas = [ch.choices[0].delta for ch in chat if ch.choices]
    assert "".join((d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    done = client.completions.create(model="c", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == offline("c")["text"]

    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "bias": "all"}')
    bad = requests.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "bias 'all' is not supported" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "lora_name"
    assert "bad" not in {m.id for m in client.models.list().data}
    assert requests.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p",
                                                                    "lora_rank": 3}).json()["error"]["param"] == "lora_rank"

    assert requests.post(f"{front.url}/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert requests.post(f"{front.url}/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)


def test_lora_metrics_name_the_running_adapters_and_count_requests_per_adapter(server):
    def current():
        """The series with the latest value (vLLM's gauge: the value is when its labels were last true)."""
        fam = server.metric_families().get("vllm:lora_requests_info")
        samples = [s for s in fam.samples if s.labels.get("model") == "qwen3_lora"] if fam else []
        return max(samples, key=lambda s: s.value).labels if samples else None

    before = server.metric("vllm:lora_requests_total", "qwen3_lora", lora_name="a")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(collect, server.grpc_url, "qwen3_lora", prompt=PROMPT,
                              sampling_parameters={**GREEDY, "max_tokens": 400, "lora_name": "a"})
        seen = None
        for _ in range(200):
            seen = current()
            if seen and seen["running_lora_adapters"] == "a" or running.done():
                break
            time.sleep(0.02)
        assert _ids(running.result())
    assert seen["running_lora_adapters"] == "a" and seen["waiting_lora_adapters"] == "" and seen["max_lora"] == "2"
    time.sleep(0.3)
    assert (current()["running_lora_adapters"], current()["waiting_lora_adapters"]) == ("", "")
    assert server.metric("vllm:lora_requests_total", "qwen3_lora", lora_name="a") == before + 1
