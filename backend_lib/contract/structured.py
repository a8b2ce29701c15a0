"""The structured-output constraint a request asks for (vLLM's `structured_outputs`, its older `guided_*` keys, and
our forced tool calls), parsed with errors that name the field. Torch-free: the OpenAI front checks the same
keys; the grammar engine that enforces a spec is backend_lib.sampling.structured.

`StructuredSpec` (any thread) is the one constraint; `grammar()` gives its llguidance grammar definition.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from . import json_input
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
# JSON integers are bounded by default to 16 digits, as llama.cpp's JSON grammars bound an integral part
# ([1-9][0-9]{0,15}): an integer schema without a bound of its own gets minimum / maximum +-(10^16 - 1), so a weak
# model cannot spend max_tokens on one 64-digit number; a schema's own bounds win (a side it bounds is left as it
# is, and no default is added that would contradict it). Numbers keep llguidance's own grammar: bounding them there
# would also forbid exponents ("1e5") and "-0", a change of what a valid answer is.
INTEGER_BOUND = 10**16 - 1
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def bound_integers(schema):
    """`schema` with INTEGER_BOUND added to every integer (sub)schema that has no bound of its own (a copy)."""
    if isinstance(schema, list):
        return [bound_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bound_integers(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = bound_integers(out[key])
    kind = out.get("type")
    if (kind == "integer" or (isinstance(kind, list) and "integer" in kind)) and "multipleOf" not in out:
        low = next((out[k] for k in ("minimum", "exclusiveMinimum") if isinstance(out.get(k), (int, float))
                    and not isinstance(out.get(k), bool)), None)
        high = next((out[k] for k in ("maximum", "exclusiveMaximum") if isinstance(out.get(k), (int, float))
                     and not isinstance(out.get(k), bool)), None)
        if low is None and (high is None or high >= -INTEGER_BOUND):
            out["minimum"] = -INTEGER_BOUND
        if high is None and (low is None or low <= INTEGER_BOUND):
            out["maximum"] = INTEGER_BOUND
    return out
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
            text = self.text
            if self.kind == "json":
                text = json.dumps(bound_integers(json.loads(text)), ensure_ascii=False)
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
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
