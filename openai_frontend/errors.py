"""OpenAI-style errors: one exception type, its JSON body, and the mapping of Triton's messages."""
from __future__ import annotations

import re

# Triton input names that OpenAI clients know under another name
_TRITON_PARAMS = {"stop_words": "stop", "text_input": "prompt", "input_ids": "prompt",
                  "sampling_parameters": None}
_FIELD_AT_START = re.compile(r"^([a-z_]+)\b")
_SERVER_FAULTS = ("internal error", "engine step failed", "request failed", "kv cache too small", "engine fault")
_UNAVAILABLE = ("server overloaded", "engine stopped")


class APIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def from_triton(message: str) -> APIError:
    """A Triton stream error. The stream carries only the message, so the status is read from it: the
    LLM models name the field first on a bad request (INVALID_ARG) and prefix their own faults."""
    lower = message.lower()
    if "unknown model" in lower:
        return APIError(404, message, param="model", code="model_not_found")
    if lower.startswith(_UNAVAILABLE):
        return unavailable(message)
    if any(lower.startswith(p) for p in _SERVER_FAULTS):
        return APIError(500, message, type="server_error")
    match = _FIELD_AT_START.match(message)
    field = match.group(1) if match else None
    return bad_request(message, _TRITON_PARAMS.get(field, field))
