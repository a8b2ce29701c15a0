"""qwen3_embed and qwen3_rerank in the real tritonserver, and /v1/embeddings, /v1/rerank, /v1/score through the
OpenAI front, driven by real clients (tritonclient, the openai SDK, sentence-transformers for the reference)."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend_lib.embedding.model import EmbedConfig, EmbeddingModel
from harness.openai_front import Front
from harness.triton_server import TritonServer, make_repository

pytestmark = [pytest.mark.slow, pytest.mark.server]
TEXTS = ["Hello world", "The capital of China is Beijing.", "Gravity is a force", "def f(x): return x", "你好",
         "a " * 60]
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force.", "Paris is in France.", "Beijing, China",
        "cats and dogs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, embed_ckpt, embed_a8w8_ckpt, bf16_ckpt):
    root = tmp_path_factory.mktemp("embed_triton")
    repo = make_repository(root / "models", {
        "qwen3_embed": {"checkpoint": str(embed_ckpt), "dtype": "float32", "max_model_len": "128"},
        "qwen3_embed_a8w8": {"_source": "qwen3_embed", "checkpoint": str(embed_a8w8_ckpt), "max_model_len": "128",
                             "max_batch_tokens": "256"},
        "qwen3_rerank": {"checkpoint": str(bf16_ckpt), "dtype": "float32", "max_model_len": "256"},
    })
    triton = TritonServer(repo, root / "tritonserver.log").start()
    yield triton
    triton.stop()


@pytest.fixture(scope="module")
def front(server, tmp_path_factory):
    f = Front(server.grpc_url, tmp_path_factory.mktemp("embed_front") / "front.log")
    yield f
    f.stop()


def _infer(url, model, **inputs):
    client = grpcclient.InferenceServerClient(url)
    tensors = _tensors(inputs)
    try:
        result = client.infer(model, tensors, client_timeout=60)
    finally:
        client.close()
    out = "score" if model == "qwen3_rerank" else "embedding"
    return result.as_numpy(out).reshape(-1), int(result.as_numpy("num_input_tokens").reshape(-1)[0])


def _tensors(inputs: dict) -> list:
    tensors = []
    for name, value in inputs.items():
        if isinstance(value, str):
            arr, dtype = np.array([[value.encode()]], dtype=np.object_), "BYTES"
        elif isinstance(value, list):
            arr, dtype = np.array([value], dtype=np.int32), "INT32"
        else:
            arr, dtype = np.array([[value]], dtype=np.int32), "INT32"
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def _at_once(url, model, requests_: list[dict]) -> list:
    """Every request sent at once from one client (async_infer), so Triton's dynamic batcher groups them: each
    (vector, tokens) or its InferenceServerException."""
    import threading

    client = grpcclient.InferenceServerClient(url)
    results, done = [None] * len(requests_), threading.Semaphore(0)

    def callback(i, result, error):
        results[i] = error if error is not None else (result.as_numpy("embedding").reshape(-1),
                                                      int(result.as_numpy("num_input_tokens").reshape(-1)[0]))
        done.release()

    try:
        for i, inputs in enumerate(requests_):
            client.async_infer(model, _tensors(inputs), lambda result, error, i=i: callback(i, result, error), client_timeout=60)
        for _ in requests_:
            assert done.acquire(timeout=60)
    finally:
        client.close()
    return results


def _executions(server, model: str) -> float:
    """Triton's nv_inference_exec_count of the model: its model runs (one per dynamic batch)."""
    family = server.metric_families()["nv_inference_exec_count"]
    return sum(s.value for s in family.samples if s.labels.get("model") == model)


def _counts(server, model: str) -> tuple[float, float, float]:
    """vllm:prompt_tokens_total and vllm:request_success_total (stop, error) of the model."""
    def value(name, **labels):
        try:
            return server.metric(name, model, **labels)
        except KeyError:
            return 0.0
    return (value("vllm:prompt_tokens_total"), value("vllm:request_success_total", finished_reason="stop"),
            value("vllm:request_success_total", finished_reason="error"))


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


@pytest.fixture(scope="module")
def st_vectors(embed_ckpt):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(embed_ckpt), device="cpu", model_kwargs={"dtype": torch.float32})
    return model.encode(TEXTS, convert_to_numpy=True), model.encode([QUERY], prompt_name="query")[0]


