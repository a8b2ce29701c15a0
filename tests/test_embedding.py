"""The embedding and rerank library (backend_lib/embedding): parity with sentence-transformers and with
Qwen3-Reranker's reference code, batch invariance bit for bit, and the errors that name their field."""
from __future__ import annotations

import json

import pytest
import torch

from backend_lib.checkpoint.errors import CheckpointError
from backend_lib.embedding import rerank_prompt
from backend_lib.embedding.model import EmbedConfig, EmbeddingModel, cosine
from backend_lib.embedding.st_config import EmbeddingSpec
from backend_lib.contract.errors import RequestError

TEXTS = ["Hello world", "The capital of China is Beijing.", "Gravity is a force by which a planet draws objects",
         "def f(x): return x * 2", "你好，世界", "a " * 120]


@pytest.fixture(scope="module")
def fp32_model(embed_ckpt):
    return EmbeddingModel(EmbedConfig(str(embed_ckpt), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def st_model(embed_ckpt):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(embed_ckpt), device="cpu", model_kwargs={"dtype": torch.float32})


def test_demo_checkpoint_is_a_sentence_transformers_folder(embed_ckpt):
    spec = EmbeddingSpec.from_dir(embed_ckpt)
    assert (spec.pooling, spec.normalize, spec.padding_side) == ("lasttoken", True, "left")
    assert spec.prompts["query"].startswith("Instruct: ") and spec.prompts["document"] == ""
    from safetensors import safe_open
    with safe_open(str(embed_ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "norm.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)


def test_parity_with_sentence_transformers_fp32(fp32_model, st_model):
    ours = fp32_model.embed([fp32_model.encode(t) for t in TEXTS])
    ref = st_model.encode(TEXTS, convert_to_tensor=True)   # one padded (left) batch
    for text, a, b in zip(TEXTS, ours, ref):
        assert a.shape == b.shape == (64,)
        assert cosine(a, b) >= 0.9999, text
    # the query prompt of config_sentence_transformers.json, by name
    q = st_model.encode(["what is gravity"], prompt_name="query", convert_to_tensor=True)[0]
    mine = fp32_model.embed([fp32_model.encode("what is gravity", fp32_model.spec.prompt("query"))])[0]
    assert cosine(mine, q) >= 0.9999
    assert cosine(mine, fp32_model.embed([fp32_model.encode("what is gravity")])[0]) < 0.9999   # the prompt counts
    # the same ranking of documents for the query
    docs = ours[:4]
    assert sorted(range(4), key=lambda i: -cosine(mine, docs[i])) == sorted(range(4), key=lambda i: -cosine(q, ref[i]))
    # dimensions: truncated then renormalized (matryoshka), as sentence-transformers' truncate_dim + normalize
    ref16 = st_model.encode(TEXTS[:2], convert_to_tensor=True, truncate_dim=16, normalize_embeddings=True)
    ours16 = fp32_model.embed([fp32_model.encode(t) for t in TEXTS[:2]], [16, 16])
    for a, b in zip(ours16, ref16):
        assert a.shape == (16,) and abs(float(a.norm()) - 1) < 1e-6 and cosine(a, b) >= 0.9999


def test_token_ids_match_sentence_transformers(fp32_model, st_model):
    for text in TEXTS:
        assert fp32_model.encode(text) == st_model.tokenizer(text)["input_ids"]
        assert fp32_model.encode(text)[-1] == 151643   # the checkpoint's post-processor appends <|endoftext|>


@pytest.mark.parametrize("which", ["bf16", "a8w8"])
def test_a_vector_does_not_depend_on_its_batch(which, embed_ckpt, embed_a8w8_ckpt):
    ckpt = embed_ckpt if which == "bf16" else embed_a8w8_ckpt
    m = EmbeddingModel(EmbedConfig(str(ckpt), device="cpu", max_batch_tokens=128, max_model_len=128))
    ids = [m.encode(t) for t in TEXTS]
    alone = [m.embed([x])[0] for x in ids]
    together = m.embed(ids)                           # split into forwards of at most 128 tokens
    reordered = m.embed(ids[::-1] + ids[:2])[::-1][2:]   # other neighbours, other rows, other pages
    for a, b, c in zip(alone, together, reordered):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert len(list(m._batches(ids))) > 1                # the long text forced a second forward
    assert not torch.equal(alone[0], alone[1])


def test_errors_name_the_field(fp32_model, embed_ckpt):
    m = EmbeddingModel(EmbedConfig(str(embed_ckpt), device="cpu", max_model_len=8))
    with pytest.raises(RequestError, match=r"^input\[1\]: has 9 tokens; the model takes at most 8"):
        m.check_ids(list(range(9)), "input[1]")
    with pytest.raises(RequestError, match=r"^input\[0\]: is empty"):
        m.check_ids([], "input[0]")
    with pytest.raises(RequestError, match=r"^input: token id 151936 is outside the vocabulary"):
        m.check_ids([1, 151936], "input")
    with pytest.raises(RequestError, match=r"^dimensions: 65 is outside \[1, 64\]"):
        m.check_dimensions(65)
    with pytest.raises(RequestError, match=r"^prompt_name: 'passage' is not one of the model's prompts"):
        m.spec.prompt("passage")
    with pytest.raises(RequestError, match="does not rerank"):
        m.rerank([[1, 2]])


def test_sentence_transformers_files_refused_naming_what(tmp_path, embed_ckpt):
    import shutil

    folder = tmp_path / "ck"
    shutil.copytree(embed_ckpt, folder)
    pool = folder / "1_Pooling" / "config.json"
    cfg = json.loads(pool.read_text())
    pool.write_text(json.dumps({**cfg, "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(CheckpointError, match="pooling_mode_max_tokens"):
        EmbeddingSpec.from_dir(folder)
    pool.write_text(json.dumps({**cfg, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}))
    assert EmbeddingSpec.from_dir(folder).pooling == "mean"
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError,
                       match=r"modules.json\[2\]: module type 'sentence_transformers.models.Dense' is not supported"):
        EmbeddingSpec.from_dir(folder)
    with pytest.raises(ValueError, match="parameter 'pooling' is not known"):
        EmbedConfig.from_params({"checkpoint": str(folder), "pooling": "mean"})


# ----- rerank -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reranker(bf16_ckpt):
    return EmbeddingModel(EmbedConfig(str(bf16_ckpt), task="rerank", dtype="float32", device="cpu"))


def _reference_scores(ckpt, query, docs, instruction=None):
    """Qwen3-Reranker's model-card code (transformers), each pair on its own (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix = tok.encode(rerank_prompt.PREFIX, add_special_tokens=False)
    suffix = tok.encode(rerank_prompt.SUFFIX, add_special_tokens=False)
    out, all_ids = [], []
    for doc in docs:
        ids = prefix + tok(rerank_prompt.user_message(query, doc, instruction))["input_ids"] + suffix
        all_ids.append(ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        out.append(float(torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)[1].exp()))
    return out, all_ids


def test_rerank_matches_the_reference_code(reranker, bf16_ckpt):
    query = "What is the capital of China?"
    docs = ["The capital of China is Beijing.", "Gravity is a force.", "Paris is in France.", "Beijing, China",
            "cats and dogs"]
    ref, ref_ids = _reference_scores(bf16_ckpt, query, docs)
    ids = [reranker.rerank_ids(query, d) for d in docs]
    assert ids == ref_ids
    ours = reranker.rerank(ids)
    assert all(0.0 < s < 1.0 for s in ours)
    assert sorted(range(len(docs)), key=lambda i: -ours[i]) == sorted(range(len(docs)), key=lambda i: -ref[i])
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4
    assert [reranker.rerank([x])[0] for x in ids] == ours   # batch invariant, bit for bit
    assert reranker.rerank_ids(query, docs[0], "Find the city") != ids[0]


def test_rerank_needs_a_head(embed_ckpt):
    with pytest.raises(CheckpointError, match="task rerank: the checkpoint has no lm_head"):
        EmbeddingModel(EmbedConfig(str(embed_ckpt), task="rerank"))
