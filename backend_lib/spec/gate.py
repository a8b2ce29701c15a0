"""The batch gate: per batch size, drafting only while it is measured to pay (speculative_config's
`auto_disable_from_batch`).

Why: verification buys tokens with rows. While a step streams its weights (batch 1 and a few rows on any
device) the k + 1 rows of a verifying sequence cost little more than its one row, and drafting pays whenever
drafts are accepted. Once a batch is large enough that the kernels compute rather than stream (on a 2-core
AVX2 host already at 16 sequences: 16 x 5 verification rows cost ~1.7x a 16-row step), every draft row costs
its full share and even a well-accepted request makes the batch slower. Where that crossover lies depends on
the device, the model, the kernels and the context lengths, so it is measured, not configured: vLLM's
`disable_by_batch_size` (a fixed cut, also honoured) needs the operator to know it.

How: decoding steps are bucketed by their number of decoding sequences (1, 2-3, 4-7, 8-15, ...). In a bucket
of at least `from_batch` sequences, the gate first lets `warmup` steps draft, then takes `probe` plain steps,
then keeps whichever arm has the higher tokens per second (decayed sums of the emitted tokens and the steps'
wall time, propose to output included) and still takes the other arm every `explore`-th step of the bucket,
so a change of workload (acceptance, contexts) moves the choice. Steps with a prefill chunk are not measured
(they say nothing about decoding). Buckets below `from_batch` always draft: there the per-request auto-disable
(acceptance) is what keeps a request from being slowed.

Exactness: the gate only decides whether a step drafts; a sequence's tokens are plain decoding's either way
(decoder.py), so the ids never depend on the gate's timings, only the speed does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SPEC, PLAIN = "spec", "plain"


@dataclass
class _Arm:
    tokens: float = 0.0    # decayed sums
    seconds: float = 0.0
    n: int = 0             # steps measured

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.n += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    steps: int = 0
    arms: dict = field(default_factory=lambda: {SPEC: _Arm(), PLAIN: _Arm()})


class BatchGate:
    def __init__(self, from_batch: int, warmup: int = 32, probe: int = 4, explore: int = 16, decay: float = 0.95):
        self.from_batch = from_batch
        self.warmup, self.probe, self.explore, self.decay = warmup, probe, explore, decay
        self.buckets: dict[int, _Bucket] = {}
        self.gated_steps = 0   # steps the gate kept from drafting (EngineStats.spec_gated_steps)

    @staticmethod
    def bucket(n: int) -> int:
        return n.bit_length()

    def choose(self, n_decoding: int) -> str:
        """The arm of the coming step with n_decoding decoding sequences: SPEC (draft) or PLAIN."""
        if n_decoding < self.from_batch:
            return SPEC
        b = self.buckets.setdefault(self.bucket(n_decoding), _Bucket())
        b.steps += 1
        spec, plain = b.arms[SPEC], b.arms[PLAIN]
        if spec.n < self.warmup:
            arm = SPEC
        elif plain.n < self.probe:
            arm = PLAIN
        else:
            best, other = (SPEC, PLAIN) if spec.rate >= plain.rate else (PLAIN, SPEC)
            arm = other if b.steps % self.explore == 0 else best
        if arm == PLAIN:
            self.gated_steps += 1
        return arm

    def record(self, n_decoding: int, arm: str, tokens: int, seconds: float) -> None:
        """A pure decoding step's outcome (no prefill chunk in it): its emitted tokens and wall time."""
        if n_decoding < self.from_batch or seconds <= 0:
            return
        b = self.buckets.get(self.bucket(n_decoding))
        if b is not None:
            b.arms[arm].add(tokens, seconds, self.decay)
