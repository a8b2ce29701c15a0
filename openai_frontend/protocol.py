"""The front's request bodies as pydantic models (FastAPI's convention, as vLLM's entrypoints/openai/protocol.py):
one model per endpoint body, whose fields, types, ranges and descriptions `/openapi.json` and `/docs` list.

A body is read as strict JSON (`parse_json_body`: backend_lib.contract.json_input's depth limit, duplicate keys,
NaN, huge numbers, surrogates), then validated by its model (`validated`), strictly: no coercion (`"stream": 7`,
`"n": true`, `"temperature": "0.5"` are refused; an integer field takes a float only when it is whole, as the
engine does), and a field outside the model is refused (extra="forbid"): nothing is silently ignored. The
numeric ranges are the engine's table (backend_lib.contract.fields.RANGES), so that no value can wrap when cast
to its wire type. Checks across fields are the models' validators; they raise `FieldError`, which names its
field. Checks that need the model (its max_tokens limit, the prompt's length, the vocabulary) stay with the
LLM model, whose errors name the field too.

Any validation error is ONE 400 in OpenAI's error shape (errors.APIError): its message starts with the path of
the field (`messages[2].content: ...`), `param` is the top-level field (`messages`), or a longer path a model
declares in `param_paths` (the Responses API's `text.format`).
"""
import json
import re
from typing import Annotated, Any, ClassVar, Literal, Optional, TypeVar, Union

from fastapi import Depends, Request
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool,
                      StrictFloat, StrictInt, Tag, ValidationError, WithJsonSchema, model_validator)
from pydantic.json_schema import models_json_schema

from backend_lib.contract.json_input import loads
from backend_lib.contract.choices import MAX_N
from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import (INT32_MAX, LOGIT_BIAS_RANGE, NEUTRAL_KEYS, RANGES, SamplingLimits,
                                         check_logit_bias, check_lora_name)
from backend_lib.contract.structured import CONSTRAINT_KEYS, GUIDED_ALIASES, JSON_OPTIONS, NEUTRAL_OPTIONS
from .errors import APIError, bad_request

LIMITS = SamplingLimits()                 # the LLM models' default limits
MAX_LOGPROBS = LIMITS.max_logprobs        # checked here to name top_logprobs / prompt_logprobs
MAX_CHOICES = 256                         # prompts x n in one request
MAX_TOOLS = 128
MAX_DETOKENIZE = 1 << 20                  # token ids in one /detokenize
MAX_PROMPT_SCORING = LIMITS.max_prompt_scoring   # one request's prompt scoring: sum over its prompts x n of
#                                                 prompt tokens x (top N + 1) entries
MAX_METADATA = 16                         # Responses metadata entries (OpenAI's bounds)
MAX_METADATA_KEY = 64                     # characters of a metadata key
MAX_METADATA_VALUE = 512                  # characters of a metadata value


