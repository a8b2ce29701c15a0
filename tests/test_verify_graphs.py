"""[spec] Verification steps from CUDA graphs (engine/cuda_graphs.py's VerifyGraphs), proven on the CPU with capture
off and the Triton set interpreted: the bucket layout (the step's rows packed first, padding sequences after,
the sink last), the bucket choice, the steps that stay eager, a padded step's logits equal to the eager step's
bit for bit with the same KV cache after it (padding writes nothing), and the engine's greedy ids with the
graphs path on equal to speculation off. (The capture itself needs a GPU.)"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined: they run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from backend_lib.checkpoint import ModelConfig, parse_quantization_config  # noqa: E402
from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.engine.cuda_graphs import DecodeGraphs, VerifyGraphs, verify_layout  # noqa: E402
from backend_lib.engine.model_runner import ModelRunner  # noqa: E402
from backend_lib.kernels import get_kernels  # noqa: E402
from helpers import make_engine  # noqa: E402
from spec_helpers import KnowingProposer, VerifyingSeq  # noqa: E402

# Checkpoints of 3,000 tokens (conftest.py): nothing here depends on the vocabulary's size (3,000 still ends off
# the kernel's tiles); the step's and the prompts' ids are all below it.
VOCAB = 3000


@pytest.fixture(scope="module")
def small_vocab(a8w8_small_vocab_ckpt, moe_a8w8_small_vocab_ckpt):
    return {"a8w8_ckpt": a8w8_small_vocab_ckpt, "moe_a8w8_ckpt": moe_a8w8_small_vocab_ckpt}


POOLS = ("k", "v", "k_codes", "v_codes", "k_scales", "v_scales")   # the dense and the TurboQuant caches' pools


def _step():
    """k = 2: a sequence verifying 2 drafts, one verifying 1 (fewer than k) across two splits' worth of keys, and
    a plain decode row: 6 real rows in bucket 4 (13 rows: 1 padding sequence, a sink of 6)."""
    a = VerifyingSeq(range(10, 16), [7, 8], [1, 2])
    b = VerifyingSeq(range(20, 61), [9], [3, 4, 6])
    c = VerifyingSeq([30, 31, 32], [], [5])
    return [a.plan(), b.plan(), c.plan()]


def test_the_layout_packs_the_steps_rows_then_padding_sequences_then_the_sink():
    lay = verify_layout(_step(), [1, 2, 4], 3, 16)
    assert lay.bucket == 4 and lay.rows == 6 and len(lay.ids) == len(lay.positions) == len(lay.slots) == 13
    assert lay.ids[:6] == [15, 7, 8, 60, 9, 32] and lay.ids[6:] == [0] * 7
    assert lay.positions[:6] == [5, 6, 7, 40, 41, 2] and lay.positions[6:] == [0] * 7
    assert lay.slots == [1 * 16 + 5, 1 * 16 + 6, 1 * 16 + 7, 6 * 16 + 8, 6 * 16 + 9, 5 * 16 + 2] + [-1] * 7
    assert lay.query_start_loc == [0, 3, 5, 6, 7, 13] and lay.seq_lens == [8, 42, 3, 1, 6]
    assert lay.tables == [[1, 2], [3, 4, 6], [5]]


def test_a_full_bucket_of_full_verifications_keeps_a_sink_row():
    """Without it the bucket would have as many rows as sequence slots at n = 1, k = 1, which the attention reads
    as a decode step (one row a sequence): every layout has more rows than sequence slots."""
    seqs = [VerifyingSeq([1, 2, 3], [4], [0]).plan()]
    lay = verify_layout(seqs, [1, 2], 2, 16)
    assert lay.bucket == 1 and lay.query_start_loc == [0, 2, 3] and lay.seq_lens == [4, 1] and lay.slots[2:] == [-1]
    for k in range(1, 5):
        for m in (1, 2, 3, 4):
            plan = [VerifyingSeq([1, 2], [5] * k, [0]).plan() for _ in range(m)]
            lay = verify_layout(plan, [1, 2, 4], k + 1, 16)
            assert lay.query_start_loc[-1] == len(lay.ids) > len(lay.seq_lens) and lay.seq_lens[-1] >= 1


@pytest.mark.parametrize("m,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_the_bucket_is_the_smallest_that_holds_the_steps_sequences(m, bucket):
    plan = [VerifyingSeq([1, 2], [3], [0]).plan() for _ in range(m)]
    lay = verify_layout(plan, [1, 2, 4, 8], 5, 16)
    assert lay.bucket == bucket and len(lay.ids) == bucket * 5 + 1 and len(lay.seq_lens) == bucket + 1


class _Runner:                              # what VerifyGraphs reads of a ModelRunner before a step
    device, page_size, aux_layers = torch.device("cpu"), 16, None


def test_the_steps_that_fall_back_to_eager():
    graphs = VerifyGraphs(_Runner(), 4, 4, 2, capture=False)
    assert graphs.fits(_step())
    assert not graphs.fits([VerifyingSeq([1, 2], [], [0]).plan()])              # no drafts: a decode step
    prefill = VerifyingSeq([1, 2, 3], [], [0])
    prefill.num_computed = 0
    assert not graphs.fits(_step()[:2] + [(prefill, 3)])                        # a prefill chunk in the step
    assert not graphs.fits([VerifyingSeq([1, 2], [3, 4, 5], [0]).plan()])       # more than k drafts
    assert not graphs.fits([_step()[0], VerifyingSeq([1, 2], [3], [0, 1, 2, 3, 4]).plan()])   # past the table
    assert not graphs.fits([VerifyingSeq([1, 2], [3], [0]).plan() for _ in range(5)])         # past the buckets
    seq = VerifyingSeq([1, 2], [3, 4], [0])
    assert not graphs.fits([(seq, 2)])                                          # rows other than 1 + drafts
    assert not graphs.fits([])
    graphs.failed = True                                                        # after a failed capture
    assert not graphs.fits(_step())


def _runner(ckpt, kv_cache):
    cfg = EngineConfig(checkpoint=str(ckpt), page_size=16, kv_cache_memory="4MiB", max_num_seqs=4,
                       kv_cache=kv_cache, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    mc = ModelConfig.from_dir(str(ckpt))
    runner = ModelRunner(cfg, mc, parse_quantization_config(mc.quantization_config), torch.device("cpu"),
                         torch.bfloat16, get_kernels("cpu", "triton"), 64)
    assert runner.graphs is None and runner.verify_graphs is None     # on the CPU the engine runs eagerly
    gen = torch.Generator().manual_seed(0)
    for name in POOLS:   # cached keys and values to attend to (every page: a padding read would show)
        for t in getattr(runner.kv_cache, name, []):
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_(torch.rand(t.shape, generator=gen) * 2 - 1)
    return runner


def _pools(runner):
    return [t.clone() for name in POOLS for t in getattr(runner.kv_cache, name, [])]


def _restore(runner, state):
    for t, s in zip([t for name in POOLS for t in getattr(runner.kv_cache, name, [])], state):
        t.copy_(s)


@pytest.mark.parametrize("ckpt,kv_cache", [("a8w8_ckpt", "bf16"), ("a8w8_ckpt", "tq"), ("moe_a8w8_ckpt", "bf16")])
def test_a_padded_verification_equals_the_eager_step_and_padding_writes_nothing(small_vocab, ckpt, kv_cache):
    """The dense and the TurboQuant cache, and Qwen3-MoE through the fused Triton MoE (the padding rows route to
    experts of their own and share their blocks with real rows)."""
    runner = _runner(small_vocab[ckpt], kv_cache)
    if ckpt.startswith("moe"):
        from backend_lib.kernels.triton.experts import PackedExperts

        assert any(isinstance(m, PackedExperts) for m in runner.model.modules())
    plan = _step()
    graphs = VerifyGraphs(runner, 4, 4, 2, capture=False)
    before = _pools(runner)
    with torch.inference_mode():
        ids, positions, meta, rows, seqs = runner.prepare(plan)
        eager = runner.model.logits(runner.forward(plan, ids, positions, meta)[rows])
        written = _pools(runner)
        _restore(runner, before)
        padded, padded_seqs, aux = graphs.run(plan)
    assert padded.shape == eager.shape == (6, runner.model.cfg.vocab_size) and torch.equal(padded, eager)
    assert padded_seqs == seqs and aux is None
    after = _pools(runner)
    assert any(not torch.equal(a, b) for a, b in zip(written, before))          # the real rows wrote their KV
    assert all(torch.equal(a, b) for a, b in zip(after, written))               # the padding nothing more


def test_the_engine_with_the_graphs_path_gives_the_ids_of_speculation_off(small_vocab):
    """Greedy, two requests batched (k = 2): every verification step through the padded buffers (capture off),
    decode steps through the decode graphs' buffers; ids equal to an engine without speculation. The drafts come
    from a proposer that knows the answer (the tiny demo's random weights rarely repeat within a few tokens) and
    is right, half right or silent by turns, so steps mix k drafts, an early rejection and plain decode rows."""
    opts = dict(dtype="bfloat16", kernels="triton", max_num_seqs=2, max_model_len=64)
    params = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    ckpt = small_vocab["a8w8_ckpt"]
    off = make_engine(ckpt, **opts)
    on = make_engine(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **opts)
    prompts = [on.tokenizer.encode(p) for p in ("a b a b a b", "1, 2, 3")]
    assert on.runner.model.cfg.vocab_size == VOCAB and max(max(p) for p in prompts) < VOCAB

    def ids(engine):
        return [r["output_ids"] for r in engine.generate(prompts, engine.make_params(params))]
    expected = ids(off)
    on.spec.proposer = KnowingProposer({tuple(p): e for p, e in zip(prompts, expected)})
    runner = on.runner
    runner.graphs = DecodeGraphs(runner, 2, 4, capture=False)
    runner.verify_graphs = VerifyGraphs(runner, 2, 4, 2, capture=False)
    replays = []
    run = runner.verify_graphs.run
    runner.verify_graphs.run = lambda plan: replays.append(sorted(n for _, n in plan)) or run(plan)
    assert ids(on) == expected and all(len(i) == 5 for i in expected)
    assert replays and on.stats.spec_num_accepted_tokens >= 2, "no verification step ran through the graphs"
    assert [1, 3] in replays or [1, 2] in replays, replays      # a plain decode row beside a verification
    assert on.stats.spec_num_accepted_tokens < on.stats.spec_num_draft_tokens     # and some drafts were rejected


# ----- [spec] EAGLE-3: the graphs capture forward_aux's aux states too ------------------------------------------
def _aux_layers(runner):
    return (0, 1, len(runner.model.layers))     # the embeddings, a middle layer's input, the last layer's output


def test_a_padded_eagle3_verification_gives_the_eager_aux_bit_for_bit(small_vocab):
    """With the runner's aux layers set (an EAGLE-3 engine) a verification bucket and a decode bucket give the
    eager forward_aux's logits and aux rows (torch.equal), copied out of the static buffer: a later step's replay
    leaves them as they were."""
    runner = _runner(small_vocab["a8w8_ckpt"], "bf16")
    runner.aux_layers = _aux_layers(runner)
    plan = _step()
    graphs = VerifyGraphs(runner, 4, 4, 2, capture=False)
    before = _pools(runner)
    with torch.inference_mode():
        ids, positions, meta, rows, seqs = runner.prepare(plan)
        hidden, states = runner.forward(plan, ids, positions, meta, aux=True)
        eager = runner.model.logits(hidden[rows])
        _restore(runner, before)
        padded, padded_seqs, aux = graphs.run(plan)
        width = len(runner.aux_layers) * runner.model.cfg.hidden_size
        assert aux.shape == states.shape == (6, width) and torch.equal(aux, states)
        assert torch.equal(padded, eager) and padded_seqs == seqs
        assert aux.untyped_storage().data_ptr() != graphs.aux_buf.untyped_storage().data_ptr()
        kept = aux.clone()
        # another step (one sequence, bucket 1) through the same static buffer: the first step's rows stay
        _restore(runner, before)
        other = [VerifyingSeq(range(40, 47), [3, 4], [2]).plan()]
        ids2, positions2, meta2, _, _ = runner.prepare(other)
        _, states2 = runner.forward(other, ids2, positions2, meta2, aux=True)
        _restore(runner, before)
        _, _, aux2 = graphs.run(other)
        assert torch.equal(aux2, states2) and torch.equal(aux, kept)
        # a decode bucket (3 rows in bucket 4)
        _restore(runner, before)
        decode = DecodeGraphs(runner, 4, 4, capture=False)
        d_ids = torch.tensor([11, 22, 33])
        tables = torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32)
        cached = torch.tensor([5, 17, 2], dtype=torch.int32)
        from backend_lib.kv_cache.metadata import AttentionMetadata
        d_meta, d_pos = AttentionMetadata.for_decode(tables, cached, runner.page_size)
        d_hidden, d_states = runner.model.forward_aux(d_ids, d_pos, runner.kv_cache, d_meta, runner.aux_layers)
        _restore(runner, before)
        d_logits, d_aux = decode.run(d_ids, tables, cached)
    assert torch.equal(d_aux, d_states) and torch.equal(d_logits, runner.model.logits(d_hidden))


def _eagle3_engines(ckpt, head, graphs_k, k=2, max_num_seqs=2):
    """An engine without speculation and one with the EAGLE-3 head through the graphs' padded buffers (capture
    off), its verification graphs holding graphs_k drafts a sequence; every graph step and every eager forward
    of the second recorded."""
    opts = dict(dtype="bfloat16", kernels="triton", max_num_seqs=max_num_seqs, max_model_len=64)
    off = make_engine(ckpt, **opts)
    on = make_engine(ckpt, speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                                               "min_acceptance": 0.0}, **opts)
    runner = on.runner
    assert runner.aux_layers is not None and runner.verify_graphs is None     # the CPU: eager
    runner.graphs = DecodeGraphs(runner, max_num_seqs, 4, capture=False)
    runner.verify_graphs = VerifyGraphs(runner, max_num_seqs, 4, graphs_k, capture=False)
    log = {"verify": [], "decode": 0, "eager": []}
    vrun, drun, fwd = runner.verify_graphs.run, runner.graphs.run, runner.forward

    def verify(plan):
        out = vrun(plan)
        assert out[2] is not None and out[2].shape[0] == out[0].shape[0]     # the aux of every real row
        log["verify"].append(sorted(len(seq.spec_tokens) for seq, _ in plan))
        return out

    def decode(*a):
        out = drun(*a)
        assert out[1] is not None
        log["decode"] += 1
        return out

    def eager(plan, *a, **kw):
        log["eager"].append([(seq.num_pending, len(seq.spec_tokens)) for seq, _ in plan])
        return fwd(plan, *a, **kw)
    runner.verify_graphs.run, runner.graphs.run, runner.forward = verify, decode, eager
    return off, on, log


@pytest.fixture(scope="module")
def copy_head(tmp_path_factory, small_vocab):
    from backend_lib.tools.make_eagle3_head import build

    return build(small_vocab["a8w8_ckpt"], tmp_path_factory.mktemp("eagle3") / "copy", copy=True)


EAGLE_PROMPTS = ("a b a b a b a b", "1, 2, 1, 2, 1, 2")


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.3, "top_k": 50, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_an_eagle3_engine_through_the_graphs_gives_the_ids_of_speculation_off(small_vocab, copy_head, params):
    """Alone and batched: the ids of an engine without speculation; every step past the prompts' prefill replays
    a graph (verification with the head's drafts, or decode), with the aux rows the head reads."""
    from spec_helpers import spec_ids

    params = {**params, "max_tokens": 6, "ignore_eos": True}
    off, on, log = _eagle3_engines(small_vocab["a8w8_ckpt"], copy_head, graphs_k=2)
    prompts = [on.tokenizer.encode(p) for p in EAGLE_PROMPTS]
    assert max(max(p) for p in prompts) < VOCAB
    for batch in ([prompts[0]], prompts):
        assert spec_ids(on, batch, params) == spec_ids(off, batch, params)
    # eager: only steps with a prefill chunk (batched: one prompt's prefill beside the other's decode row)
    assert all(any(n > 1 for n, _ in step) for step in log["eager"]), log["eager"]
    assert len(log["verify"]) >= 4 and log["decode"] + len(log["verify"]) >= 2 * 5, log
    # (the tiny random target does not loop within 6 tokens of a 3,000-token vocabulary: the copy head's drafts
    # are rejected here, so these steps prove the verification's rejections and the head's aux feed)
    assert on.stats.spec_num_draft_tokens > 0


def test_an_eagle3_step_with_more_drafts_than_the_graphs_hold_runs_eagerly(small_vocab, copy_head):
    """The verification graphs hold 1 draft a sequence, the head drafts 2: those steps run eagerly (their aux
    through forward_aux), the others replay; the ids are still speculation off's."""
    from spec_helpers import spec_ids

    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    off, on, log = _eagle3_engines(small_vocab["a8w8_ckpt"], copy_head, graphs_k=1)
    prompts = [on.tokenizer.encode(p) for p in EAGLE_PROMPTS]
    assert spec_ids(on, prompts, params) == spec_ids(off, prompts, params)
    assert any(k == 2 for step in log["eager"] for n, k in step if n == 1), log["eager"]   # eager verifications
    assert all(max(step) <= 1 for step in log["verify"]) and (log["verify"] or log["decode"]), log
