"""Why a generation ended: the finish reasons, str-valued so that the wire carries the same bytes."""
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"              # EOS, a stop token or a stop string
    LENGTH = "length"          # max_tokens (or the context) reached
    ABORT = "abort"            # ended by the server (an abort request, unload, shutdown)
    CANCELLED = "cancelled"    # the client went away (a cancelled stream)
    ERROR = "error"            # this request failed (its error names why)
    TOOL_CALLS = "tool_calls"  # the OpenAI front's name of a stop after tool calls
