"""Sampled tokens -> per-request deltas: appending, detokenizing, stop strings and ids, finishing.

The processor owns each request's text state (incremental detokenizer and stop matcher); the
scheduler owns its pages. A request whose processing fails (say its detokenizer raises) is finished
with an error of its own; the others of the step are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sampling.sampler import Sample
from ..tokenizer import Tokenizer
from ..tokenizer.detokenizer import IncrementalDetokenizer
from ..tokenizer.stop import StopMatcher
from .outputs import RequestOutput
from .sequence import Sequence


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._text: dict[str, _TextState] = {}

    def add(self, seq: Sequence) -> None:
        self._text[seq.request_id] = _TextState(self.tokenizer.detokenizer(seq.params.skip_special_tokens),
                                                StopMatcher(seq.params.stop))
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs:
            # the first prompt token has no context (logprob None): its entry names the token
            seq.prompt_logprobs.append({"id": seq.prompt_ids[0], "logprob": None, "rank": None, "top": []})

    @staticmethod
    def record_prompt_logprobs(seq: Sequence, chunk) -> None:
        """A prompt chunk's prompt_logprobs (the runner's tensors, model_runner.PromptLogprobs) as the API's
        {"id", "logprob", "rank", "top": [{"id", "logprob"}]} entries; a chunk that failed fails its request."""
        if chunk.error is not None:
            seq.failure = chunk.error
            return
        if chunk.first != len(seq.prompt_logprobs):   # the runner gives only the entries not recorded yet
            seq.failure = (f"prompt_logprobs: a chunk from prompt token {chunk.first} after "
                           f"{len(seq.prompt_logprobs)} recorded")
            return
        values, ranks = chunk.logprobs.tolist(), chunk.ranks.tolist()
        ids = chunk.top_ids.tolist() if chunk.top_ids is not None else None
        vals = chunk.top_logprobs.tolist() if chunk.top_logprobs is not None else None
        for i, tok in enumerate(chunk.token_ids):
            seq.prompt_logprobs.append({
                "id": tok, "logprob": values[i], "rank": int(ranks[i]),
                "top": [] if ids is None else [{"id": j, "logprob": v} for j, v in zip(ids[i], vals[i])]})

    def process(self, seq: Sequence, sample: Sample) -> RequestOutput:
        """Appends the sampled token; the output says whether (and why) the request finished."""
        tok = sample.token_id
        seq.append(tok)
        logprobs = None
        if sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
            logprobs = [{"id": tok, "logprob": sample.logprob, "rank": sample.rank,
                         "top": [{"id": i, "logprob": lp} for i, lp in sample.top_logprobs or []]}]
        state = self._text[seq.request_id]
        n_out = len(seq.output_ids)
        reason = None
        text = ""
        if tok in seq.stop_ids:  # the sampler blocks these before min_tokens
            reason = "stop"
        else:
            grammar_done = seq.grammar is not None and seq.grammar.accept(tok)
            delta = state.detokenizer.add(tok)
            text = state.stop.feed(delta) if n_out > seq.params.min_tokens else delta
            if state.stop.stopped_on is not None or grammar_done:
                reason = "stop"
        if reason is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if state.stop.stopped_on is None:
                text += state.stop.feed(state.detokenizer.flush()) + state.stop.flush()
            seq.finish_reason = reason
            self._text.pop(seq.request_id, None)
        return self.output(seq, [tok], text, logprobs)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        """Ends a request from outside the token stream (cancel, abort, a failure): a final empty delta."""
        seq.finish_reason = reason
        self._text.pop(seq.request_id, None)
        return self.output(seq, [], "", None, error)

    @staticmethod
    def output(seq: Sequence, ids, text, logprobs, error: str | None = None) -> RequestOutput:
        prompt_logprobs = None
        if seq.prompt_logprobs and not seq.prompt_logprobs_sent and len(seq.prompt_logprobs) == len(seq.prompt_ids):
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return RequestOutput(prompt_logprobs=prompt_logprobs, num_cached_tokens=seq.num_cached_tokens or 0,
            request_id=seq.request_id, new_token_ids=list(ids), new_text=text,
            finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids), new_logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None, error=error)
