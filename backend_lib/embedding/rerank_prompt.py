"""Qwen3-Reranker's documented prompt (torch-free): a chat whose assistant turn answers "yes" or "no".

The relevance of a document to a query is P(yes) = softmax([logit(no), logit(yes)])[1] at the last position
of this prompt, as the model card's reference code computes it (its prefix and suffix are tokenized without
special tokens and put around the tokens of the filled-in user message).
"""
from __future__ import annotations

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES, NO = "yes", "no"


def user_message(query: str, document: str, instruction: str | None = None) -> str:
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def prompt_ids(encode, query: str, document: str, instruction: str | None = None) -> list[int]:
    """encode: text -> ids without special tokens (the checkpoint's tokenizer)."""
    return encode(PREFIX) + encode(user_message(query, document, instruction)) + encode(SUFFIX)