@pytest.mark.parametrize("model", ["qwen3_embed", "qwen3_embed_a8w8"])
def test_served_vectors_equal_alone_and_batched_with_hostile_neighbours(server, model, st_vectors):
    url = server.grpc_url
    before = _counts(server, model)
    alone = [_infer(url, model, text_input=t) for t in TEXTS]
    hostile = [dict(text_input="x", input_ids=[1, 2]), dict(input_ids=list(range(1, 200))),
               dict(input_ids=[5, 151936]), dict(text_input="q", prompt_name="passage"), dict(text_input="q",
               dimensions=65), dict(text_input=""), dict(input_ids=[1], prompt_name="query")]
    executions = _executions(server, model)
    got = _at_once(url, model, [dict(text_input=t) for t in TEXTS] + hostile)
    # the model's metrics: the tokens it embedded, the requests it answered and refused
    expected = (before[0] + 2 * sum(n for _, n in alone), before[1] + 2 * len(TEXTS), before[2] + len(hostile))
    assert server.wait_until(lambda: _counts(server, model) == expected, 10), (_counts(server, model), expected)
    # the dynamic batcher grouped them (executions counts model runs: fewer than the requests sent)
    assert _executions(server, model) - executions < len(TEXTS) + len(hostile)
    for (va, na), res in zip(alone, got[:len(TEXTS)]):
        assert not isinstance(res, Exception), res
        assert np.array_equal(va, res[0]) and na == res[1]   # bit for bit, whatever shared its batch
    errors = [str(e) for e in got[len(TEXTS):]]
    assert all(isinstance(e, InferenceServerException) for e in got[len(TEXTS):]), errors
    for err, word in zip(errors, ["text_input or input_ids: send one of them", "input_ids: has 199 tokens",
                                  "input_ids: token id 151936 is outside", "prompt_name: 'passage' is not one",
                                  "dimensions: 65 is outside [1, 64]", "text_input: is empty",
                                  "prompt_name: only with text_input"]):
        assert word in err, (word, err)
    ref, query_ref = st_vectors
    bound = 0.9999 if model == "qwen3_embed" else 0.99   # fp32 vs fp32; int8 weights and activations vs fp32
    for (v, _), r in zip(alone, ref):
        assert v.shape == (64,) and _cos(v, r) >= bound
    q, n = _infer(url, model, text_input=QUERY, prompt_name="query")
    assert _cos(q, query_ref) >= bound and n > _infer(url, model, text_input=QUERY)[1] + 10   # the prompt's tokens
    d16, _ = _infer(url, model, text_input=TEXTS[0], dimensions=16)
    assert d16.shape == (16,) and abs(np.linalg.norm(d16) - 1) < 1e-5 and _cos(d16, alone[0][0][:16]) > 0.99999


def test_openai_sdk_embeddings(server, front):
    client = front.client()
    direct = [_infer(server.grpc_url, "qwen3_embed", text_input=t)[0] for t in TEXTS]
    # the SDK asks for base64 by default and decodes it
    res = client.embeddings.create(model="qwen3_embed", input=TEXTS)
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    for d, v in zip(res.data, direct):
        assert np.array_equal(np.array(d.embedding, dtype=np.float32), v)
    tokens = sum(_infer(server.grpc_url, "qwen3_embed", text_input=t)[1] for t in TEXTS)
    assert res.usage.prompt_tokens == res.usage.total_tokens == tokens and res.model == "qwen3_embed"
    floats = client.embeddings.create(model="qwen3_embed", input=TEXTS[1], encoding_format="float", user="u1")
    assert np.array_equal(np.array(floats.data[0].embedding, dtype=np.float32), direct[1])
    # token ids, a list of id lists, dimensions
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(front_ckpt(server) / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in TEXTS[:3]]
    one = client.embeddings.create(model="qwen3_embed", input=ids[0])
    assert np.array_equal(np.array(one.data[0].embedding, dtype=np.float32), direct[0])
    many = client.embeddings.create(model="qwen3_embed", input=ids, dimensions=8)
    for d, v in zip(many.data, direct):
        assert len(d.embedding) == 8 and _cos(d.embedding, v[:8]) > 0.99999
    raw = requests.post(f"{front.url}/v1/embeddings", json={"model": "qwen3_embed", "input": "hi",
                                                            "encoding_format": "base64"}, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vec, _infer(server.grpc_url, "qwen3_embed", text_input="hi")[0])
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"


def test_langchain_openai_embeddings(server, front):
    """langchain-openai's OpenAIEmbeddings, unchanged, as its docs configure it for an OpenAI-compatible server
    (check_embedding_ctx_length=False: it then sends the texts, not tiktoken's ids of OpenAI's vocabulary)."""
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="qwen3_embed", base_url=f"{front.url}/v1", api_key="unused",
                           check_embedding_ctx_length=False, chunk_size=4)
    direct = [_infer(server.grpc_url, "qwen3_embed", text_input=t)[0] for t in TEXTS]
    docs = emb.embed_documents(TEXTS)   # 6 texts in chunks of 4: two requests
    assert len(docs) == len(TEXTS)
    for got, want in zip(docs, direct):
        assert np.array_equal(np.array(got, dtype=np.float32), want)
    assert np.array_equal(np.array(emb.embed_query(QUERY), dtype=np.float32),
                          _infer(server.grpc_url, "qwen3_embed", text_input=QUERY)[0])
    small = OpenAIEmbeddings(model="qwen3_embed", base_url=f"{front.url}/v1", api_key="unused",
                             check_embedding_ctx_length=False, dimensions=8)
    got = small.embed_query(TEXTS[1])
    assert len(got) == 8 and _cos(got, direct[1][:8]) > 0.99999


