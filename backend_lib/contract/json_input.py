"""The one parser of untrusted JSON: every JSON text a client sends goes through `loads`.

Python's `json` accepts what a server must not: NaN and Infinity literals, numbers that overflow to
inf (`1e400`) or integers of thousands of digits (which later fail as "int too large to convert to
float"), duplicate keys (the last one silently wins), lone UTF-16 surrogates (`"\\ud800"`, legal
escapes that no UTF-8 encoder accepts), and nesting deep enough to exhaust the recursion limit.
`loads` refuses each of them with a RequestError that names the field (`where` plus the path
inside the document, e.g. `sampling_parameters.temperature`), so no such input reaches code that
would answer with an internal error. The sampling parameters, chat messages and tools, structured-
output specs, Triton request parameters and the OpenAI front's bodies all use it.
"""
from __future__ import annotations

import json
import math
import re

from .errors import RequestError

MAX_DEPTH = 64            # arrays and objects nested deeper than this are refused before parsing
MAX_INT_DIGITS = 40       # integer literals longer than this fit no field's type (int64, uint64, fp32)

_SPECIAL = re.compile(rb'[\[\]{}"\\]')
_QUOTE, _BACKSLASH, _OPEN = ord('"'), ord("\\"), (ord("["), ord("{"))


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether a JSON text nests arrays and objects deeper than `limit` (brackets inside strings do not
    count), found in one pass over its brackets and quotes, before any parsing: a deep text never reaches
    the recursive parser."""
    depth, in_string, escaped = 0, False, -1
    for m in _SPECIAL.finditer(raw):
        pos = m.start()
        c = raw[pos]
        if in_string:
            if pos == escaped:
                continue
            if c == _BACKSLASH:
                escaped = pos + 1
            elif c == _QUOTE:
                in_string = False
        elif c == _QUOTE:
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c != _BACKSLASH:
            depth -= 1
    return False


class _OutOfRange:
    """A number literal no field can hold (found by the walk, which knows its path)."""
    __slots__ = ("literal",)

    def __init__(self, literal: str):
        self.literal = literal


class _DuplicateKey(dict):
    """An object that repeated a key (reported by the walk with the object's path)."""
    __slots__ = ("key",)


def _parse_int(s: str):
    return int(s) if len(s.lstrip("-")) <= MAX_INT_DIGITS else _OutOfRange(s)


def _parse_float(s: str):
    value = float(s)
    return value if math.isfinite(value) else _OutOfRange(s)


def _parse_constant(s: str):
    return _OutOfRange(s)     # NaN, Infinity, -Infinity: not JSON (RFC 8259), refused


def _object(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            dup = _DuplicateKey(obj)
            dup.key = key
            return dup
        obj[key] = value
    return obj


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _name(path: str) -> str:
    return path or "the request body"


def _check(value, path: str) -> None:
    """Walks the parsed document (at most MAX_DEPTH deep, so recursion is bounded). `path` names the value
    ("" for a whole request body: its fields are then named alone, `messages[0].content`)."""
    where = _name(path)
    if isinstance(value, _OutOfRange):
        what = "is not a JSON number" if value.literal.lstrip("-") in ("NaN", "Infinity") else "is out of range"
        shown = value.literal if len(value.literal) <= 24 else f"{value.literal[:12]}...({len(value.literal)} characters)"
        raise RequestError(f"{where}: {shown} {what}")
    if isinstance(value, str):
        if _has_surrogate(value):
            raise RequestError(f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)")
    elif isinstance(value, dict):
        if isinstance(value, _DuplicateKey):
            raise RequestError(f"{where}: duplicate key {value.key!r}" if not _has_surrogate(value.key)
                               else f"{where}: duplicate key")
        for key, item in value.items():
            if _has_surrogate(key):
                raise RequestError(f"{where}: a key contains a lone UTF-16 surrogate (not valid Unicode text)")
            _check(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")


def loads(raw: str | bytes, where: str, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH):
    """`raw` parsed as strict JSON, or a RequestError naming `where` (and the path inside it; where "" is a
    request body, whose fields are named alone)."""
    path, where = where, _name(where)
    if isinstance(raw, str):
        try:
            data = raw.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)") from None
    else:
        data = bytes(raw)
    if max_bytes is not None and len(data) > max_bytes:
        raise RequestError(f"{where}: {len(data)} bytes exceed the limit of {max_bytes}")
    if nested_deeper_than(data, max_depth):
        raise RequestError(f"{where}: nested deeper than {max_depth} levels")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(f"{where}: not valid UTF-8") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{where}: malformed JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:   # unreachable past the depth check; kept so no parse can ever escape as a 500
        raise RequestError(f"{where}: nested too deep") from None
    _check(value, path)
    return value


def check_text(value, where: str) -> None:
    """A string that came from JSON parsed elsewhere (a Triton request parameter): no lone surrogates."""
    if isinstance(value, str) and _has_surrogate(value):
        raise RequestError(f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)")