# ----- errors ---------------------------------------------------------------------------------------------
class FieldError(ValueError):
    """A failed check of a model validator, naming its field (a path inside the model: `stream_options`,
    `refusal`); the message starts with the field's name, or gets the field's path put before it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _steps(error: dict, body) -> tuple[list, list]:
    """A pydantic error's location as (steps, path). steps: each location part with whether it is the name
    pydantic gives a union's member ('str', 'list[str]', a tag) rather than a place in the document, told apart
    by walking the document along the location. path: the places only, then a FieldError's field."""
    loc, steps, path, node = list(error["loc"]), [], [], body
    for k, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            node = node[part]
        elif not (k == len(loc) - 1 and error["type"] == "missing"):
            steps.append((part, True))
            continue
        steps.append((part, False))
        path.append(part)
    failed = (error.get("ctx") or {}).get("error")
    if error["type"] == "value_error" and isinstance(failed, FieldError):
        path += [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", failed.field)]
    return steps, path


def _path(segments: list) -> str:
    out = ""
    for part in segments:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 48 else f"{text[:40]}...({len(text)} characters)"


_TYPE_ERRORS = ("_type", "literal_error", "union_tag_not_found")
_PLAIN = {"a valid dictionary": "an object", "a valid list": "a list", "a valid string": "a string",
          "a valid integer": "an integer", "a valid number": "a number", "a valid boolean": "a boolean",
          "None": "null"}


def _must(error: dict) -> str:
    """pydantic's "Input should be X" as "X", in JSON's words."""
    text = re.sub(r"^(Input|List|String|Dictionary|Value) should (be )?", "", error["msg"])
    text = re.sub(r" after validation|(a valid dictionary) or (object to extract fields from|instance of \w+)",
                  r"\1", text)
    return _PLAIN.get(text, text)


def _message(error: dict, path: str) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    where = path or "the request body"
    got = error.get("input")
    if kind == "extra_forbidden":
        return f"{where}: unknown or unsupported field"
    if kind == "missing":
        return f"{where}: is required"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        text = str(ctx["error"])
        top = re.split(r"[.\[]", path, maxsplit=1)[0]
        return text if path and (text.startswith(path) or text.startswith(top)) else f"{where}: {text}"
    if kind in ("model_type", "model_attributes_type", "dict_type") or not isinstance(got, dict) and kind in (
            "union_tag_invalid", "union_tag_not_found"):
        return f"{path}: must be an object, got {_shown(got)}" if path else "the request body must be a JSON object"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        disc = str(ctx.get("discriminator", "type")).strip("'").removesuffix("()")
        if kind == "union_tag_not_found":
            return f"{where}.{disc}: is required"
        return f"{where}.{disc}: {ctx.get('tag')!r} is not supported (one of {ctx.get('expected_tags')})"
    verb = "must be" if error["msg"].startswith("Input should be") else "must"
    text = f"{where}: {verb} {_must(error)}"
    return text if isinstance(got, (dict, list)) else f"{text}, got {_shown(got)}"


class _Node:
    """The errors as a tree of their locations."""

    def __init__(self):
        self.children: dict = {}
        self.errors: list[int] = []


def _score(node: _Node, found: list) -> tuple:
    """How far a union's member got: its deepest error, and whether that is more than a wrong type."""
    best = max(((len(found[i][2]), not found[i][0]["type"].endswith(_TYPE_ERRORS)) for i in node.errors),
               default=(-1, False))
    return max([best] + [_score(c, found) for c in node.children.values()])


def _pick(node: _Node, found: list) -> list[int]:
    """The error to report: the first one in document order, and at a union the member that got furthest (the
    one the client meant); members that all failed on their type at one place are reported together."""
    if node.errors:
        return node.errors[:1]
    children = list(node.children.items())
    if not any(tag for (_, tag), _ in children):
        return _pick(children[0][1], found)
    scores = [_score(c, found) for _, c in children]
    top = max(scores)
    picks = [_pick(c, found) for (_, c), s in zip(children, scores) if s == top]
    if not top[1] and len({tuple(found[p[0]][2]) for p in picks}) == 1:
        return [i for p in picks for i in p]
    return picks[0]


def api_error(errors: list[dict], body, param_paths: tuple[str, ...] = ()) -> APIError:
    """One 400 for pydantic's errors (see _pick), naming the field."""
    found = [(e, *_steps(e, body)) for e in errors]
    root = _Node()
    for i, (_, steps, _) in enumerate(found):
        node = root
        for step in steps:
            node = node.children.setdefault(step, _Node())
        node.errors.append(i)
    chosen = [found[i] for i in _pick(root, found)]
    segments = chosen[0][2]
    path = _path(segments)
    if len(chosen) == 1:
        message = _message(chosen[0][0], path)
    else:
        musts = " or ".join(dict.fromkeys(_must(e) for e, _, _ in chosen))
        got = chosen[0][0].get("input")
        message = f"{path or 'the request body'}: must be {musts}" + (
            "" if isinstance(got, (dict, list)) else f", got {_shown(got)}")
    param = str(segments[0]) if segments else None
    for declared in param_paths:
        if path == declared or path.startswith((declared + ".", declared + "[")):
            param = declared
    return bad_request(message, param)


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], body) -> M:
    """`body` (parsed JSON) as `model`, or the one 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(exc.errors(include_url=False), body, getattr(model, "param_paths", ())) from None


def parse_json_body(raw: bytes):
    """The request body as strict JSON (backend_lib.contract.json_input: depth, number range, duplicate keys,
    surrogates, NaN), or a 400 naming the field."""
    try:
        return loads(raw, "")
    except RequestError as exc:
        message = str(exc)
        param = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", message)
        raise bad_request(message, param.group(1) if param and not message.startswith("the request body")
                          else None) from None


def json_body(model: type[M]):
    """A FastAPI dependency: the request's body (whatever its content type, as curl -d sends it) parsed as
    strict JSON and validated as `model`. The route declares the model for the schema with
    `openapi_extra=request_body(model)`; FastAPI's own body parsing (Python's lenient json) is not used."""
    async def read(request: Request):
        return validated(model, parse_json_body(await request.body()))
    return Depends(read)


def request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that reads `model` with json_body (its schema: components), and its
    400."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
        "responses": {"400": {"description": "A field that cannot be served as sent: OpenAI's error body "
                                             "{error: {message, type, param, code}}, param naming the field."}}}


def component_schemas(models) -> dict:
    """The JSON schemas of `models` and of every model they use, for the OpenAPI components."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


