"""A checkpoint's tokenizer: HF `tokenizers` from tokenizer.json, its chat template, byte tables."""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import ChatTemplateError, render_chat
from .detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

QWEN_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
TURN_START, THINK_END = "<|im_start|>", "</think>"
DEFAULT_TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")


class TokenizerError(ValueError):
    pass


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of every byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _byte_translation() -> tuple[dict[int, str], dict[int, None]]:
    """str.translate tables: each stand-in character to the latin-1 character of its byte, and each to nothing
    (what is left of a token after the second is the characters that are no byte's stand-in)."""
    decoder = _byte_decoder()
    return {ord(c): chr(b) for c, b in decoder.items()}, dict.fromkeys(map(ord, decoder))


@dataclass(frozen=True)
class _Vocabulary:
    """What a tokenizer.json alone determines, built once per content a process (never mutated after)."""
    hf: HFTokenizer
    num_ids: int
    special: tuple[bool, ...]
    token_bytes: tuple[bytes, ...]


_VOCABULARIES: OrderedDict[bytes, _Vocabulary] = OrderedDict()
_VOCABULARIES_LOCK = threading.Lock()
_VOCABULARIES_KEPT = 4


def _vocabulary(path: Path) -> _Vocabulary:
    """The vocabulary of tokenizer.json at `path`, shared by every Tokenizer of the process whose file has the same
    bytes (the file's digest is the key, so an edited file is parsed again): loading Qwen's 151,643-token file is
    ~1 s of CPU, paid by every engine, tokenizer model and front that opens a checkpoint of it."""
    data = path.read_bytes()
    key = hashlib.blake2b(data, digest_size=16).digest()
    with _VOCABULARIES_LOCK:
        vocab = _VOCABULARIES.get(key)
        if vocab is None:
            try:
                hf = HFTokenizer.from_buffer(data)
            except Exception as exc:
                raise TokenizerError(f"tokenizer: {path} could not be loaded ({exc})") from None
            added = hf.get_added_tokens_decoder()
            num_ids = max([hf.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])
            special = [False] * num_ids
            for i, tok in added.items():
                special[i] = bool(tok.special)
            vocab = _Vocabulary(hf, num_ids, tuple(special), tuple(_token_bytes(hf, added, num_ids)))
            _VOCABULARIES[key] = vocab
            while len(_VOCABULARIES) > _VOCABULARIES_KEPT:
                _VOCABULARIES.popitem(last=False)
        _VOCABULARIES.move_to_end(key)
        return vocab


def _token_bytes(hf: HFTokenizer, added, num_ids: int) -> list[bytes]:
    """The bytes of every id. Byte-level tokens are mapped back with two str.translate calls each (C speed:
    ~0.1 s for Qwen's 151,643 tokens, where a per-character generator took ~1 s); any other token, or one with a
    character outside GPT-2's byte alphabet, is decoded by the tokenizer itself."""
    decoder = json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else {}
    byte_level = decoder.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])
    table: list[bytes] = [b""] * num_ids
    to_bytes, stand_ins = _byte_translation()
    for tok, i in hf.get_vocab(with_added_tokens=False).items():
        if i in added or i >= num_ids:
            continue
        if byte_level and not tok.translate(stand_ins):
            table[i] = tok.translate(to_bytes).encode("latin-1")
        else:
            table[i] = hf.decode([i], skip_special_tokens=False).encode("utf-8")
    for i, tok in added.items():
        table[i] = tok.content.encode("utf-8")
    return table


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer: {path} not found (the checkpoint or the 'tokenizer' folder "
                                 "must hold tokenizer.json)")
        vocab = _vocabulary(path)
        self.hf = vocab.hf
        self.num_ids, self.special, self.token_bytes = vocab.num_ids, vocab.special, vocab.token_bytes
        self.folder = folder
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self._find_template()
        self.end_token_ids = tuple(i for i in (self.hf.token_to_id(t) for t in QWEN_END_TOKENS) if i is not None)
        self.turn_start_id = self.hf.token_to_id(TURN_START)
        self.think_end_id = self.hf.token_to_id(THINK_END)

    def _find_template(self) -> str | None:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # named templates
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        return tpl

    def thinking_open(self, prompt_ids) -> bool:
        """Whether the model answers this prompt after a think block of its own: the prompt ends in an open
        assistant turn (Qwen3's template with thinking on) that holds no `</think>` (thinking off closes an
        empty block in the prompt). Structured output then starts after the model's `</think>`."""
        if self.turn_start_id is None or self.think_end_id is None:
            return False
        ids = list(prompt_ids)
        try:
            last = len(ids) - 1 - ids[::-1].index(self.turn_start_id)
        except ValueError:
            return False
        tail = ids[last + 1:]
        return self.think_end_id not in tail and self.hf.decode(tail[:1]) == "assistant"

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        detok = self.detokenizer(skip_special_tokens)
        return "".join(detok.add(i) for i in ids) + detok.flush()

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.token_bytes, self.special, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, **kwargs) -> str:
        template = self.chat_template
        if template is None:
            log.warning("tokenizer %s has no chat template; using Qwen3's", self.folder)
            template = DEFAULT_TEMPLATE.read_text()
        try:
            return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                               enable_thinking=enable_thinking, **kwargs)
        except ChatTemplateError as exc:
            raise TokenizerError(f"messages: {exc}") from None
        except Exception as exc:  # a template that fails on these messages: their fault, not the server's
            log.info("chat template failed: %r", exc)
            raise TokenizerError(f"messages: the chat template could not render them ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})") from None
