"""Support code of the speculative-decoding tests (not a test module): run prompts on two engines and compare
the ids, requiring that speculation did something."""
from __future__ import annotations

GREEDY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
# a low temperature: the random demo weights then fall into loops often enough for drafts to be accepted
SEEDED = {"temperature": 0.3, "top_p": 0.95, "top_k": 50, "seed": 11, "max_tokens": 48, "ignore_eos": True}
PROMPTS = ["Hello, world!", "a b a b a b a b a b a b", "介绍一下北京故宫", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"]


def spec_ids(engine, prompts, datas):
    """(ids, finish reason, text) of each prompt run together on engine (continuous batching)."""
    datas = datas if isinstance(datas, list) else [datas] * len(prompts)
    res = engine.generate(prompts, [engine.make_params(d) for d in datas])
    return [(r["output_ids"], r["finish_reason"], r["text"]) for r in res]


def compare_spec(off, on, prompts, datas, min_accepted=1, min_drafts=1):
    """The same prompts on `off` (no speculation) and `on`: equal results, and at least `min_drafts` draft
    tokens proposed and `min_accepted` accepted on `on` meanwhile (a test that drafted nothing tested nothing)."""
    drafted, accepted = on.stats.spec_num_draft_tokens, on.stats.spec_num_accepted_tokens
    expected = spec_ids(off, prompts, datas)
    got = spec_ids(on, prompts, datas)
    assert got == expected
    assert on.stats.spec_num_draft_tokens - drafted >= min_drafts, "no draft was proposed"
    assert on.stats.spec_num_accepted_tokens - accepted >= min_accepted, "no draft was accepted"
    return got


# ----- through tritonserver (the served comparisons) -----------------------------------------------------------
def served_ids(responses):
    """The ids of one stream collected by helpers.collect, which must have ended without an error."""
    assert responses[-1][2] and responses[-1][0] != "ERROR", responses
    return [i for _, ids, _ in responses for i in ids]


def served_text(responses):
    return "".join(t for t, _, _ in responses)


def served_both(server, jobs, spec_model, plain_model="qwen3_plain"):
    """Each job (prompt, sampling parameters) on both models, all at once: (spec results, plain results)."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import collect

    def one(args):
        model, (prompt, sp) = args
        return collect(server.grpc_url, model, prompt=prompt, sampling_parameters=sp)
    work = [(spec_model, j) for j in jobs] + [(plain_model, j) for j in jobs]
    with ThreadPoolExecutor(len(work)) as pool:
        res = list(pool.map(one, work))
    return res[:len(jobs)], res[len(jobs):]


# ----- verification steps without an engine (the verification graphs' tests) ------------------------------------
class VerifyingSeq:
    """What a verification step reads of a sequence (engine/cuda_graphs.py, ModelRunner.prepare): its tokens
    (prompt + output), the drafts after them, how many are cached, its pages. One token pending: decoding."""

    def __init__(self, tokens, drafts, table, lora=None):
        self.tokens, self.spec_tokens, self.block_table, self.lora = list(tokens), list(drafts), list(table), lora
        self.num_computed = len(self.tokens) - 1
        self.params = self.prompt_logprobs = None

    @property
    def num_tokens(self):
        return len(self.tokens)

    @property
    def num_pending(self):
        return len(self.tokens) - self.num_computed

    def plan(self):
        """(self, rows) as the scheduler plans a decode with its drafts."""
        return self, 1 + len(self.spec_tokens)


class KnowingProposer:
    """A proposer (spec/decoder.py's interface) that drafts from the known output of each prompt: by turns (the
    tokens a request has emitted, mod 3) all right, right then wrong, or nothing, so that a step mixes full
    verifications, early rejections and plain decode rows. Verification is exact whatever the drafts are."""

    def __init__(self, outputs: dict[tuple, list[int]]):
        self.outputs = outputs

    def new_state(self, seq):
        return None

    def propose(self, rows):
        out = []
        for r in rows:
            n = len(r.seq.output_ids)
            right = self.outputs[tuple(r.seq.prompt_ids)][n:n + r.room]
            turn = (n + len(r.seq.prompt_ids)) % 3
            wrong = [right[0], right[0] ^ 1][:r.room]     # (x ^ 1: another id inside an even vocabulary)
            out.append(right if turn == 0 else wrong if turn == 1 else [])
        return out

    def commit(self, seq, state, accepted):
        pass

    def free(self, seq, state):
        pass
