"""Structured output: per-request token masks from a grammar (a JSON schema, any JSON object, a regex,
a choice among strings, a Lark/EBNF grammar, forced Qwen3 tool calls).

The grammar engine is llguidance. Measured on this project's 2-core CPU with the Qwen3 vocabulary
(151,936 ids) and a nested schema: llguidance ~0.13 ms per token mask, ~1.5 ms to compile;
xgrammar ~0.10 ms and ~31 ms. Both are fast enough that a mask costs well under 1 % of a decode
step; llguidance wins on what it brings along (one abi3 wheel with no dependencies, where
xgrammar pulls transformers, a GPU `triton` package and a TVM runtime into the serving image) and
it reads Lark grammars natively (GBNF too), which is what `grammar` carries.

Roles:
- `StructuredSpec` (any thread): the one constraint a request asked for, parsed from vLLM's
  `structured_outputs` dict (or its older `guided_*` keys) with errors that name the field.
- `GrammarCompiler` (any thread, locked): the tokenizer view llguidance needs (built once, ~1.5 s,
  on the first constrained request) and a cache of compiled grammars per spec; `matcher(spec)`
  compiles (or reuses) and returns a fresh `GrammarState`, or a RequestError naming the field when
  the grammar does not compile. Admission runs it, so a bad schema is a 400, never a failed step.
- `GrammarState` (the engine thread, after admission): one request's matcher. It may wait for the
  end of a think block before it constrains (Qwen3 with thinking on answers after `</think>`, as
  vLLM's reasoning-aware structured output does), fills its row's mask, and advances on each token.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import json_input   # the module, not its names: json_input imports this package's errors
from .errors import RequestError

# vLLM's StructuredOutputsParams: the constraint keys (exactly one per request), then ours (`tool_calls`: a
# forced Qwen3 tool call, the OpenAI front's tool_choice required / named), and the options we accept only
# with their neutral value.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "tool_calls")
NEUTRAL_OPTIONS = {"disable_fallback": (False, True),   # there is no other backend to fall back to
                   "disable_additional_properties": (False,), "structural_tag": (None,),
                   "backend": (None, "auto", "guidance", "llguidance")}
# Options we implement (JSON constraints): no whitespace between tokens, or a regex for it. By default the
# whitespace between two JSON tokens is bounded, as in llama.cpp's JSON schema grammars (json-schema-to-
# grammar's `space ::= | " " | "\n" [ \t]{0,20}`): nothing, one space, or one newline and at most 20 spaces or
# tabs of indentation. Unbounded whitespace (vLLM's default) lets a weak model spend max_tokens on newlines
# and indentation inside a schema whose strings and arrays are all bounded; bounded, such a schema's JSON is
# bounded too. `disable_any_whitespace` allows no whitespace at all (compact JSON); a client's own
# `whitespace_pattern` replaces the default.
JSON_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
BOUNDED_WHITESPACE = r"( |\n[ \t]{0,20})"   # llguidance: the optional whitespace between two JSON tokens
# vLLM's older top-level SamplingParams / OpenAI extra keys, read as structured_outputs.<key>.
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_json_object": "json_object"}
# every sampling-parameters key this module reads
STRUCTURED_KEYS = frozenset({"structured_outputs", "guided_decoding", "guided_decoding_backend",
                             "guided_whitespace_pattern", *GUIDED_ALIASES})
MAX_SPEC_BYTES = 1 << 16        # a schema or grammar larger than this is refused before compiling
MAX_TOOL_FUNCTIONS = 128
MAX_FUNCTION_NAME = 64
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")   # Qwen3's (Hermes) call delimiters
CACHE_SIZE = 256                # compiled grammars kept (LRU), keyed by the canonical spec


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: `kind` in CONSTRAINT_KEYS, `text` its canonical form (JSON text for json/choice/tool_calls)."""
    kind: str
    text: str
    field: str                  # how the client named it, for error messages
    compact: bool = False       # disable_any_whitespace
    whitespace: str | None = None   # whitespace_pattern

    @classmethod
    def parse(cls, value, field: str = "structured_outputs") -> "StructuredSpec | None":
        """From a structured_outputs dict (None: no constraint)."""
        if value is None:
            return None
        if isinstance(value, str):
            value = json_input.loads(value, field)
        if not isinstance(value, dict):
            raise RequestError(f"{field} must be an object with one of {', '.join(CONSTRAINT_KEYS)}")
        given, options = [], {}
        for key, v in value.items():
            if key in CONSTRAINT_KEYS:
                if v is not None and v is not False:
                    given.append(key)
            elif key == "disable_any_whitespace":
                if not isinstance(v, bool):
                    raise RequestError(f"{field}.{key} must be a boolean")
                options["compact"] = v
            elif key == "whitespace_pattern":
                if v is not None and (not isinstance(v, str) or not v or len(v) > 256):
                    raise RequestError(f"{field}.{key} must be a regex string of at most 256 characters")
                options["whitespace"] = v
            elif key in NEUTRAL_OPTIONS:
                if v not in NEUTRAL_OPTIONS[key]:
                    raise RequestError(f"{field}.{key} = {v!r} is not supported")
            else:
                raise RequestError(f"{field}: unknown key {key!r} (one of {', '.join(CONSTRAINT_KEYS)})")
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"{field}: give exactly one of {', '.join(CONSTRAINT_KEYS)}, got {', '.join(given)}")
        if given[0] not in ("json", "json_object") and any(options.values()):
            raise RequestError(f"{field}: {', '.join(JSON_OPTIONS)} apply to json and json_object only")
        return cls.of(given[0], value[given[0]], f"{field}.{given[0]}", **options)

    @classmethod
    def options_only(cls, value, field: str) -> dict:
        """The JSON options of a structured_outputs object that carries no constraint (the OpenAI front
        takes the constraint from response_format)."""
        if not isinstance(value, dict) or any(value.get(k) not in (None, False) for k in CONSTRAINT_KEYS):
            raise RequestError(f"{field}: give the constraint in one place (response_format or {field})")
        spec = cls.parse({**value, "json_object": True}, field)
        return {"compact": spec.compact, "whitespace": spec.whitespace}

    @classmethod
    def of(cls, kind: str, v, field: str, compact: bool = False, whitespace: str | None = None) -> "StructuredSpec":
        if kind == "tool_calls":
            text = json.dumps(_tool_calls(v, field))
        elif kind == "json_object":
            if v is not True:
                raise RequestError(f"{field} must be true")
            text = '{"type": "object"}'
        elif kind == "json":
            if isinstance(v, str):
                v = json_input.loads(v, field)
            if not isinstance(v, (dict, bool)):
                raise RequestError(f"{field} must be a JSON schema (an object)")
            text = json.dumps(v)   # property order kept: the grammar emits properties in this order
        elif kind == "choice":
            if isinstance(v, str) and v.lstrip().startswith("["):
                v = json_input.loads(v, field)
            if (not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v)):
                raise RequestError(f"{field} must be a non-empty list of strings")
            text = json.dumps(v)
        else:   # regex, grammar
            if not isinstance(v, str) or not v:
                raise RequestError(f"{field} must be a non-empty string")
            text = v
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise RequestError(f"{field} is larger than {MAX_SPEC_BYTES} bytes")
        return cls(kind, text, field, compact, whitespace)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key)."""
        return self.kind, self.text, self.compact, self.whitespace

    def grammar(self, token: Callable[[str], str] = json.dumps) -> str:
        """The llguidance grammar definition (compiled lazily by the matcher). `token(text)`: how the grammar
        names a delimiter the tool-call grammar needs (the vocabulary's token where it has one, else the text:
        GrammarCompiler.token_ref)."""
        import llguidance
        if self.kind == "tool_calls":
            return llguidance.grammar_from("grammar", _tool_calls_lark(json.loads(self.text), token))
        if self.kind in ("json", "json_object"):
            defaults = {"whitespace_flexible": not self.compact}
            if self.whitespace is not None:     # the client's pattern
                defaults["whitespace_pattern"] = self.whitespace
            elif not self.compact:
                defaults["whitespace_pattern"] = BOUNDED_WHITESPACE
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=defaults)
        fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[self.kind]
        return llguidance.grammar_from(fmt, self.text)


def _tool_calls(v, field: str) -> dict:
    """`{"functions": [{"name", "parameters"}], "parallel": bool}` checked, in its canonical form."""
    if isinstance(v, str):
        v = json_input.loads(v, field)
    if not isinstance(v, dict) or set(v) - {"functions", "parallel"}:
        raise RequestError(f"{field} must be an object {{functions: [{{name, parameters}}], parallel}}")
    parallel = v.get("parallel", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"{field}.parallel must be a boolean")
    fns = v.get("functions")
    if not isinstance(fns, list) or not 1 <= len(fns) <= MAX_TOOL_FUNCTIONS:
        raise RequestError(f"{field}.functions must be a list of 1 to {MAX_TOOL_FUNCTIONS} functions")
    out = []
    for i, fn in enumerate(fns):
        where = f"{field}.functions[{i}]"
        if not isinstance(fn, dict) or set(fn) - {"name", "parameters"}:
            raise RequestError(f"{where} must be an object {{name, parameters}}")
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not name or len(name) > MAX_FUNCTION_NAME:
            raise RequestError(f"{where}.name must be a non-empty string of at most {MAX_FUNCTION_NAME} characters")
        if params is not None and not isinstance(params, (dict, bool)):
            raise RequestError(f"{where}.parameters must be a JSON schema (an object)")
        out.append({"name": name, "parameters": {"type": "object"} if params is None else params})
    return {"functions": out, "parallel": parallel}


def _tool_calls_lark(value: dict, token: Callable[[str], str]) -> str:
    """The Lark grammar of forced tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
    call or (parallel) several separated by newlines; the JSON is one of the functions with arguments matching
    its `parameters`, written as Qwen3 writes it (", " and ": ", no free whitespace, so a model cannot stall in
    indentation). The delimiters are the vocabulary's tokens where it has them (Qwen3: added tokens), else
    their text (a vocabulary without them): `token` decides."""
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                for f in value["functions"]]
    body = {"anyOf": variants,
            "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}
    start, end = (token(t) for t in TOOL_CALL_TOKENS)
    repeat = ' ("\\n" call)*' if value["parallel"] else ""
    return (f"start: call{repeat}\n"
            f'call: {start} "\\n" body "\\n" {end}\n'
            f"body: %json {json.dumps(body)}\n")


def spec_from_sampling(data: dict) -> tuple[dict, StructuredSpec | None]:
    """Splits vLLM's structured-output keys (`structured_outputs`, `guided_decoding`, `guided_*`) out of a
    sampling-parameters dict: (the rest, the one spec or None)."""
    rest, specs = {}, []
    for key, value in data.items():
        if key in ("structured_outputs", "guided_decoding"):
            spec = StructuredSpec.parse(value, key)
        elif key in GUIDED_ALIASES:
            spec = None if value is None or value is False else StructuredSpec.of(GUIDED_ALIASES[key], value, key)
        elif key == "guided_decoding_backend":
            if value not in NEUTRAL_OPTIONS["backend"]:
                raise RequestError(f"{key} = {value!r} is not supported (the grammar engine is llguidance)")
            continue
        elif key == "guided_whitespace_pattern":
            if value is not None:
                raise RequestError(f"{key} is not supported")
            continue
        else:
            rest[key] = value
            continue
        if spec is not None:
            specs.append(spec)
    if len(specs) > 1:
        raise RequestError(f"give one structured-output constraint, got {', '.join(s.field for s in specs)}")
    return rest, (specs[0] if specs else None)


PROBE_STEPS = 8    # tokens walked at admission: a grammar too large for the engine's limits fails within these


def _first_error_line(matcher) -> str:
    return (matcher.get_error() or "").strip().splitlines()[0] if matcher.get_error() else "unknown error"


def _probe(pristine, field: str, vocab_size: int) -> None:
    """Admission check of a grammar that compiled: llguidance builds its parser lazily, so a grammar whose
    expansion exceeds the engine's limits (nested repetitions, `a: b{40}`, `b: c{40}`, `c: "x"{40}`) compiles
    and then fails at its first token, mid-stream. A copy walks PROBE_STEPS tokens (the lowest allowed id
    each time) and a failure refuses the request, naming the field, before any token is sent."""
    probe = pristine.deep_copy()
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(PROBE_STEPS):
        if probe.is_stopped():
            return
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if not probe.is_error():
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little", count=vocab_size))
            if not allowed.size:
                return
            probe.consume_token(int(allowed[0]))
        if probe.is_error():
            raise RequestError(f"{field}: the grammar exceeds the grammar engine's limits "
                               f"({_first_error_line(probe)})")


class GrammarState:
    """One request's grammar: waits for `wait_for` (the think block's end) when set, then masks and advances.
    A grammar error after admission (a limit the probe did not reach) fails the request naming `field`."""

    def __init__(self, matcher, wait_for: int | None, field: str = "structured_outputs"):
        self.matcher = matcher
        self.wait_for = wait_for
        self.field = field

    @property
    def active(self) -> bool:
        return self.wait_for is None

    def fill_mask(self, out: torch.Tensor) -> None:
        """The allowed next tokens as a bitmask into `out` (int32 [ceil(V / 32)])."""
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if self.matcher.is_error():
            raise RequestError(f"{self.field}: the grammar failed ({_first_error_line(self.matcher)})")

    def fill_masks(self, draft: list[int], out: torch.Tensor) -> list[bool]:
        """Speculative verification: into out[p] the mask after the first p draft tokens (p = 0 .. len(draft)),
        the grammar left as it was. A position past a draft token the grammar does not allow is never reached (the
        draft is rejected there): it is not masked. Returns, per position, whether the grammar masks it (not
        while it waits for the think block's end)."""
        wait_for, consumed, masked = self.wait_for, 0, []
        try:
            for p in range(len(draft) + 1):
                masked.append(self.active)
                if self.active:
                    self.fill_mask(out[p])
                if p == len(draft):
                    break
                tok = draft[p]
                if self.wait_for is not None:
                    if tok == self.wait_for:
                        self.wait_for = None
                elif self.matcher.validate_tokens([tok]) == 1 and self.matcher.consume_token(tok):
                    consumed += 1
                else:               # the draft is rejected here: the positions after it are never sampled
                    masked.extend([False] * (len(draft) - p))
                    break
        finally:
            if consumed:
                self.matcher.rollback(consumed)
            self.wait_for = wait_for
        return masked

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; True once the grammar is complete (nothing more may follow)."""
        if self.wait_for is not None:
            if token_id == self.wait_for:
                self.wait_for = None
            return False
        if not self.matcher.consume_token(token_id):
            raise RequestError(f"{self.field}: the grammar failed at token {token_id} "
                               f"({_first_error_line(self.matcher)})")
        return self.matcher.is_stopped()


def apply_mask(row: torch.Tensor, mask: torch.Tensor) -> None:
    """In place: logits of tokens whose bit is 0 in `mask` set to -inf (ids past the mask's end too).
    `row` is a contiguous fp32 CPU row (the sampler's). numpy does it in one unpack and one masked store,
    several times faster than the equivalent torch ops on a 152k vocabulary, and single-threaded, so it
    never wakes the OpenMP team the model's kernels use."""
    n = min(row.shape[0], mask.shape[0] * 32)
    allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little", count=n).view(bool)
    values = row.numpy()
    np.putmask(values[:n], ~allowed, -np.inf)
    values[n:] = -np.inf


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe (admission may run in several threads)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: list[int],
                 think_end_id: int | None):
        self._tokenizer_json = tokenizer_json   # called once, on the first constrained request
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.think_end_id = think_end_id
        self._lock = threading.Lock()
        self._tokenizer = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids)
        return self._tokenizer

    def token_ref(self, text: str) -> str:
        """How a grammar names `text`: the vocabulary's token (`<[id]>`) where the text is one special or added
        token of it, else the text itself (a Lark string), which the model writes in ordinary tokens. Called
        with the lock held."""
        tok = self._llg_tokenizer()
        ids = tok.tokenize_str(text)
        if len(ids) == 1 and tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def matcher(self, spec: StructuredSpec, wait_for_think_end: bool) -> GrammarState:
        """A fresh matcher for `spec` (compiled once per spec, then copied), or a RequestError naming the field."""
        import llguidance
        key = spec.key
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is None:
                try:
                    grammar = spec.grammar(self.token_ref)
                    pristine = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
                except (ValueError, TypeError) as exc:
                    raise RequestError(f"{spec.field}: {exc}") from None
                if pristine.is_error():
                    raise RequestError(f"{spec.field} does not compile: {pristine.get_error().strip()}")
                _probe(pristine, spec.field, self.vocab_size)
                self._cache[key] = pristine
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            matcher = pristine.deep_copy()
        return GrammarState(matcher, self.think_end_id if wait_for_think_end else None, spec.field)
