"""Tokenizer, chat template, incremental detokenizer and stop strings."""
from __future__ import annotations

import json
import shutil

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


def test_every_ids_bytes_are_what_the_tokenizer_decodes_it_to(tok):
    """The byte table (str.translate over GPT-2's byte alphabet) against the tokenizer's own decode of each id,
    id by id: ids whose bytes are whole UTF-8 equal its decode; the others (parts of a character) decode to
    U+FFFD there, and their bytes must still be a part of some character (continuation or lead bytes)."""
    hf = tok.hf
    partial = 0
    for i in range(tok.num_ids):
        want = hf.decode([i], skip_special_tokens=False)
        got = tok.token_bytes[i]
        if hf.id_to_token(i) is None:
            assert got == b"", i
            continue
        try:
            assert got.decode("utf-8") == want, i
        except UnicodeDecodeError:
            partial += 1
            assert "\ufffd" in want and got, i
    assert 0 < partial < 2000, partial   # Qwen's vocabulary holds ~1,000 byte fragments


def test_tokenizers_of_the_same_file_share_one_vocabulary_and_an_edited_file_is_read_again(tmp_path, bf16_ckpt):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        shutil.copy(bf16_ckpt / "tokenizer.json", d / "tokenizer.json")
    (b / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    ta, tb = Tokenizer(a), Tokenizer(b)
    assert ta.hf is tb.hf and ta.token_bytes is tb.token_bytes
    assert tb.chat_template == "{{ messages[0]['content'] }}" and ta.chat_template != tb.chat_template

    spec = json.loads((b / "tokenizer.json").read_text())
    new_id = max(t["id"] for t in spec["added_tokens"]) + 1
    spec["added_tokens"].append({"id": new_id, "content": "<|probe|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (b / "tokenizer.json").write_text(json.dumps(spec))
    tb2 = Tokenizer(b)
    assert tb2.hf is not ta.hf and tb2.num_ids == new_id + 1 and tb2.special[new_id]
    assert tb2.token_bytes[new_id] == b"<|probe|>" and Tokenizer(a).num_ids == ta.num_ids


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
