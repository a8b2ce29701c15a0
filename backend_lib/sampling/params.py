"""Per-request sampling parameters (vLLM names), validated with errors that name the field."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..contract.errors import RequestError
from ..contract.fields import (NEUTRAL_KEYS, RANGES, SamplingLimits, check_logit_bias, check_min_tokens,
                               check_number)
from ..contract.structured import STRUCTURED_KEYS, StructuredSpec, spec_from_sampling

# The per-request speculative decoding switch (backend_lib/spec): auto (as the model's speculative_config says,
# auto-disabled when acceptance stays low) or off
SPECULATIVE_VALUES = ("auto", "off")

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature only overflows, and the limit of the distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None     # every prompt token's logprob and its top-N alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None      # only these tokens may be sampled
    bad_words: list[str] = field(default_factory=list)   # words never generated (vLLM: token sequences)
    # bad_words as token sequences (set by LLMEngine.make_request from the tokenizer, as vLLM does)
    bad_words_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    cache_salt: str | None = None          # prefix caching: only requests with the same salt share pages
    priority: int = 0                      # scheduling_policy priority: lower first (vLLM)
    structured_outputs: StructuredSpec | None = None   # parsed from structured_outputs / guided_* keys
    lora_name: str | None = None           # the LoRA adapter to run with (docs/lora.md); None: the base model
    lora_path: str | None = None           # with allow_runtime_lora: where lora_name is loaded from on first use
    speculative: str = "auto"              # speculative decoding (docs/speculative.md): auto | off (this request never)

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}

    @classmethod
    def from_dict(cls, data: dict, defaults: dict | None = None) -> "SamplingParams":
        """Builds params from a dict of vLLM names; unknown keys, and known vLLM keys with a value other
        than their neutral one, are an error naming them."""
        rest, spec = spec_from_sampling(check_keys(data))
        merged = {**(defaults or {}), **{k: v for k, v in rest.items() if v is not None}}
        return cls(**{k: v for k, v in merged.items() if k in cls.names()}, structured_outputs=spec)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, limits: SamplingLimits, vocab_size: int) -> "SamplingParams":
        """Checks types and ranges (RANGES, then the server's limits), normalizes types; returns self."""
        if type(self.top_k) is int and self.top_k == -1:   # vLLM's "off"
            self.top_k = 0
        for name in RANGES:
            value = getattr(self, name)
            if name in ("logprobs", "prompt_logprobs") and isinstance(value, bool):
                value = 0 if value else None
            setattr(self, name, check_number(name, value))
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            raise RequestError(f"max_tokens must be between 1 and {limits.max_tokens}, got {self.max_tokens}")
        if self.max_tokens is not None:
            check_min_tokens(self.min_tokens, self.max_tokens)
        if self.logprobs is not None and self.logprobs > limits.max_logprobs:
            raise RequestError(f"logprobs must be between 0 and {limits.max_logprobs}, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > limits.max_logprobs:
            raise RequestError(f"prompt_logprobs must be between 0 and {limits.max_logprobs}, "
                               f"got {self.prompt_logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"stop must be a list of strings, got {self.stop!r}")
        self.stop = [s for s in self.stop if s]
        if len(self.stop) > limits.max_stop_strings:
            raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if len(s) > limits.max_stop_string_len:
                raise RequestError(f"stop: a stop string is longer than {limits.max_stop_string_len} characters")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise RequestError(f"stop_token_ids: at most {limits.max_stop_token_ids} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise RequestError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        self._validate_token_masks(limits, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > 256):
            raise RequestError("cache_salt must be a non-empty string of at most 256 characters")
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 4096):
                raise RequestError(f"{name} must be a non-empty string of at most 4096 characters, got {value!r}")
        if self.speculative not in SPECULATIVE_VALUES:
            raise RequestError(f"speculative must be one of {', '.join(SPECULATIVE_VALUES)}, got "
                               f"{str(self.speculative)[:64]!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise RequestError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        return self


    def _validate_token_masks(self, limits: SamplingLimits, vocab_size: int) -> None:
        """logit_bias (JSON object keys are strings), allowed_token_ids, bad_words: types, ids, bounds."""
        self.logit_bias = check_logit_bias(self.logit_bias, vocab_size, limits.max_logit_bias)
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids:
                raise RequestError("allowed_token_ids must be a non-empty list of token ids")
            if len(ids) > vocab_size:
                raise RequestError(f"allowed_token_ids: {len(ids)} ids, more than the vocabulary's {vocab_size}")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    shown = t if isinstance(t, int) and abs(t) < 10**24 else repr(t)[:32]
                    raise RequestError(f"allowed_token_ids: {shown} is not a token id in [0, {vocab_size})")
            self.allowed_token_ids = sorted(set(ids))
        words = self.bad_words
        if words is None:
            words = []
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise RequestError("bad_words must be a list of strings")
        if len(words) > limits.max_bad_words:
            raise RequestError(f"bad_words: at most {limits.max_bad_words} words, got {len(words)}")
        for w in words:
            if len(w) > limits.max_bad_word_len:
                raise RequestError(f"bad_words: a word is longer than {limits.max_bad_word_len} characters")
        self.bad_words = [w for w in words if w.strip()]


def bad_words_token_ids(words: list[str], encode) -> list[list[int]]:
    """vLLM's bad_words: each word's tokens, alone and after a space (the form it takes inside a text)
    when that is a different first token of the same length."""
    out = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def check_keys(data: dict, where: str = "sampling_parameters") -> dict:
    """The keys of `data` that are SamplingParams fields; neutral vLLM keys dropped, others rejected."""
    out = {}
    for key, value in data.items():
        if key in SamplingParams.names() or key in STRUCTURED_KEYS:
            out[key] = value
        elif key in NEUTRAL_KEYS:
            if value is not None and value not in NEUTRAL_KEYS[key]:
                allowed = " or ".join(repr(v) for v in NEUTRAL_KEYS[key]) or "null"
                raise RequestError(f"{where}: {key!r} = {value!r} is not supported (only {allowed})")
        else:
            raise RequestError(f"{where}: unknown key {key!r}")
    return out