# ----- field types ----------------------------------------------------------------------------------------
class _Body(BaseModel):
    """Every body and every object in one: unknown fields are refused, types are not coerced."""
    model_config = ConfigDict(extra="forbid", strict=True)
    param_paths: ClassVar[tuple[str, ...]] = ()


def _whole(value):
    """An integer field takes a whole float (2.0), as the engine's check_number does; never a boolean."""
    return int(value) if type(value) is float and value.is_integer() else value


def ranged(name: str, lo=None, hi=None):
    """A number in the engine's range RANGES[name] (lo / hi: the front's own bounds where they differ)."""
    r = RANGES[name]
    lo = r.lo if lo is None else lo
    hi = r.hi if hi is None else hi
    opened = r.lo_open and lo == r.lo
    bounds = {("gt" if opened else "ge"): lo}
    schema = {"type": "integer" if r.kind is int else "number", ("exclusiveMinimum" if opened else "minimum"): lo}
    if hi is not None:
        bounds["le"] = hi
        schema["maximum"] = hi
    # the schema written out: pydantic cannot write a bound past int64 (seed's 2**64 - 1) as JSON schema's maximum
    if r.kind is int:
        return Annotated[StrictInt, BeforeValidator(_whole), Field(**bounds), WithJsonSchema(schema)]
    return Annotated[StrictFloat, Field(allow_inf_nan=False, **bounds), WithJsonSchema(schema)]


