"""One engine request as the Triton LLM model serves it (`RequestState`), and what it sends for each engine
output: a streamed request its delta; a non-streamed one nothing until its final output, then the whole result
collected (the prompt's text first unless exclude_input_in_output)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .abort_tokens import new_token
from .request import ParsedRequest
from .responses import output_arrays


@dataclass
class RequestState:
    rid: str
    triton_id: str
    sender: object
    req: ParsedRequest
    prompt_ids: list[int]
    arrival: float
    abort_token: str = field(default_factory=new_token)
    last_token_at: float | None = None
    generated: int = 0
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list | None = None
    done: bool = False
    index: int = 0                        # the choice (n > 1)
    group: object = None                  # the ChoiceGroup of an n > 1 request

    def response_arrays(self, out, tokenizer) -> dict | None:
        """The output arrays to send for engine output `out` (None: nothing to send yet)."""
        req = self.req
        token_text = _token_text(tokenizer)
        if req.stream:
            return output_arrays(out.new_text, out.new_token_ids, finish_reason=out.finish_reason,
                                 num_input_tokens=out.num_prompt_tokens, num_output_tokens=len(out.new_token_ids),
                                 token_text=token_text, num_cached_tokens=out.num_cached_tokens,
                                 cumulative_logprob=out.cumulative_logprob,
                                 logprobs=out.new_logprobs if req.logprobs_output else None, flags=req,
                                 prompt_logprobs=out.prompt_logprobs)
        self.text.append(out.new_text)
        self.ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if not out.finished:
            return None
        text = "".join(self.text)
        if not req.exclude_input_in_output:
            prefix = req.text if req.input_ids is None else tokenizer.decode(self.prompt_ids,
                                                                             skip_special_tokens=False)
            text = prefix + text
        return output_arrays(text, self.ids, finish_reason=out.finish_reason,
                             num_input_tokens=out.num_prompt_tokens, num_output_tokens=len(self.ids),
                             token_text=token_text, num_cached_tokens=out.num_cached_tokens,
                             cumulative_logprob=out.cumulative_logprob,
                             logprobs=self.logprobs if req.logprobs_output else None,
                             flags=req, prompt_logprobs=self.prompt_logprobs)


def _token_text(tokenizer):
    """id -> a token's text for logprobs (decoded_token): its bytes as UTF-8, a partial character replaced."""
    table = tokenizer.token_bytes

    def text(token_id: int) -> str:
        return table[token_id].decode("utf-8", errors="replace") if 0 <= token_id < len(table) else ""
    return text
