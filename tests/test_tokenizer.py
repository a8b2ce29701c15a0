"""Tokenizer, chat template, incremental detokenizer and stop strings."""
from __future__ import annotations

import pytest

from backend_lib.tokenizer import StopMatcher, Tokenizer
from helpers import CONVERSATIONS

TEXTS = [
    "介绍一下北京故宫",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 done",
    "English  with double  spaces\nand\n\nnewlines\t tabs",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "Mixed: café naïve Ελληνικά русский 日本語 한국어",
]

@pytest.fixture(scope="module")
def tok(bf16_ckpt):
    return Tokenizer(bf16_ckpt)


def test_real_qwen_vocabulary(tok):
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.hf.token_to_id("<|im_end|>") == 151645 and tok.hf.token_to_id("</think>") == 151668
    assert set(tok.end_token_ids) == {151645, 151643}


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_round_trips_byte_exact(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert tok.hf.decode(ids) == text


def test_multibyte_characters_are_held_until_complete(tok):
    ids = tok.encode("🫠")
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test to mean anything"
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🫠"


def test_special_tokens_skipped_unless_asked(tok):
    ids = tok.encode("hi") + [151645]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"
    assert tok.decode([151667]) == "<think>"   # Qwen3 marks <think> as not special


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_matches_transformers(tok, bf16_ckpt, conv, thinking):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bf16_ckpt))
    msgs = CONVERSATIONS[conv]
    ours = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking))
    theirs = hf.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking, tokenize=True)
    if hasattr(theirs, "keys"):  # BatchEncoding
        theirs = theirs["input_ids"]
    assert ours == list(theirs)


def test_stop_matcher_holds_partial_matches_back():
    m = StopMatcher(["STOP", "\n\n"])
    assert m.feed("hello ST") == "hello "
    assert m.feed("O") == ""
    assert m.feed("x") == "STOx"
    assert m.feed(" a\n") == " a"
    assert m.feed("\nrest") == ""
    assert m.stopped_on == "\n\n"


def test_stop_matcher_flushes_at_the_end():
    m = StopMatcher(["</answer>"])
    assert m.feed("the answer </ans") == "the answer "
    assert m.flush() == "</ans"
    assert StopMatcher([]).feed("abc") == "abc"