def _same(value, allowed) -> bool:
    """value == allowed, where a boolean equals only a boolean (true is not n=1, 0 is not echo=false)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def neutral(*allowed):
    """A field we do not implement, accepted only as null or one of its neutral `allowed` values (what a
    vLLM/OpenAI client sends by default); none: only null."""
    def check(value):
        if value is None or any(_same(value, a) for a in allowed):
            return value
        why = (f"only {' or '.join(json.dumps(a) for a in allowed)} is supported" if allowed
               else "is not supported (only null)")
        raise ValueError(f"{why}, got {_shown(value)}")
    schema = {"enum": [*allowed, None]} if allowed else {"type": "null"}
    return Annotated[Any, AfterValidator(check), WithJsonSchema(schema)]


def refused(why: str):
    """A field accepted only as null: `why` says what to use instead."""
    def check(value):
        if value is not None:
            raise ValueError(why)
        return value
    return Annotated[Any, AfterValidator(check), WithJsonSchema({"type": "null"})]


def _lora_name(value: str) -> str:
    return check_lora_name(value)


NonEmpty = Annotated[str, Field(min_length=1)]
ModelName = Annotated[str, Field(min_length=1, description="The model: a Triton LLM model or a LoRA adapter "
                                                           "(GET /v1/models lists both).")]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Identifier = Union[str, dict[str, Any]]
MaxTokens = ranged("max_tokens")
Logprobs = ranged("logprobs", hi=MAX_LOGPROBS)


def _logit_bias(value):
    if value is None:
        return None
    return {str(k): v for k, v in (check_logit_bias(value, None, LIMITS.max_logit_bias) or {}).items()}


LogitBias = Annotated[
    Optional[Annotated[dict[str, Annotated[StrictFloat, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]],
                       Field(max_length=LIMITS.max_logit_bias, json_schema_extra={"propertyNames": {
                           "pattern": "^[0-9]+$"}})]],
    BeforeValidator(lambda v: None if v == [] else v), AfterValidator(_logit_bias)]


# ----- shared objects -------------------------------------------------------------------------------------
class StreamOptions(_Body):
    include_usage: Optional[StrictBool] = Field(None, description="A last chunk with the usage of the request.")
    continuous_usage_stats: Optional[StrictBool] = Field(
        None, description="vLLM: the usage so far on every chunk.")


class ChatTemplateKwargs(_Body):
    enable_thinking: Optional[StrictBool] = Field(
        None, description="Qwen3's thinking (default true): false renders the template's empty think block.")


class StructuredOutputs(_Body):
    """vLLM's StructuredOutputsParams: exactly one constraint (json, regex, choice, grammar, json_object, tool_calls) and its
    options. The values are checked by the engine, whose errors name structured_outputs.<key>."""
    json_: Any = Field(None, alias="json", description="A JSON schema (an object, or its JSON text) the output "
                                                       "must match.")
    regex: Any = Field(None, description="A regular expression the output must match.")
    choice: Any = Field(None, description="A list of strings: the output is one of them.")
    grammar: Any = Field(None, description="A Lark (or GBNF) grammar the output must match.")
    json_object: Any = Field(None, description="true: the output is any JSON object.")
    tool_calls: Any = Field(None, description="This project's: {functions: [{name, parameters}], parallel}: the "
                                              "output is Qwen3 tool calls of these functions (the grammar built "
                                              "from the model's vocabulary).")
    disable_any_whitespace: Any = Field(None, description="true: no whitespace between JSON tokens (by default "
                                                          "one space, or a newline and at most 20 spaces or tabs).")
    whitespace_pattern: Any = Field(None, description="A regex for the whitespace between JSON tokens.")
    disable_fallback: Any = Field(None, description="Accepted (there is no other backend to fall back to).")
    disable_additional_properties: Any = Field(None, description="Only false.")
    structural_tag: Any = Field(None, description="Only null.")
    backend: Any = Field(None, description='Only null, "auto", "guidance" or "llguidance".')


# ----- chat / completions ---------------------------------------------------------------------------------
class JsonSchemaFormat(_Body):
    name: str = Field(None, description="The schema's name.")
    description: str = Field(None, description="What the schema describes.")
    schema_: dict[str, Any] = Field(None, alias="schema", description="The JSON schema the output must match.")
    strict: Optional[StrictBool] = Field(None, description="Accepted: the schema is always enforced.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON matching json_schema.schema "
                    "(the engine's structured output).")
    json_schema: JsonSchemaFormat = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "response_format.json_schema must be {name, description, schema, strict}")
        return self


class SamplingFields(_Body):
    """The sampling fields of chat, completions and Responses requests (the Triton LLM request's inputs)."""
    temperature: Optional[ranged("temperature")] = Field(
        None, description="Sampling temperature; below 1e-5 greedy.")
    top_p: Optional[ranged("top_p")] = Field(None, description="Nucleus sampling: the smallest set of tokens whose "
                                                               "probabilities sum to top_p.")
    top_k: Optional[ranged("top_k", lo=-1)] = Field(
        None, description="vLLM: sample among the k most likely tokens; 0 or -1: off.")
    min_p: Optional[ranged("min_p")] = Field(
        None, description="vLLM: drop tokens less likely than min_p times the most likely one's probability.")
    seed: Optional[ranged("seed")] = Field(
        None, description="Reproducible sampling; choice j of n is seeded seed + j.")
    presence_penalty: Optional[ranged("presence_penalty")] = Field(
        None, description="Subtracted from the logits of tokens already generated.")
    frequency_penalty: Optional[ranged("frequency_penalty")] = Field(
        None, description="Subtracted from the logits of tokens, times their count so far.")
    repetition_penalty: Optional[ranged("repetition_penalty")] = Field(
        None, description="vLLM: divides the positive logits (multiplies the negative ones) of tokens in the "
                          "prompt and the output; 1: off.")
    min_tokens: Optional[ranged("min_tokens")] = Field(
        None, description="vLLM: no end of sequence or stop before this many tokens.")
    ignore_eos: Optional[StrictBool] = Field(None, description="vLLM: generate past the end-of-sequence token.")
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        None, description="vLLM: requests with different salts never share cached KV pages.")
    stop: Optional[Union[str, list[str]]] = Field(
        None, description=f"Strings that end the output (not included); at most {LIMITS.max_stop_strings} of at "
                          f"most {LIMITS.max_stop_string_len} characters (the LLM model's limits).")
    stop_token_ids: Optional[list[TokenId]] = Field(
        None, description=f"vLLM: token ids that end the output; at most {LIMITS.max_stop_token_ids}, in the "
                          "vocabulary (the LLM model's checks).")
    structured_outputs: Optional[StructuredOutputs] = Field(
        None, description="vLLM: constrain the output (with response_format or forced tools: only its "
                          "whitespace options).")
    user: Optional[Identifier] = Field(None, description="An identifier of the end user (accepted, unused).")
    safety_identifier: Optional[Identifier] = Field(None, description="Accepted, unused.")
    prompt_cache_key: Optional[Identifier] = Field(None, description="Accepted, unused (prefix caching is "
                                                                     "automatic).")