def test_models_list_names_the_embedding_and_rerank_models(front):
    client = front.client()
    ids = [m.id for m in client.models.list()]
    assert ids == ["qwen3_embed", "qwen3_embed_a8w8", "qwen3_rerank"]   # no LLM in this repository
    assert client.models.retrieve("qwen3_rerank").id == "qwen3_rerank"
    r = requests.get(f"{front.url}/v1/models/no_such_model", timeout=30)
    assert r.status_code == 404 and "no_such_model" in r.text


def front_ckpt(server):
    """The embedding checkpoint the server's qwen3_embed names."""
    import re
    from pathlib import Path

    text = (server.repository / "qwen3_embed" / "config.pbtxt").read_text()
    return Path(re.search(r'key: "checkpoint", value: \{ string_value: "([^"]+)"', text).group(1))


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "qwen3_embed", "input": "hi", "encoding": "float"}, 400, "encoding", "encoding: unknown"),
    ({"model": "qwen3_embed", "input": ["hi", "a " * 200]}, 400, "input", "input[1]: has"),
    ({"model": "qwen3_embed", "input": ["x"] * 2049}, 400, "input", "input"),
    ({"model": "qwen3_embed", "input": [1, 151936]}, 400, "input", "input: token id 151936"),
    ({"model": "qwen3_embed", "input": []}, 400, "input", "input"),
    ({"model": "qwen3_embed", "input": "hi", "dimensions": 65}, 400, "dimensions", "dimensions: 65"),
    ({"model": "qwen3_embed", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
    ({"model": "qwen3_embed", "input": [[1, 2]], "prompt_name": "query"}, 400, "prompt_name", "prompt_name"),
    ({"model": "qwen3_rerank", "input": "hi"}, 400, "model", "not an embedding model"),
    ({"model": "nope", "input": "hi"}, 404, "model", "nope"),
])
def test_embeddings_errors_name_the_field(front, body, status, param, words):
    r = requests.post(f"{front.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = requests.post(f"{front.url}/v1/embeddings", json={"model": "qwen3_embed", "input": "still fine"}, timeout=60)
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def reference_reranker(bf16_ckpt):
    return EmbeddingModel(EmbedConfig(str(bf16_ckpt), task="rerank", dtype="float32", device="cpu"))


def test_rerank_and_score_through_the_front(server, front, reference_reranker):
    ref = reference_reranker.rerank([reference_reranker.rerank_ids(QUERY, d) for d in DOCS])
    ranking = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        r = requests.post(f"{front.url}{path}", json={"model": "qwen3_rerank", "query": QUERY, "documents": DOCS},
                          timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == ranking
        for x in body["results"]:
            assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-5 and x["document"]["text"] == DOCS[x["index"]]
        assert body["usage"]["total_tokens"] > 0
    top = requests.post(f"{front.url}/v1/rerank", json={"model": "qwen3_rerank", "query": QUERY, "top_n": 2,
                                                        "documents": [{"text": d} for d in DOCS],
                                                        "return_documents": False}, timeout=60).json()
    assert [x["index"] for x in top["results"]] == ranking[:2] and "document" not in top["results"][0]
    score = requests.post(f"{front.url}/v1/score", json={"model": "qwen3_rerank", "text_1": QUERY, "text_2": DOCS},
                          timeout=60).json()
    assert [abs(d["score"] - ref[d["index"]]) < 1e-5 for d in score["data"]] == [True] * len(DOCS)
    # an embedding model scores by the cosine of the two vectors
    emb = requests.post(f"{front.url}/v1/score", json={"model": "qwen3_embed", "text_1": [TEXTS[0], TEXTS[1]],
                                                       "text_2": [TEXTS[2], TEXTS[1]]}, timeout=60).json()
    a, b, c = (_infer(server.grpc_url, "qwen3_embed", text_input=t)[0] for t in TEXTS[:3])
    assert abs(emb["data"][0]["score"] - _cos(a, c)) < 1e-6 and abs(emb["data"][1]["score"] - 1.0) < 1e-6


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/rerank", {"model": "qwen3_rerank", "query": "q", "documents": []}, "documents", "documents"),
    ("/v1/rerank", {"model": "qwen3_rerank", "query": "q", "documents": ["ok", "x " * 300]}, "documents",
     "documents[1]: has"),
    ("/v1/rerank", {"model": "qwen3_rerank", "query": "q", "documents": ["d"], "rank_fields": ["a"]}, "rank_fields",
     "rank_fields: unknown"),
    ("/v1/rerank", {"model": "qwen3_embed", "query": "q", "documents": ["d"]}, "model", "not a rerank model"),
    ("/v1/score", {"model": "qwen3_rerank", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2",
     "text_2: 3 texts for 2"),
    ("/v1/score", {"model": "qwen3_embed", "text_1": "a", "text_2": "b", "instruction": "x"}, "instruction",
     "instruction: only with a rerank model"),
])
def test_rerank_and_score_errors_name_the_field(front, path, body, param, words):
    r = requests.post(f"{front.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
