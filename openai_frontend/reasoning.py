"""Qwen3 reasoning parser: splits generated text into `reasoning_content` and `content` at `</think>`.

Behaviour follows vLLM's `qwen3` reasoning parser as of vLLM main in 2026
(`vllm/reasoning/qwen3_reasoning_parser.py`, the version that reads `enable_thinking` from
`chat_template_kwargs`, i.e. after vllm-project/vllm#34779; its base is `BaseThinkingReasoningParser`
in `vllm/reasoning/basic_parsers.py`):

(a) `<think>R</think>C`: the opening `<think>` is dropped, the text is partitioned at the first
    `</think>`: reasoning R, content C. Nothing is stripped: Qwen3 writes `<think>\\nR\\n</think>\\n\\nC`,
    so reasoning is `\\nR\\n` and content `\\n\\nC`, exactly as vLLM returns them. A later `</think>`
    is plain content.
(b) No `<think>` but a `</think>` (the prompt opened the block, as Qwen3-2507 thinking templates do):
    everything before `</think>` is reasoning, the rest content.
(c) Thinking off (`chat_template_kwargs.enable_thinking` is false, so the template ended the prompt
    with `<think>\\n\\n</think>\\n\\n`): everything is content, verbatim. vLLM's streaming path does exactly
    this (the serving layer sees the prompt already ended reasoning and never calls the parser).
(d) Thinking on and no `</think>` (output cut inside the block, e.g. by max_tokens): everything is
    reasoning and content is None. (vLLM <= 0.10 returned such output as content; current vLLM,
    and this module, return it as reasoning.)
(e) Streaming works on text, not token ids, so it is correct however the deltas split the text,
    including inside the tag text: only a suffix that could still grow into the awaited tag
    (`<think>` at the very start, `</think>` afterwards) is held back, and `finish()` releases it
    with the meaning `split()` gives it. For every split, the concatenated deltas equal `split()`.
    `<think>` and `</think>` are non-special added tokens in Qwen3's vocabulary (ids 151667, 151668),
    so they survive detokenization even with skip_special_tokens.

Deliberate differences from vLLM, all for outputs Qwen3 does not produce, so that streaming and
whole-output parsing agree for every split: `<think>` is recognised only at the very start of the
output (vLLM's non-streaming path drops everything up to the first `<think>` wherever it is);
empty reasoning is None rather than ""; with thinking off, tags are not interpreted at all (vLLM's
non-streaming path would still split at a `</think>`). vLLM's Qwen3.5 rule that `<tool_call>`
followed by `<function=` ends reasoning is not applied: Qwen3 emits Hermes JSON tool calls
(`<tool_call>\\n{"name": ...}`), for which that rule never fires.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that could grow into it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Qwen3ReasoningParser:
    """Whole-output parsing; `stream()` gives the incremental equivalent for one output."""

    def __init__(self, thinking: bool = True):
        """`thinking` is False when the request set chat_template_kwargs.enable_thinking to false."""
        self.thinking = thinking

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; each None when empty."""
        if not self.thinking:
            return None, text or None
        if text.startswith(THINK_START):
            text = text[len(THINK_START):]
        reasoning, end, content = text.partition(THINK_END)
        return reasoning or None, (content or None) if end else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.thinking)


class ReasoningStream:
    """Incremental `split()`: feed text deltas, get (reasoning_delta, content_delta) pairs ("" when none)."""

    def __init__(self, thinking: bool = True):
        # "start": a leading <think> may still arrive; "reasoning": before </think>; "content": after it.
        self._state = "start" if thinking else "content"
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        if self._state == "start":
            if len(text) < len(THINK_START) and THINK_START.startswith(text):
                self._held = text
                return "", ""
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
            self._state = "reasoning"
        if self._state == "content":
            return "", text
        reasoning, end, content = text.partition(THINK_END)
        if end:
            self._state = "content"
            return reasoning, content
        keep = partial_tag_len(text, THINK_END)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""

    def finish(self) -> tuple[str, str]:
        """Releases held-back text: a tag prefix that never completed is reasoning text."""
        held, self._held = self._held, ""
        return held, ""