class TemplateFields(_Body):
    """The chat template's options (chat and Responses)."""
    chat_template_kwargs: Optional[ChatTemplateKwargs] = Field(
        None, description="vLLM: options of the chat template (only enable_thinking).")
    parallel_tool_calls: Optional[StrictBool] = Field(
        None, description="false: at most one tool call (enforced when the call is forced).")


class GenerateFields(_Body):
    """What chat and completions requests share beyond sampling."""
    model: ModelName
    stream: Optional[StrictBool] = Field(None, description="Server-sent events, one chunk per token.")
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream true.")
    max_tokens: Optional[MaxTokens] = Field(None, description="The most tokens to generate (and at most the LLM "
                                                              "model's max_tokens limit).")
    n: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = Field(
        None, description=f"Choices per prompt (one Triton request each); prompts x n at most {MAX_CHOICES}.")
    response_format: Optional[ResponseFormat] = Field(None, description="The output's format.")
    guided_json: Any = Field(None, description="vLLM's older form of structured_outputs.json.")
    guided_regex: Any = Field(None, description="vLLM's older form of structured_outputs.regex.")
    guided_choice: Any = Field(None, description="vLLM's older form of structured_outputs.choice.")
    guided_grammar: Any = Field(None, description="vLLM's older form of structured_outputs.grammar.")
    guided_json_object: Any = Field(None, description="vLLM's older form of structured_outputs.json_object.")
    guided_decoding_backend: Any = Field(None, description="vLLM's older form of structured_outputs.backend "
                                                           "(checked by the engine).")
    guided_whitespace_pattern: Any = Field(None, description="vLLM's older form of "
                                                             "structured_outputs.whitespace_pattern.")
    skip_special_tokens: Optional[StrictBool] = Field(None, description="vLLM: leave special tokens out of the "
                                                                        "text (default true).")
    logit_bias: LogitBias = Field(None, description=f"Token id (a string) -> a bias in [-{LOGIT_BIAS_RANGE:g}, "
                                                    f"{LOGIT_BIAS_RANGE:g}] added to its logit; at most "
                                                    f"{LIMITS.max_logit_bias} entries.")
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = Field(
        None, description="vLLM: only these tokens may be sampled.")
    bad_words: Optional[Annotated[list[Annotated[str, Field(max_length=LIMITS.max_bad_word_len)]],
                                  Field(max_length=LIMITS.max_bad_words)]] = Field(
        None, description="vLLM: words never generated.")
    prompt_logprobs: Optional[ranged("prompt_logprobs", hi=MAX_LOGPROBS)] = Field(
        None, description="vLLM: the prompt tokens' logprobs with their top N alternatives (not with stream).")
    priority: Optional[ranged("priority")] = Field(
        None, description="vLLM: with the model's scheduling_policy priority, lower runs first (the fcfs "
                          "models refuse any other value than 0).")
    metadata: Optional[Identifier] = Field(None, description="Accepted, unused.")
    request_id: Optional[Identifier] = Field(None, description="Accepted, unused.")
    # vLLM SamplingParams we do not implement: only their neutral value
    best_of: neutral(*NEUTRAL_KEYS["best_of"]) = Field(None, description="Only 1.")
    use_beam_search: neutral(*NEUTRAL_KEYS["use_beam_search"]) = Field(None, description="Only false.")
    length_penalty: neutral(*NEUTRAL_KEYS["length_penalty"]) = Field(None, description="Only 1 (beam search).")
    early_stopping: neutral(*NEUTRAL_KEYS["early_stopping"]) = Field(None, description="Only false (beam search).")
    logits_processors: neutral(*NEUTRAL_KEYS["logits_processors"]) = Field(None, description="Only [].")
    include_stop_str_in_output: neutral(*NEUTRAL_KEYS["include_stop_str_in_output"]) = Field(
        None, description="Only false.")
    detokenize: neutral(*NEUTRAL_KEYS["detokenize"]) = Field(None, description="Only true.")
    spaces_between_special_tokens: neutral(*NEUTRAL_KEYS["spaces_between_special_tokens"]) = Field(
        None, description="Only true.")
    truncate_prompt_tokens: neutral(*NEUTRAL_KEYS["truncate_prompt_tokens"]) = Field(
        None, description="Only null (a prompt longer than the model's max_model_len is a 400).")

    @model_validator(mode="after")
    def _streaming(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs: not available with stream true (as vLLM)")
        return self


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Union[NonEmpty, TokenIds, Annotated[list[Union[NonEmpty, TokenIds]], Field(min_length=1)]]


class CompletionRequest(SamplingFields, GenerateFields):
    """POST /v1/completions."""
    prompt: Prompt = Field(description="A string, a list of token ids, or a list of either (several prompts: "
                                       "one choice each, in order).")
    logprobs: Optional[Logprobs] = Field(None, description="The top N alternatives of each token, with their "
                                                           "logprobs.")
    echo: Optional[StrictBool] = Field(None, description="The prompt (and, with logprobs, its tokens' logprobs) "
                                                         "before the output.")
    suffix: neutral("") = Field(None, description='Only "" (no insertion).')

    @model_validator(mode="after")
    def _choices(self):
        prompts = self.prompt if isinstance(self.prompt, list) and self.prompt and not isinstance(
            self.prompt[0], int) else [self.prompt]
        n = self.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise FieldError("prompt", f"prompt: {len(prompts)} prompts x n {n} choices exceed {MAX_CHOICES} "
                                       "choices per request")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MessageFunction(_Body):
    name: str
    arguments: Union[str, dict[str, Any]] = Field("", description="The arguments as JSON text (or an object).")


class MessageToolCall(_Body):
    id: str = Field(None, description="The call's id, which the tool message's tool_call_id answers.")
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is taken as system.")
    content: Optional[Union[str, list[TextPart]]] = Field(
        None, description="A string, or text parts (joined by newlines).")
    name: Optional[str] = Field(None, description="The author's name (for the template).")
    tool_calls: Optional[list[MessageToolCall]] = Field(None, description="An assistant's tool calls.")
    tool_call_id: Optional[str] = Field(None, description="A tool message: the call it answers.")
    reasoning_content: Optional[str] = Field(None, description="An assistant's earlier thinking (older clients' "
                                                               "name).")
    reasoning: Optional[str] = Field(None, description="An assistant's earlier thinking (current vLLM's name).")
    refusal: Optional[str] = Field(None, description="What an assistant said when it refused (an assistant message "
                                                     "without content).")

    @model_validator(mode="after")
    def _refusal_and_reasoning(self):
        if self.refusal is not None and (self.role != "assistant" or self.content):
            raise FieldError("refusal", "only an assistant message without content may carry a refusal (a string)")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise FieldError("reasoning", "reasoning and reasoning_content differ; send one of them")
        return self


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str = Field(None, description="What the function does (for the template).")
    parameters: dict[str, Any] = Field(None, description="The arguments' JSON schema (enforced when the call is "
                                                         "forced: it must compile).")
    strict: StrictBool = Field(None, description="Accepted: a forced call always matches its schema.")


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


def check_tools(tools, tool_choice) -> None:
    """tools and tool_choice together (chat; /tokenize takes tools alone): names unique, a choice needs tools,
    a named function is among them."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice requires tools")
        return
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise FieldError("tools", "tools: function names must be unique")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise FieldError("tool_choice", f"tool_choice: function {tool_choice.function.name!r} is not among tools")


Messages = Annotated[list[ChatMessage], Field(min_length=1)]
Tools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]


class ChatCompletionRequest(SamplingFields, TemplateFields, GenerateFields):
    """POST /v1/chat/completions."""
    messages: Messages = Field(description="The conversation, rendered by the model's chat template (the "
                                           "tokenizer model).")
    max_completion_tokens: Optional[MaxTokens] = Field(
        None, description="OpenAI's name for max_tokens (both given: they must agree).")
    logprobs: Optional[StrictBool] = Field(None, description="Each token's logprob.")
    top_logprobs: Optional[Logprobs] = Field(None, description="With logprobs: the top N alternatives of each "
                                                               "token.")
    tools: Optional[Tools] = Field(None, description="Function tools, rendered by the template; <tool_call> blocks "
                                                     "of the output become tool_calls.")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description="auto (default), none (calls are not parsed), required or a named function (forced by "
                          "a grammar: the output is a valid call).")
    include_reasoning: Optional[StrictBool] = Field(None, description="vLLM: false leaves the thinking out of the "
                                                                      "response.")
    add_generation_prompt: neutral(True) = Field(None, description="Only true.")
    continue_final_message: neutral(False) = Field(None, description="Only false.")
    add_special_tokens: neutral(False) = Field(None, description="Only false (the template has them).")
    store: neutral(False) = Field(None, description="Only false (chat completions are not stored).")
    service_tier: neutral("auto", "default") = Field(None, description='Only "auto" or "default".')
    modalities: neutral(["text"]) = Field(None, description='Only ["text"].')

    @model_validator(mode="after")
    def _chat_checks(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            # OpenAI deprecated max_tokens for max_completion_tokens: one meaning
            raise FieldError("max_tokens", f"max_tokens and max_completion_tokens differ ({self.max_tokens}, "
                                           f"{self.max_completion_tokens}); send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        check_tools(self.tools, self.tool_choice)
        return self


# ----- /tokenize, /detokenize -----------------------------------------------------------------------------
class TokenizeRequest(_Body):
    """POST /tokenize (vLLM): a prompt, or chat messages rendered by the template."""
    model: ModelName
    prompt: Optional[NonEmpty] = Field(None, description="A text (or send messages).")
    messages: Optional[Messages] = Field(None, description="A conversation, rendered by the chat template.")
    add_special_tokens: Optional[StrictBool] = Field(None, description="Accepted: Qwen3 adds no special tokens to a "
                                                                       "prompt either way.")
    add_generation_prompt: Optional[StrictBool] = Field(None, description="With messages: end with the assistant's "
                                                                          "turn (default true).")
    chat_template_kwargs: Optional[ChatTemplateKwargs] = Field(None, description="With messages: template options.")
    tools: Optional[Tools] = Field(None, description="With messages: tools for the template.")
    continue_final_message: neutral(False) = Field(None, description="With messages: only false.")
    return_token_strs: Optional[StrictBool] = Field(None, description="Each token's text too.")

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "prompt or messages: send one of them")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "chat_template_kwargs", "tools", "continue_final_message"):
                if getattr(self, name) is not None:
                    raise FieldError(name, f"{name}: only with messages")
        check_tools(self.tools, None)
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM): token ids to text."""
    model: ModelName
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)] = Field(
        description="Token ids, in the model's vocabulary.")


