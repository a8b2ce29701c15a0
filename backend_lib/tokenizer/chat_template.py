"""Renders a checkpoint's Jinja chat template the way transformers does (sandboxed jinja2)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
