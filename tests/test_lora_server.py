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
                       "allow_runtime_lora": "true", "max_loras": "2", "lora_roots": str(loras["a"].parent)},
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


def test_bad_lora_requests_fail_alone_naming_the_field(server, loras):
    dora = loras["a"].parent / "dora"   # inside the model's lora_roots
    dora.mkdir(exist_ok=True)
    (dora / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    cases = [({"lora_name": "zzz"}, "lora_name: unknown LoRA adapter 'zzz' (known: "),
             ({"lora_name": "d", "lora_path": str(dora)}, "use_dora (True) is not supported (DoRA)"),
             ({"lora_name": 5}, "lora_name must be a non-empty string"),
             ({"lora_path": str(dora)}, "lora_path: needs lora_name")]
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


def test_openai_front_adapters_as_models_loaded_and_unloaded_at_run_time(front, offline, loras):
    client = front.client()
    cards = {m.id: m for m in client.models.list().data}
    # an absolute path is the server's business: never shown to API clients (issue 32)
    assert cards["b"].parent == "qwen3_lora" and cards["b"].root is None and "qwen3_lora" in cards
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

    biased = loras["a"].parent / "biased"   # inside the model's lora_roots
    biased.mkdir(exist_ok=True)
    (biased / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "bias": "all"}')
    bad = requests.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(biased)})
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


def _error(res) -> str:
    (only,) = res
    assert only[0] == "ERROR", res
    return only[1]


def test_a_hostile_client_gets_no_server_paths_no_downloads_and_no_new_label_values(server, offline, loras, tmp_path):
    """Issue 32: a request's lora_path comes only from lora_roots (the real path inside a root: symlinks out, absolute
    paths elsewhere, a Hub id are all refused with one message that neither repeats the path nor tells whether it
    exists), the unknown-adapter error lists the configured adapters only, and run-time names reach Triton's label
    values only as 'other'; greedy requests beside the hostile ones keep their exact ids."""
    from backend_lib.lora.registry import NOT_IN_ROOTS

    root = loras["a"].parent
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "adapter_config.json").write_text((loras["b"] / "adapter_config.json").read_text())
    (root / "escape").symlink_to(secret)
    hostile = [str(secret), "escape", "../" * 8 + "etc", "/etc", "/no/such/folder", "Qwen/Qwen3-0.6B",
               "hf-internal-testing/tiny-random-lora", str(root)]
    good = [{}, {"lora_name": "a"}, {"lora_name": "run1", "lora_path": "b"}]   # a relative path in the root
    with ThreadPoolExecutor(len(good) + 2) as pool:
        beside = [pool.submit(collect, server.grpc_url, "qwen3_lora", prompt=PROMPT,
                              sampling_parameters={**GREEDY, **sp}) for sp in good]
        errors = list(pool.map(lambda i: _error(collect(server.grpc_url, "qwen3_lora", prompt=PROMPT,
                                                        sampling_parameters={**GREEDY, "lora_name": f"h{i}",
                                                                             "lora_path": hostile[i]})),
                               range(len(hostile))))
        results = [f.result() for f in beside]
    for message in errors:
        assert NOT_IN_ROOTS in message and str(tmp_path) not in message and "/etc" not in message, message
    assert [_ids(r) for r in results] == [offline()["output_ids"], offline("a")["output_ids"],
                                          offline("b")["output_ids"]]
    unknown = _error(collect(server.grpc_url, "qwen3_lora", prompt=PROMPT,
                             sampling_parameters={**GREEDY, "lora_name": "nope"}))
    assert "unknown LoRA adapter 'nope' (known: a)" in unknown and "run1" not in unknown   # another client's name
    for i in range(5):   # five more run-time names: still one label value for all of them
        assert _ids(collect(server.grpc_url, "qwen3_lora", prompt=PROMPT, sampling_parameters={
            **GREEDY, "max_tokens": 1, "lora_name": f"tenant-{i}", "lora_path": "b"}))
    time.sleep(0.3)
    families = server.metric_families()
    names = {s.labels["lora_name"] for s in families["vllm:lora_requests"].samples
             if s.labels.get("model") == "qwen3_lora"}
    assert names <= {"a", "other"} and "other" in names, names
    info = [s.labels for s in families["vllm:lora_requests_info"].samples if s.labels.get("model") == "qwen3_lora"]
    shown = {n for labels in info for key in ("running_lora_adapters", "waiting_lora_adapters")
             for n in labels[key].split(",") if n}
    assert shown <= {"a", "other"}, shown


def test_the_front_refuses_a_second_concurrent_load_model_names_and_shows_no_absolute_path(front, offline, loras):
    """Issue 32: two loads of one new adapter name at once: one succeeds, the other is told the name is taken (or
    being loaded); a served model's name (the tokenizer's, an LLM's) is refused as an adapter name; /v1/models shows
    a relative lora_path (inside the parent's lora_roots) and never an absolute one."""
    def load(name, path):
        return requests.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                             timeout=120)

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: load("twin", "c"), range(2)))
    assert sorted(r.status_code for r in both) == [200, 400], [r.text for r in both]
    refused = next(r for r in both if r.status_code == 400).json()["error"]
    assert refused["param"] == "lora_name" and "'twin'" in refused["message"], refused
    for name in ("qwen3_tokenizer", "qwen3_lora"):
        r = load(name, "c")
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
        assert "is the name of a model" in r.json()["error"]["message"]
    cards = {m["id"]: m for m in requests.get(f"{front.url}/v1/models", timeout=30).json()["data"]}
    assert cards["twin"]["root"] == "c" and cards["b"]["root"] is None
    assert not any(str(loras["a"].parent) in json.dumps(card) for card in cards.values())
    client = front.client()
    assert client.completions.create(model="twin", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == offline("c")["text"]
    assert requests.post(f"{front.url}/v1/unload_lora_adapter", json={"lora_name": "twin"}).status_code == 200