# ----- LoRA adapters --------------------------------------------------------------------------------------
LoraName = Annotated[str, AfterValidator(_lora_name), Field(
    description="The adapter's name, usable as `model` (no surrounding spaces).")]


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM)."""
    lora_name: LoraName
    lora_path: NonEmpty = Field(description="The adapter's folder (PEFT adapter_config.json and weights) on the "
                                            "Triton host.")
    base_model_name: Optional[NonEmpty] = Field(None, description="The Triton LLM model it runs on (default: "
                                                                  "--lora-base-model, else the first one).")


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM)."""
    lora_name: LoraName
    lora_int_id: Optional[StrictInt] = Field(None, description="vLLM's adapter number (accepted, unused).")


# ----- Responses API --------------------------------------------------------------------------------------
class ContentPart(_Body):
    type: Literal["input_text", "output_text"] = Field(description="input_text in user, system and developer "
                                                                   "messages; output_text in assistant ones.")
    text: str
    annotations: Any = Field(None, description="Accepted, unused.")
    logprobs: Any = Field(None, description="Accepted, unused.")


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    @model_validator(mode="after")
    def _part_kinds(self):
        kind = "output_text" if self.role == "assistant" else "input_text"
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != kind:
                raise FieldError(f"content[{j}].type", f"{part.type!r} is not supported (only {kind})")
        return self


