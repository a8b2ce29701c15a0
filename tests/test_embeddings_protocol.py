"""The bodies of /v1/embeddings, /v1/rerank and /v1/score (openai_frontend/embeddings_protocol.py): what they take,
and one 400 naming the field for what they refuse (no server: the served paths are tests/test_embed_server.py)."""
from __future__ import annotations

import pytest

from openai_frontend.embeddings_protocol import MAX_DOCUMENTS, MAX_INPUTS, EmbeddingRequest, RerankRequest, ScoreRequest
from openai_frontend.errors import APIError
from openai_frontend.protocol import validated


@pytest.mark.parametrize("value, items, single", [
    ("hi", ["hi"], True), (["a", "b"], ["a", "b"], False), ([1, 2, 3], [[1, 2, 3]], True),
    ([[1], [2, 3]], [[1], [2, 3]], False)])
def test_embedding_inputs_of_every_shape(value, items, single):
    body = validated(EmbeddingRequest, {"model": "m", "input": value, "encoding_format": "base64", "dimensions": 8,
                                        "user": "u"})
    assert body.items() == items and body.single is single


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m", "input": "hi", "truncate": 3}, "truncate", "truncate: unknown or unsupported field"),
    ({"model": "m", "input": ""}, "input", "input"),
    ({"model": "m", "input": []}, "input", "input"),
    ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input", "input"),
    ({"model": "m", "input": [1, True]}, "input", "input"),
    ({"model": "m", "input": [1, -2]}, "input", "input"),
    ({"model": "m", "input": ["a", [1]]}, "input", "input"),
    ({"model": "m", "input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"model": "m", "input": "hi", "dimensions": 0}, "dimensions", "dimensions"),
    ({"model": "m", "input": "hi", "dimensions": "8"}, "dimensions", "dimensions"),
    ({"model": "m", "input": [[1, 2]], "prompt_name": "query"}, "prompt_name", "prompt_name: only with texts"),
    ({"input": "hi"}, "model", "model: is required"),
])
def test_embedding_bodies_refused_naming_the_field(body, param, words):
    with pytest.raises(APIError) as exc:
        validated(EmbeddingRequest, body)
    assert exc.value.status == 400 and exc.value.param == param and words in exc.value.message, exc.value.message


def test_rerank_and_score_bodies():
    body = validated(RerankRequest, {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert body.texts() == ["a", "b"]
    assert validated(ScoreRequest, {"model": "m", "text_1": "q", "text_2": ["a", "b"]}).pairs() == [("q", "a"),
                                                                                                   ("q", "b")]
    assert validated(ScoreRequest, {"model": "m", "text_1": ["q", "r"], "text_2": ["a", "b"]}).pairs() == [
        ("q", "a"), ("r", "b")]
    for model, bad, param in [
            (RerankRequest, {"model": "m", "query": "q", "documents": ["d"] * (MAX_DOCUMENTS + 1)}, "documents"),
            (RerankRequest, {"model": "m", "query": "q", "documents": [{"txt": "d"}]}, "documents"),
            (RerankRequest, {"model": "m", "query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
            (RerankRequest, {"model": "m", "documents": ["d"]}, "query"),
            (ScoreRequest, {"model": "m", "text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2"),
            (ScoreRequest, {"model": "m", "text_1": "a", "text_2": "b", "label": 1}, "label")]:
        with pytest.raises(APIError) as exc:
            validated(model, bad)
        assert exc.value.param == param, exc.value.message
