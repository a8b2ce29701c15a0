"""Per-request sampling parameters (vLLM names), validated with errors that name the field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the offending field."""


@dataclass(frozen=True)
class SamplingLimits:
    """Server-side caps that protect the engine from oversized requests."""

    max_tokens: int = 4096
    max_prompt_bytes: int = 1 << 20       # text_input / messages size, checked before tokenizing
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_dict(cls, data: dict, defaults: dict | None = None) -> "SamplingParams":
        """Builds params from a dict of vLLM names; unknown keys are an error naming them."""
        unknown = sorted(set(data) - cls.names())
        if unknown:
            raise RequestError(f"sampling_parameters: unknown key(s) {', '.join(map(repr, unknown))}")
        merged = {**(defaults or {}), **{k: v for k, v in data.items() if v is not None}}
        params = cls(**{k: v for k, v in merged.items() if k in cls.names()})
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, limits: SamplingLimits, vocab_size: int) -> "SamplingParams":
        """Checks types and ranges, normalizes types; returns self."""

        def as_int(name, value, allow_none=False):
            if value is None and allow_none:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    isinstance(value, float) and not value.is_integer()):
                raise RequestError(f"{name} must be an integer, got {value!r}")
            return int(value)

        def as_float(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{name} must be a number, got {value!r}")
            value = float(value)
            if math.isnan(value) or math.isinf(value):
                raise RequestError(f"{name} must be a finite number, got {value}")
            return value

        self.max_tokens = as_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and not 1 <= self.max_tokens <= limits.max_tokens:
            raise RequestError(f"max_tokens must be between 1 and {limits.max_tokens}, got {self.max_tokens}")
        self.min_tokens = as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.temperature = as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = as_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = as_int("top_k", self.top_k)
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        self.seed = as_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise RequestError(f"seed must be in [0, 2^64), got {self.seed}")
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
        self.stop_token_ids = [as_int("stop_token_ids", t) for t in self.stop_token_ids]
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise RequestError(f"stop_token_ids: at most {limits.max_stop_token_ids} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise RequestError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise RequestError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        if isinstance(self.logprobs, bool):
            self.logprobs = 0 if self.logprobs else None
        self.logprobs = as_int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= limits.max_logprobs:
            raise RequestError(f"logprobs must be between 0 and {limits.max_logprobs}, got {self.logprobs}")
        self.presence_penalty = as_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = as_float("frequency_penalty", self.frequency_penalty)
        if not -2 <= self.presence_penalty <= 2:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        self.repetition_penalty = as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        return self