class InputTextPart(ContentPart):
    type: Literal["input_text"]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputTextPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningPart(_Body):
    type: Optional[str] = None
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    content: Optional[list[ReasoningPart]] = Field(None, description="The thinking, in the clear: the next "
                                                                     "assistant turn's reasoning_content.")
    summary: Optional[list[ReasoningPart]] = Field(None, description="Taken as content when content is empty.")
    encrypted_content: refused("not supported (reasoning is returned in the clear)") = None
    id: Optional[str] = None
    status: Optional[str] = None


def _item_type(item):
    if not isinstance(item, dict):
        return None
    return item.get("type", "message" if "role" in item else None)


_item_type.__name__ = "type"
InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(_Body):
    type: Literal["function"] = Field(description="Only function tools.")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ResponsesNamedToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="The JSON schema the output must "
                                                                                "match.")
    strict: Optional[StrictBool] = None
    description: Optional[str] = None


class TextConfig(_Body):
    format: Optional[Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                               Field(discriminator="type")]] = Field(None, description="The output's format.")
    verbosity: refused("not supported") = None


_THINKING = "not supported (Qwen3's thinking is switched with chat_template_kwargs.enable_thinking)"


class ReasoningConfig(_Body):
    effort: refused(_THINKING) = None
    summary: refused(_THINKING) = None
    generate_summary: refused(_THINKING) = None


