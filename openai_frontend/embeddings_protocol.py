"""The bodies of /v1/embeddings, /v1/rerank (/v2/rerank, /rerank) and /v1/score as pydantic models, in
protocol.py's style: strict (no coercion), a field outside the model refused naming it, limits named in errors.

Shapes: OpenAI's embeddings request (as vLLM serves it), vLLM's rerank request (Jina / Cohere compatible: query,
documents, top_n, return_documents) and vLLM's score request (text_1, text_2). The token limit of one input is
the model's (its max_model_len; the model's error names the input)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from .protocol import FieldError, NonEmpty, TokenId, _Body

MAX_INPUTS = 2048          # texts or id lists in one /v1/embeddings request (OpenAI's limit)
MAX_DOCUMENTS = 1024       # documents in one rerank request, pairs in one score request
MAX_DIMENSIONS = 1 << 16

EmbedModel = Annotated[str, Field(min_length=1, description="The model: a Triton embedding model (qwen3_embed) "
                                                            "or, for rerank and score, a rerank model (qwen3_rerank).")]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
EmbeddingInput = Union[
    NonEmpty, TokenIds,
    Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_INPUTS)],
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)],
]


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI)."""
    model: EmbedModel
    input: EmbeddingInput = Field(description=f"A text, a list of texts, token ids or a list of id lists (at most "
                                              f"{MAX_INPUTS} inputs; each at most the model's max_model_len tokens).")
    encoding_format: Optional[Literal["float", "base64"]] = Field(
        None, description="float (default): lists of numbers; base64: little-endian float32 bytes.")
    dimensions: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_DIMENSIONS)]] = Field(
        None, description="Keep the first N dimensions, renormalized (Qwen3-Embedding is matryoshka-trained).")
    user: Optional[StrictStr] = Field(None, description="Accepted, unused (OpenAI's end-user id).")
    prompt_name: Optional[NonEmpty] = Field(
        None, description="A prompt of the checkpoint's config_sentence_transformers.json (Qwen3-Embedding: query) "
                          "put before each text, as sentence-transformers' encode(prompt_name=...); texts only.")

    def items(self) -> list[Union[str, list[int]]]:
        """The inputs as a list, each a text or an id list."""
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)

    @property
    def single(self) -> bool:
        return isinstance(self.input, str) or bool(self.input) and isinstance(self.input[0], int)

    @model_validator(mode="after")
    def _prompt_with_texts(self):
        if self.prompt_name is not None and not all(isinstance(i, str) for i in self.items()):
            raise FieldError("prompt_name", "prompt_name: only with texts (token ids are taken as they are)")
        return self


Documents = Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_DOCUMENTS)]


class RerankDocument(_Body):
    """A document as an object (Cohere's and Jina's {text: ...})."""
    text: StrictStr


class RerankRequest(_Body):
    """POST /v1/rerank, /v2/rerank, /rerank (vLLM; Jina and Cohere compatible)."""
    model: EmbedModel
    query: StrictStr = Field(description="The query.")
    documents: Annotated[list[Union[StrictStr, RerankDocument]], Field(min_length=1, max_length=MAX_DOCUMENTS)] = \
        Field(description=f"The documents to rank (at most {MAX_DOCUMENTS}): strings or {{text}} objects.")
    top_n: Optional[Annotated[StrictInt, Field(ge=0)]] = Field(
        None, description="Return the n most relevant (0 or absent: all).")
    return_documents: Optional[StrictBool] = Field(None, description="Include each document's text (default true).")
    instruction: Optional[NonEmpty] = Field(
        None, description="Qwen3-Reranker's <Instruct> line (default: web search: retrieve relevant passages).")
    user: Optional[StrictStr] = Field(None, description="Accepted, unused.")

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    """POST /v1/score, /score (vLLM): text_1 against text_2, one score per pair (a rerank model: P(yes); an
    embedding model: the cosine of the two vectors)."""
    model: EmbedModel
    text_1: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_DOCUMENTS)]] = Field(
        description="The query (or queries).")
    text_2: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_DOCUMENTS)]] = Field(
        description="The documents: one per text_1, or any number against a single text_1.")
    instruction: Optional[NonEmpty] = Field(None, description="Rerank models: Qwen3-Reranker's <Instruct> line.")
    user: Optional[StrictStr] = Field(None, description="Accepted, unused.")

    def pairs(self) -> list[tuple[str, str]]:
        a = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        b = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(a) == 1:
            return [(a[0], t) for t in b]
        return list(zip(a, b))

    @model_validator(mode="after")
    def _lengths(self):
        a = 1 if isinstance(self.text_1, str) else len(self.text_1)
        b = 1 if isinstance(self.text_2, str) else len(self.text_2)
        if a != 1 and a != b:
            raise FieldError("text_2", f"text_2: {b} texts for {a} in text_1 (send one text_1, or as many as text_2)")
        return self


EMBEDDING_BODIES = (EmbeddingRequest, RerankRequest, ScoreRequest)
