"""The sampling fields' contract: their numeric ranges (RANGES, checked by the engine and, before it builds
tensors, by the OpenAI front), the server's limits, the vLLM keys accepted only with their neutral value,
logit_bias, min_tokens against max_tokens and LoRA adapter names; every refusal a RequestError naming the field."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RequestError

# vLLM SamplingParams keys we accept only with their neutral value (what a vLLM-backend client,
# Triton's OpenAI frontend included, sends by default); any other value is an error naming the key.
NEUTRAL_KEYS = {
    "n": (1,), "best_of": (1,), "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "early_stopping": (False,), "logits_processors": ([],),
    "include_stop_str_in_output": (False,),
    "detokenize": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
}


@dataclass(frozen=True)
class SamplingLimits:
    """Server-side caps that protect the engine from oversized requests."""

    max_tokens: int = 4096
    max_prompt_bytes: int = 1 << 20       # text_input / messages size, checked before tokenizing
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_logit_bias: int = 1024            # logit_bias entries
    max_bad_words: int = 64
    max_bad_word_len: int = 256
    # prompt scoring (prompt_logprobs) of one request: prompt tokens x (alternatives + 1) entries at most
    max_prompt_scoring: int = 65536


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric sampling field (documented in the README; the OpenAI front checks
    the same table before it builds tensors)."""
    kind: type                 # int or float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


INT32_MAX = 2**31 - 1          # int32 wire tensors: larger values cannot be sent
RANGES: dict[str, Range] = {
    "max_tokens": Range(int, 1, INT32_MAX),          # and at most the server's max_tokens limit
    "min_tokens": Range(int, 0, INT32_MAX),
    "temperature": Range(float, 0.0, 1e4),           # below GREEDY_TEMPERATURE: greedy
    "top_p": Range(float, 0.0, 1.0, lo_open=True),
    "top_k": Range(int, 0, INT32_MAX),               # 0: off (vLLM's -1 is taken as 0)
    "min_p": Range(float, 0.0, 1.0),
    "seed": Range(int, 0, 2**64 - 1),
    "logprobs": Range(int, 0, INT32_MAX),            # and at most the server's max_logprobs limit
    "prompt_logprobs": Range(int, 0, INT32_MAX),     # and at most the server's max_logprobs limit
    "presence_penalty": Range(float, -2.0, 2.0),
    "frequency_penalty": Range(float, -2.0, 2.0),
    "repetition_penalty": Range(float, 0.0, 1e4, lo_open=True),
    "priority": Range(int, -2**31, INT32_MAX),
}


def check_number(name: str, value):
    """`value` as RANGES[name] wants it (None stays None), or a RequestError naming the field."""
    if value is None:
        return None
    r = RANGES[name]
    if r.kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()):
            raise RequestError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(f"{name} must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:   # an int too large for a float is out of every range
            raise RequestError(f"{name} must be {r.describe()}, got an integer of {len(str(abs(value)))} digits") \
                from None
        if not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}")
    if (r.lo is not None and (value <= r.lo if r.lo_open else value < r.lo)) or (r.hi is not None and value > r.hi):
        shown = value if abs(value) < 10**24 else f"a number of {len(str(int(abs(value))))} digits"
        raise RequestError(f"{name} must be {r.describe()}, got {shown}")
    return value


LOGIT_BIAS_RANGE = 100.0


def check_logit_bias(value, vocab_size: int | None, max_entries: int) -> dict[int, float] | None:
    """{token id: bias} from OpenAI's logit_bias (keys are strings in JSON), or a RequestError naming
    logit_bias. vocab_size None: the ids are checked against int32 only (the OpenAI front)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}")
    if len(value) > max_entries:
        raise RequestError(f"logit_bias: at most {max_entries} entries, got {len(value)}")
    hi = vocab_size if vocab_size is not None else INT32_MAX + 1
    out = {}
    keys = {}
    for key, bias in value.items():
        tid = key
        if isinstance(key, str):
            tid = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else None
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < hi:
            raise RequestError(f"logit_bias: key {str(key)[:32]!r} is not a token id in [0, {hi})")
        if tid in keys:   # "9707" and "09707": one id twice, whichever came last would win silently
            raise RequestError(f"logit_bias: keys {str(keys[tid])[:32]!r} and {str(key)[:32]!r} name the same token "
                               f"id {tid}")
        keys[tid] = key
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
            shown = bias if isinstance(bias, float) or (isinstance(bias, int) and abs(bias) < 10**24) \
                else repr(bias)[:32]
            raise RequestError(f"logit_bias[{tid}]: the bias must be a number in [-100, 100], got {shown}")
        out[tid] = float(bias)
    return out or None


def check_min_tokens(min_tokens: int, max_tokens: int, note: str = "") -> None:
    """min_tokens <= max_tokens (`note`: said after max_tokens' value, e.g. where a default came from)."""
    if min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}{note})")


MAX_LORA_NAME_LEN = 256


def check_lora_name(name, where: str = "lora_name") -> str:
    """A LoRA adapter's name (a request's lora_name, a configured or registered adapter)."""
    if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_LEN or name != name.strip():
        raise RequestError(f"{where}: must be a non-empty string of at most {MAX_LORA_NAME_LEN} characters without "
                           f"surrounding spaces, got {name!r}")
    return name
