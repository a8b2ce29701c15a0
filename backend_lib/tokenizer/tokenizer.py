"""A checkpoint's tokenizer: HF `tokenizers` from tokenizer.json, its chat template, byte tables."""
from __future__ import annotations

import json
import logging
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


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer: {path} not found (the checkpoint or the 'tokenizer' folder "
                                 "must hold tokenizer.json)")
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerError(f"tokenizer: {path} could not be loaded ({exc})") from None
        self.folder = folder
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self._find_template()
        added = self.hf.get_added_tokens_decoder()
        self.num_ids = max([self.hf.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])
        self.special = [False] * self.num_ids
        for i, tok in added.items():
            self.special[i] = bool(tok.special)
        self.token_bytes = self._token_bytes(added)
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

    def _token_bytes(self, added) -> list[bytes]:
        decoder = json.loads(self.hf.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])
        table: list[bytes] = [b""] * self.num_ids
        bd = _byte_decoder()
        for i in range(self.num_ids):
            if i in added:
                table[i] = added[i].content.encode("utf-8")
                continue
            tok = self.hf.id_to_token(i)
            if tok is None:
                continue
            if byte_level:
                try:
                    table[i] = bytes(bd[c] for c in tok)
                    continue
                except KeyError:
                    pass
            table[i] = self.hf.decode([i], skip_special_tokens=False).encode("utf-8")
        return table

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