class CreateResponseRequest(SamplingFields, TemplateFields):
    """POST /v1/responses: run as a chat request (same sampling, tools, grammars and limits)."""
    param_paths: ClassVar[tuple[str, ...]] = ("text.format",)
    model: ModelName
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]] = Field(
        description="A user message, or input items (messages, function calls and their outputs, reasoning).")
    instructions: Optional[str] = Field(None, description="This request's system message (not carried over by "
                                                          "previous_response_id).")
    stream: Optional[StrictBool] = Field(None, description="OpenAI's typed server-sent events.")
    max_output_tokens: Optional[MaxTokens] = Field(None, description="The most tokens to generate.")
    tools: Optional[list[FunctionTool]] = Field(None, description="Function tools.")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]] = Field(
        None, description="As in chat: required and a named function are forced by a grammar.")
    text: Optional[TextConfig] = Field(None, description="The output's format (text.format).")
    store: Optional[StrictBool] = Field(None, description="Keep the response for GET and previous_response_id "
                                                          "(default true).")
    previous_response_id: Optional[str] = Field(None, description="Continue a stored response's conversation.")
    metadata: Optional[Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                                      Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                                 Field(max_length=MAX_METADATA)]] = Field(
        None, description=f"At most {MAX_METADATA} string values (keys of at most {MAX_METADATA_KEY} characters, values "
                          f"of at most {MAX_METADATA_VALUE}, as OpenAI's), repeated in the response.")
    reasoning: Optional[ReasoningConfig] = Field(None, description="Only nulls: " + _THINKING.removeprefix(
        "not supported "))
    truncation: neutral("disabled") = Field(None, description='Only "disabled".')
    background: neutral(False) = Field(None, description="Only false.")
    include: neutral([]) = Field(None, description="Only [].")
    service_tier: neutral("auto", "default") = Field(None, description='Only "auto" or "default".')
    top_logprobs: neutral(0) = Field(None, description="Only 0.")
    max_tool_calls: neutral() = Field(None, description="Not supported (only null).")
    stream_options: neutral() = Field(None, description="Not supported (only null).")
    prompt: neutral() = Field(None, description="Not supported (only null): prompt templates.")
    conversation: neutral() = Field(None, description="Not supported (only null): use previous_response_id.")


# every body a route reads, for the OpenAPI components
BODIES = (ChatCompletionRequest, CompletionRequest, CreateResponseRequest, TokenizeRequest, DetokenizeRequest,
          LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)

# the engine's tables name every field declared by hand above
assert set(NEUTRAL_KEYS) - {"n", "prompt_logprobs"} <= set(GenerateFields.model_fields)
assert set(GUIDED_ALIASES) <= set(GenerateFields.model_fields)
assert {f.alias or n for n, f in StructuredOutputs.model_fields.items()} == {
    *CONSTRAINT_KEYS, *JSON_OPTIONS, *NEUTRAL_OPTIONS}
