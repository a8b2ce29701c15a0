"""The C++ layer loop (models/qwen3_layer_loop.py, csrc/decode_layers.cpp) against the Python layer loop it replaces:
the same hidden states, logits and KV-cache contents bit for bit at every step of a generation, whatever the batch,
and the same greedy ids; the Python loop wherever the C++ one does not apply."""
from __future__ import annotations

import pytest
import torch

from helpers import make_engine

pytestmark = pytest.mark.skipif(not __import__("backend_lib.kernels.cpu", fromlist=["load"]).load(),
                                reason="the compiled CPU kernels could not be built")


def _prompts(eng, n):
    """n prompts of mixed lengths (1 to ~50 tokens: within one page, across pages)."""
    words = "the quick brown fox jumps over the lazy dog 敏捷的棕色狐狸跳过了懒狗 and then some more".split()
    return [eng.tokenizer.encode(" ".join(words[: 1 + (7 * i) % len(words)]) * (1 + i % 3))[: 1 + (13 * i) % 50]
            for i in range(n)]


def _greedy(eng, n=12):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True})


# csrc/decode_layers.cpp's one-region step shapes: every sequence 1 to MAX_SEQ_ROWS query rows (kMaxSeqRows: a
# verification of up to 16 drafts), at most MAX_ROWS rows in all (kMaxFusedRows)
MAX_SEQ_ROWS, MAX_ROWS = 17, 64


def _region_shape(rows) -> bool:
    return max(rows) <= MAX_SEQ_ROWS and sum(rows) <= MAX_ROWS


class Twin:
    """Runs every forward twice, the Python loop on a copy of the KV cache and then the C++ loop on the cache
    itself, and checks the hidden states, logits and caches are the same bits. Counts the steps (decode_steps:
    one row per sequence; region_steps: the shapes the one region takes; multi_row_region_steps: those of them
    where a sequence with tokens already cached has several rows: a verification)."""

    def __init__(self, eng):
        self.model, self.kv = eng.runner.model, eng.runner.kv_cache
        self.forward = self.model.forward
        self.steps, self.decode_steps, self.batches = 0, 0, set()
        self.region_steps, self.multi_row_region_steps = 0, 0
        self.model.forward = self

    def __call__(self, input_ids, positions, kv_cache, meta):
        m = self.model
        assert m.layer_loop.applies(kv_cache)
        saved_k, saved_v = [t.clone() for t in kv_cache.k], [t.clone() for t in kv_cache.v]
        m.use_layer_loop = False
        try:
            ref = self.forward(input_ids, positions, kv_cache, meta)
        finally:
            m.use_layer_loop = True
        ref_k, ref_v = [t.clone() for t in kv_cache.k], [t.clone() for t in kv_cache.v]
        for t, s in zip(kv_cache.k + kv_cache.v, saved_k + saved_v):
            t.copy_(s)
        out = self.forward(input_ids, positions, kv_cache, meta)
        assert out.dtype == ref.dtype and torch.equal(out, ref)
        assert torch.equal(m.logits(out), m.logits(ref))
        assert all(torch.equal(a, b) for a, b in zip(kv_cache.k + kv_cache.v, ref_k + ref_v))
        b = meta.query_start_loc.numel() - 1
        self.steps += 1
        rows = meta.query_start_loc.diff().tolist()
        if _region_shape(rows):
            self.region_steps += 1
            cached = (meta.seq_lens - meta.query_start_loc.diff()).tolist()
            self.multi_row_region_steps += any(r > 1 and c > 0 for r, c in zip(rows, cached))
        if input_ids.numel() == b:
            self.decode_steps += 1
            self.batches.add(b)
        return out


def _generate_profiled(eng, batch, threads, setup=lambda: None):
    """Greedy generation of `batch` prompts on `threads` threads with the region's profile on and every step
    compared with the Python loop (Twin); checks every step of the region's shapes, and nothing else, ran in the
    region. Returns the twin, the profile and what setup() returned (called once the twin is in place)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.qwen3_cpu.decode_layers_profile(True)
        twin = Twin(eng)
        extra = setup()
        eng.generate(_prompts(eng, batch), _greedy(eng))
        prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
    finally:
        torch.set_num_threads(old)
    assert twin.decode_steps >= 11 and batch in twin.batches
    assert prof[0, -1].item() == twin.region_steps >= twin.decode_steps
    return twin, prof, extra

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 2, 5, 16])
def test_every_step_is_bit_identical_to_the_python_loop(a8w8_ckpt, dtype, batch):
    eng = make_engine(a8w8_ckpt, dtype=dtype, max_num_seqs=16, kv_cache_memory="4MiB", max_model_len=256)
    twin = Twin(eng)
    eng.generate(_prompts(eng, batch), _greedy(eng))
    assert twin.decode_steps >= 11 and batch in twin.batches


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_steps_run_in_one_region_with_the_same_bits_at_any_thread_count(a8w8_ckpt, batch, threads):
    """Decode steps take the one-parallel-region path (csrc/decode_layers.cpp, counted by decode_layers_profile):
    its rows, panels and attention items go to whichever thread takes them, with the same bits as the Python loop
    on one thread or three (more threads than this host's cores: threads descheduled mid-step), one row per
    thread's own buffers (batch 1) or rows split between them (batch 5)."""
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", max_num_seqs=16, kv_cache_memory="4MiB", max_model_len=256)
    twin, prof, _ = _generate_profiled(eng, batch, threads)
    assert prof.shape[0] == threads


def test_one_pack_a_kv_cache_whose_plan_follows_the_thread_count(a8w8_ckpt):
    """The op's tensors go over as one LayerPack, built at the first step of a KV cache and kept; the region's plan
    of the layers kept in it (pointers, GEMV chunks per thread) is rebuilt when the thread count changes: the same
    engine on three, one and two threads, every step with the Python loop's bits."""
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", max_num_seqs=16, kv_cache_memory="4MiB", max_model_len=256)
    loop = eng.runner.model.layer_loop
    twin, packs, old = Twin(eng), [], torch.get_num_threads()
    try:
        for threads in (3, 1, 2):
            torch.set_num_threads(threads)
            torch.ops.qwen3_cpu.decode_layers_profile(True)
            steps = twin.region_steps
            eng.generate(_prompts(eng, 2), _greedy(eng))
            prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
            assert prof.shape[0] == threads and prof[0, -1].item() == twin.region_steps - steps >= 11
            packs.append(loop.pack)
    finally:
        torch.set_num_threads(old)
    assert packs[0][0] is eng.runner.kv_cache and all(p[1] is packs[0][1] for p in packs)


def _assert_loop_ids_equal_the_python_loop(eng, prompts, steps: int, solo: int) -> None:
    """Greedy ids of `prompts` batched with the layer loop (checked to run every step) equal the Python loop's
    (checked not to run it), and the first `solo` prompts alone give their batched ids."""
    model = eng.runner.model
    loop, calls = model.layer_loop, []

    class Counting:
        applies = staticmethod(loop.applies)

        def __call__(self, *a):
            calls.append(1)
            return loop(*a)

    model.layer_loop = Counting()
    fast = [r["output_ids"] for r in eng.generate(prompts, _greedy(eng, steps))]
    assert len(calls) >= steps
    alone = [eng.generate([p], _greedy(eng, steps))[0]["output_ids"] for p in prompts[:solo]]
    model.use_layer_loop = False
    calls.clear()
    slow = [r["output_ids"] for r in eng.generate(prompts, _greedy(eng, steps))]
    assert not calls
    assert fast == slow
    assert alone == fast[:solo]


def test_greedy_ids_equal_the_python_loop_and_do_not_depend_on_the_batch(a8w8_ckpt):
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", max_num_seqs=16, kv_cache_memory="8MiB", max_model_len=256)
    _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 16), steps=24, solo=3)


def test_python_loop_where_the_layer_loop_does_not_apply(a8w8_ckpt, bf16_ckpt):
    tq = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache="tq", kv_cache_memory="4MiB", max_model_len=256)
    assert not tq.runner.model.layer_loop.applies(tq.runner.kv_cache)
    float_tq = make_engine(bf16_ckpt, dtype="bfloat16", kv_cache="tq", kv_cache_memory="4MiB", max_model_len=256)
    assert not float_tq.runner.model.layer_loop.applies(float_tq.runner.kv_cache)
    a8w8 = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256)
    assert a8w8.runner.model.layer_loop.applies(a8w8.runner.kv_cache)
    ref = make_engine(a8w8_ckpt, dtype="bfloat16", kernels="reference", kv_cache_memory="4MiB", max_model_len=256)
    assert not ref.runner.model.layer_loop.applies(ref.runner.kv_cache)


def test_the_region_profile_accounts_for_a_decode_step(a8w8_ckpt):
    """bench.step_profile --region: every timed step ran in the region, its phases and the Python-side kernels
    add up to no more than the step."""
    from bench.step_profile import region_round, region_table
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", max_num_seqs=1, kv_cache_memory="4MiB", max_model_len=256)
    r = region_round(eng, threads=2, context=16, steps=6, seed=1)
    assert r["steps_in_region"] == 6
    for label in ("GEMV qkv_proj", "GEMV o_proj", "GEMV gate_up_proj", "GEMV down_proj",
                  "attention items: paged attention"):
        assert r["ops"][label]["ms_per_step"] > 0 and (r["ops"][label]["gb_per_s"] or 1) > 0
    assert 0 < r["region_ms"] < r["step_ms"]
    # the floor counts the KV rows attention reads: bf16 keys and values of every layer, timed step i attending
    # over context + 2 + i positions (the prefill and one untimed decode step come first)
    mc = eng.model_config
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * (16 + 2 + (6 - 1) / 2)
    assert r["ops"]["attention items: paged attention"]["mb_per_step"] == pytest.approx(kv / 1e6)
    assert r["kv_mb_per_token"] == pytest.approx(kv / 1e6) and r["mb_per_token"] > r["kv_mb_per_token"]
    # the screened greedy head's one call (greedy_head: auto on the CPU set) counts its int8 screen and candidates
    screen = sum(t.numel() * t.element_size() for t in eng.runner.model.lm_head.screen.prepared)
    assert r["ops"]["GEMV lm_head: screen and candidate rows (greedy_head_picks)"]["mb_per_step"] * 1e6 > screen
    r["stream_read_gb_per_s"] = 10.0
    table = region_table([r])
    assert "GEMV lm_head" in table and "weights + KV cache" in table


# ----- Qwen3-MoE: sparse layers in the region ----------------------------------------------------------------

def _phase(name):
    from bench.step_profile import REGION_PHASES
    return REGION_PHASES.index(name)


def _routings(model, batch):
    """Records layer 0's expert sets of every decode row the Python loop routes (the Twin's reference pass):
    a list, one set of rows per decode step of `batch` rows."""
    moe = model.layers[0].mlp
    gate, seen = moe.gate.forward, []

    def forward(x, *a):
        logits = gate(x, *a)
        if x.shape[0] == batch:
            seen.append({tuple(sorted(r)) for r in torch.topk(logits, moe.top_k).indices.tolist()})
        return logits
    moe.gate.forward = forward
    return seen


def _moe_mixed(ckpts):
    """Dense and sparse layers mixed (mlp_only_layers: layer 1 dense; 0, 2, 3 sparse), unnormalized top-3 of 70
    experts: the router's two panels (64 + 6 outputs)."""
    return ckpts.get("tiny-moe-mixed-a8w8", "a8w8", "tiny-moe", num_hidden_layers=4, mlp_only_layers=[1],
                     norm_topk_prob=False, num_experts=70, num_experts_per_tok=3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_moe_decode_steps_run_in_one_region_with_the_python_loops_bits(moe_a8w8_ckpt, batch, threads):
    """Sparse layers inside the one region (router GEMV, routing, the experts' phases, the combine): the hidden
    states, logits and KV caches of every step bit-identical to the Python loop (which runs the native MoE op),
    batch 1 (no gather), 2 (rows per thread) and 5 (rows split, tokens sharing experts), 1 and 2 threads."""
    eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256)
    assert eng.runner.model.layer_loop.applies(eng.runner.kv_cache)
    twin, prof, seen = _generate_profiled(eng, batch, threads, lambda: _routings(eng.runner.model, batch))
    assert batch == 1 or max(len(rows) for rows in seen) > 1   # the rows of a step routed differently
    for ph in ("route", "expGateUp", "combine"):     # through its sparse-layer path
        assert prof[0, _phase(ph)].item() > 0
    assert prof[:, _phase("gateUp")].sum().item() == 0   # no dense MLP in this model


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_mixed_dense_and_sparse_layers_in_the_region(ckpts, dtype):
    ckpt = _moe_mixed(ckpts)
    eng = make_engine(ckpt, dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256)
    kinds = [type(layer.mlp).__name__ for layer in eng.runner.model.layers]
    assert kinds == ["Qwen3SparseMoe", "Qwen3MLP", "Qwen3SparseMoe", "Qwen3SparseMoe"]
    torch.ops.qwen3_cpu.decode_layers_profile(True)
    twin = Twin(eng)
    seen = _routings(eng.runner.model, 6)
    eng.generate(_prompts(eng, 6), _greedy(eng))
    prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
    assert twin.decode_steps >= 11 and 6 in twin.batches and max(len(rows) for rows in seen) > 1
    assert prof[0, -1].item() == twin.region_steps >= twin.decode_steps
    assert prof[0, _phase("route")].item() > 0 and prof[:, _phase("gateUp")].sum().item() > 0


def test_moe_greedy_ids_equal_the_python_loop_and_do_not_depend_on_the_batch(ckpts):
    """Through the engine: the same greedy ids with the layer loop on and off, and batched as alone."""
    eng = make_engine(_moe_mixed(ckpts), dtype="bfloat16", max_num_seqs=8, kv_cache_memory="8MiB",
                      max_model_len=256)
    _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 8), steps=16, solo=2)


def test_python_loop_where_act_order_projections_keep_their_own_perms(ckpts):
    """GPTQ desc_act projections with their own perms on one input (q, k, v not sharing theirs: a ConcatLinear of
    W4A16Linears, layers/linear.py) keep the Python loop; shared perms (one W4A16Linear) take the region."""
    own = ckpts.get("tiny-gptq-g32-descact-own-perms", "gptq", group_size=32, desc_act=True, shared_perm=False)
    eng = make_engine(own, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256)
    assert type(eng.runner.model.layers[0].self_attn.qkv_proj).__name__ == "ConcatLinear"
    assert not eng.runner.model.layer_loop.applies(eng.runner.kv_cache)
    shared = make_engine(_w4a16(ckpts, "descact"), dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256)
    assert shared.runner.model.layer_loop.applies(shared.runner.kv_cache)


def test_the_region_profile_accounts_for_a_moe_decode_step(moe_a8w8_ckpt):
    """bench.step_profile --region on a Qwen3-MoE model: the sparse layers' phases, the routed experts' bytes."""
    from bench.step_profile import region_round, region_table
    eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", max_num_seqs=1, kv_cache_memory="4MiB", max_model_len=256)
    r = region_round(eng, threads=2, context=16, steps=6, seed=1)
    assert r["steps_in_region"] == 6
    for label in ("GEMV qkv_proj", "MoE router GEMV", "MoE experts gate_up (the routed experts)",
                  "MoE experts down (the routed experts)"):
        assert r["ops"][label]["ms_per_step"] > 0 and r["ops"][label]["gb_per_s"] > 0
    assert r["ops"]["MoE routing: softmax, top-k, the plan (one thread; csrc/route.cpp)"]["ms_per_step"] > 0
    assert "GEMV gate_up_proj" not in r["ops"]   # no dense MLP layer
    assert 0 < r["region_ms"] < r["step_ms"]
    r["stream_read_gb_per_s"] = 10.0
    assert "MoE router GEMV" in region_table([r])


def test_the_region_profile_of_a_batch_times_its_phases_without_a_floor(moe_a8w8_ckpt):
    """bench.step_profile --region --batch N: N sequences decode together in the region; time per phase, no byte
    counts (they are one sequence's) and no floor line."""
    from bench.step_profile import region_round, region_table
    eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", max_num_seqs=3, kv_cache_memory="4MiB", max_model_len=256)
    r = region_round(eng, threads=2, context=16, steps=4, seed=1, batch=3)
    assert r["batch"] == 3 and r["steps_in_region"] == 4
    assert r["ops"]["MoE experts gate_up (the routed experts)"]["ms_per_step"] > 0
    assert all(o["gb_per_s"] is None and o["mb_per_step"] == 0 for o in r["ops"].values())
    r["stream_read_gb_per_s"] = 10.0
    table = region_table([r])
    assert "3 sequences a step" in table and "floor" not in table
    assert not eng.has_unfinished()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_regions_routing_is_layers_moe_route_bit_for_bit(dtype):
    """csrc/route.cpp's routing (route_rows: ATen's softmax written with its at::vec functions, ATen's CPU top-k
    written out, the sum in ATen's order, no ATen op, where it applies; else at::softmax and ATen's sum) against
    layers/moe.py's route(): the same ids and weights, random rows, wide and narrow logits, equal router rows (ties),
    all-equal rows, rows of integers (ties everywhere), NaN rows, every k, both of topk's algorithms (k * 64 <= E:
    partial_sort). A native build runs route_rows (the capability ATen runs here)
    for k in 1..4 and 8 (the renormalizing sums it writes in ATen's order), and without renormalization for any k."""
    from backend_lib.kernels.cpu.build import cpu_isa
    from backend_lib.layers.moe import route

    cap = torch.backends.cpu.get_cpu_capability()
    for k in (1, 2, 3, 4, 5, 6, 8, 16):
        for norm in (True, False):
            path = torch.ops.qwen3_cpu.moe_route_path(k, norm)
            assert path in ("", cap)
            if cpu_isa() == "native" and cap in ("AVX512", "AVX2"):
                assert (path == cap) == (k in (1, 2, 3, 4, 8) or not norm)
    g = torch.Generator().manual_seed(0)
    for e, ks in ((8, (1, 2, 8)), (70, (3, 4, 6)), (128, (1, 2, 6, 8, 16)), (512, (1, 8))):
        logits = torch.randn(2000, e, generator=g) * torch.tensor([0.01, 1.0, 4.0, 40.0]).repeat(500)[:, None]
        tied = logits[:40].clone()
        tied[:10, 1] = tied[:10, 0]                   # two experts tie
        tied[10:20] = 0.25                            # every expert ties
        tied[20:30, 3] = tied[20:30].max(1).values    # the top one ties
        nan = logits[:4].clone()
        nan[:2, 2] = float("nan")
        many = logits[:300].round()                  # ties everywhere (as bf16 router logits have them)
        for x in (logits, tied, torch.cat([logits[:100], tied[15:16]]), nan, many):   # a step's rows routed together
            x = x.to(dtype)
            for k in ks:
                for norm in (True, False):
                    ids, w = torch.ops.qwen3_cpu.moe_route(x, k, norm)
                    ref_ids, ref_w = route(x, k, norm)
                    assert torch.equal(ids, ref_ids) and w.dtype == dtype
                    assert torch.equal(w.isnan(), ref_w.isnan()) and torch.equal(w.nan_to_num(), ref_w.nan_to_num())


# ----- W4A16 (int4 weights, float activations): dense and Qwen3-MoE models in the region ------------------------

def _w4a16(ckpts, which):
    """sym: compressed-tensors pack-quantized, symmetric, group 32 (every weight's batch-1 table lookup exact);
    asym: group 64 with zero points (no table lookup); moe: tiny Qwen3-MoE, W4A16 attention and experts;
    descact: GPTQ act-order (a perm per linear: q/k/v and gate/up share theirs), group 32 with zero points (no
    table lookup);
    moe-descact: tiny Qwen3-MoE in GPTQ act-order, symmetric group 16 (the table lookup), every expert's gate_up
    and down with a perm of its own."""
    if which == "sym":
        return ckpts.get("tiny-w4a16", "w4a16")
    if which == "asym":
        return ckpts.get("tiny-ct-g64-asym", "w4a16", group_size=64, symmetric=False)
    if which == "descact":
        return ckpts.get("tiny-gptq-g32-asym-descact", "gptq", group_size=32, symmetric=False, desc_act=True)
    if which == "moe-descact":
        return ckpts.get("tiny-moe-gptq-descact", "gptq", "tiny-moe", group_size=16, desc_act=True)
    return ckpts.get("tiny-moe-w4a16", "w4a16", "tiny-moe")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("which,dtype", [("sym", "bfloat16"), ("sym", "float32"), ("asym", "bfloat16"),
                                         ("moe", "bfloat16")])
def test_w4a16_decode_steps_run_in_one_region_with_the_python_loops_bits(ckpts, which, dtype, batch, threads):
    """W4A16 linears (and W4A16 experts) in the one region: the hidden states, logits and KV caches of every step
    bit-identical to the Python loop (w4a16_linear, the native MoE op), batch 1 (the table lookup where the
    weight and the row are exact: fp32 rows mostly are not), 2 and 5, 1 and 2 threads."""
    if which == "asym" and (batch, threads) != (1, 2) or dtype == "float32" and batch == 2:
        pytest.skip("covered by the other cases")
    eng = make_engine(_w4a16(ckpts, which), dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256)
    model = eng.runner.model
    lins = [lin for layer in model.layers for lin in model.layer_loop._linears(layer)]
    assert lins and all(type(lin).__name__ == "W4A16Linear" for lin in lins)
    assert all((lin.prepared[5] >= 0) == (which != "asym") for lin in lins)   # the lookup's weights (or none)
    assert model.layer_loop.applies(eng.runner.kv_cache)
    twin, prof, _ = _generate_profiled(eng, batch, threads)
    assert prof[:, _phase("qkv")].sum().item() > 0
    if which == "moe":
        assert prof[:, _phase("expGateUp")].sum().item() > 0 and prof[:, _phase("gateUp")].sum().item() == 0
    else:
        assert prof[:, _phase("gateUp")].sum().item() > 0


def _expert_perms(mlp):
    """Per expert of a sparse layer: its gate_up and down act-order perms (the prepared W4A16Linears')."""
    return [(gu.prepared[3], dn.prepared[3]) for gu, dn in mlp.expert_pairs]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("which,dtype", [("descact", "bfloat16"), ("descact", "float32"),
                                         ("moe-descact", "bfloat16"), ("moe-descact", "float32")])
def test_act_order_w4a16_decode_steps_run_in_one_region_with_the_python_loops_bits(ckpts, monkeypatch, which, dtype,
                                                                                   batch, threads):
    """GPTQ act-order (desc_act) W4A16 linears and experts in the one region: each row gathered by its linear's perm
    (dense) or by its routed expert's gate_up and down perms (experts) before the panels, as w4a16_linear gathers
    it; the hidden states, logits and KV caches of every step bit-identical to the Python loop, batch 1, 2 and 5,
    1 and 2 threads. The Python loop's experts here are the composed slot (each expert's own W4A16Linear, its
    w4a16_linear with its perm), not the native op whose pieces the region shares."""
    if dtype == "float32" and (batch, threads) != (5, 2):
        pytest.skip("covered by the other cases")
    eng = make_engine(_w4a16(ckpts, which), dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256)
    model = eng.runner.model
    lins = [lin for layer in model.layers for lin in model.layer_loop._linears(layer)]
    assert lins and all(type(lin).__name__ == "W4A16Linear" for lin in lins)
    for lin in lins:   # every linear permuted (several groups per input), and not by the identity
        perm = lin.prepared[3]
        assert perm.numel() == lin.in_features and not torch.equal(perm, torch.arange(lin.in_features))
    assert all((lin.prepared[5] >= 0) == (which == "moe-descact") for lin in lins)   # the lookup's weights (or none)
    if which == "moe-descact":
        from backend_lib.kernels.cpu.moe import table_of
        mlp = model.layers[0].mlp
        perms = _expert_perms(mlp)
        assert all(gu.numel() and dn.numel() for gu, dn in perms)
        assert not torch.equal(perms[0][0], perms[1][0]) and not torch.equal(perms[0][1], perms[1][1])
        table = table_of(mlp.moe_weights)
        assert table.table.shape[1] == 8 and bool((table.table[:, [3, 7]] != 0).all())   # the perms' pointers
        assert model.layer_loop.applies(eng.runner.kv_cache)   # (the region's table, read now)
        # the Python loop's moe slot without a table: kernels/moe.py's composed slot
        monkeypatch.setattr("backend_lib.kernels.cpu.moe.table_of", lambda experts: None)
    assert model.layer_loop.applies(eng.runner.kv_cache)
    twin, prof, _ = _generate_profiled(eng, batch, threads)
    assert prof[:, _phase("qkv")].sum().item() > 0
    if which == "moe-descact":
        assert prof[:, _phase("expGateUp")].sum().item() > 0 and prof[:, _phase("gateUp")].sum().item() == 0
    else:
        assert prof[:, _phase("gateUp")].sum().item() > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4a8_experts_decode_steps_run_in_one_region_with_the_python_loops_bits(ckpts, dtype, batch, threads):
    """`moe_experts_quant: int4a8` (W4A8Linear experts: the W4A16 checkpoint's codes on int8 activations) in the
    one region: each token row quantized once as moe::prepare does for the native op, the experts' panels
    w4a8_linear's; every step's hidden states, logits and KV caches bit-identical to the Python loop (the native
    MoE op), batch 1 and 5, 1 and 2 threads; and greedy ids with the loop on and off, batched and alone."""
    if dtype == "float32" and (batch, threads) != (5, 2):
        pytest.skip("covered by the other cases")
    eng = make_engine(_w4a16(ckpts, "moe"), dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256,
                      moe_experts_quant="int4a8")
    from backend_lib.kernels.cpu.moe import W4A8, table_of

    mlp = eng.runner.model.layers[0].mlp
    assert table_of(mlp.moe_weights).dims[0] == W4A8
    twin, prof, _ = _generate_profiled(eng, batch, threads)
    assert prof[:, _phase("expGateUp")].sum().item() > 0 and prof[:, _phase("expDown")].sum().item() > 0
    if (batch, threads) == (5, 2):   # through the engine (a fresh one: the twin stays on this one's forward)
        eng = make_engine(_w4a16(ckpts, "moe"), dtype=dtype, max_num_seqs=8, kv_cache_memory="8MiB",
                          max_model_len=256, moe_experts_quant="int4a8")
        _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 8), steps=16, solo=2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("which,dtype", [("sym", "bfloat16"), ("sym", "float32"), ("moe", "bfloat16")])
def test_int8_activation_linears_decode_steps_run_in_one_region_with_the_python_loops_bits(ckpts, which, dtype,
                                                                                          batch, threads):
    """`int4_activations: int8` (the W4A16 checkpoint's attention projections and dense MLPs as W4A8Linear: its
    codes on int8 activations; on the MoE with `moe_experts_quant: int4a8` too) in the one region: each input row
    prepared as w4a8_linear prepares it, the panels w4a8_linear's; every step's hidden states, logits and KV caches
    bit-identical to the Python loop, batch 1 and 5, 1 and 2 threads; and greedy ids with the loop on and off,
    batched and alone."""
    if dtype == "float32" and (batch, threads) != (5, 2):
        pytest.skip("covered by the other cases")
    extra = {"moe_experts_quant": "int4a8"} if which == "moe" else {}
    eng = make_engine(_w4a16(ckpts, which), dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256,
                      int4_activations="int8", **extra)
    model = eng.runner.model
    lins = [lin for layer in model.layers for lin in model.layer_loop._linears(layer)]
    assert lins and all(type(lin).__name__ == "W4A8Linear" for lin in lins)
    assert model.layer_loop.applies(eng.runner.kv_cache)
    twin, prof, _ = _generate_profiled(eng, batch, threads)
    assert prof[:, _phase("qkv")].sum().item() > 0 and prof[:, _phase("o")].sum().item() > 0
    if which == "moe":
        assert prof[:, _phase("expGateUp")].sum().item() > 0
    else:
        assert prof[:, _phase("gateUp")].sum().item() > 0 and prof[:, _phase("down")].sum().item() > 0
    if (batch, threads) == (5, 2):   # through the engine (a fresh one: the twin stays on this one's forward)
        eng = make_engine(_w4a16(ckpts, which), dtype=dtype, max_num_seqs=8, kv_cache_memory="8MiB",
                          max_model_len=256, int4_activations="int8", **extra)
        _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 8), steps=16, solo=2)


@pytest.mark.parametrize("which", ["sym", "moe", "descact", "moe-descact"])
def test_w4a16_greedy_ids_equal_the_python_loop_and_do_not_depend_on_the_batch(ckpts, which):
    """Through the engine: the same greedy ids with the layer loop on and off, and batched as alone."""
    eng = make_engine(_w4a16(ckpts, which), dtype="bfloat16", max_num_seqs=8, kv_cache_memory="8MiB",
                      max_model_len=256)
    _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 8), steps=16, solo=2)


# ----- a few rows per sequence: speculative verification steps in the region ----------------------------------

def _few_rows_step(eng, rows, cached, seed=0):
    """A hand-built step: sequence i has cached[i] tokens in the cache (random K/V) and rows[i] new rows (a
    verification: its last accepted token and rows[i] - 1 drafts; a decode row when 1), its pages scattered
    through the pool (page i * 7 + j modulo the pool, no page shared). (input_ids, positions, meta)."""
    from backend_lib.kv_cache.metadata import AttentionMetadata

    kv = eng.runner.kv_cache
    S, P = kv.page_size, kv.num_pages
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    need = [-(-(c + r) // S) for c, r in zip(cached, rows)]
    order = torch.randperm(P, generator=g).tolist()
    assert sum(need) <= P
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n] + [0] * (max(need) - n))
        at += n
    positions = [c + j for c, r in zip(cached, rows) for j in range(r)]
    seq_of = [i for i, r in enumerate(rows) for _ in range(r)]
    slots = [tables[i][p // S] * S + p % S for i, p in zip(seq_of, positions)]
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + r)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64),
                             block_tables=torch.tensor(tables, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor([c + r for c, r in zip(cached, rows)], dtype=torch.int32))
    ids = torch.randint(0, eng.runner.model.cfg.vocab_size, (sum(rows),), generator=g)
    return ids, torch.tensor(positions, dtype=torch.int64), meta


def _region_step_equals_the_python_loop(eng, rows, cached, threads, seed=0) -> int:
    """The C++ loop on the hand-built step against the Python loop on a copy of the cache: hidden states, logits
    and every layer's K/V cache torch.equal. Returns how many steps ran in the one region (0 or 1)."""
    model, kv = eng.runner.model, eng.runner.kv_cache
    assert model.layer_loop.applies(kv)
    ids, pos, meta = _few_rows_step(eng, rows, cached, seed)
    saved = [t.clone() for t in kv.k + kv.v]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.use_layer_loop = False
        try:
            ref = model.forward(ids, pos, kv, meta)
        finally:
            model.use_layer_loop = True
        ref_kv = [t.clone() for t in kv.k + kv.v]
        for t, s in zip(kv.k + kv.v, saved):
            t.copy_(s)
        torch.ops.qwen3_cpu.decode_layers_profile(True)
        out = model.forward(ids, pos, kv, meta)
        prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
    finally:
        torch.set_num_threads(old)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert torch.equal(model.logits(out), model.logits(ref))
    assert all(torch.equal(a, b) for a, b in zip(kv.k + kv.v, ref_kv))
    assert not any(torch.equal(a, b) for a, b in zip(kv.k + kv.v, saved))   # the step wrote K/V in every layer
    return int(prof[0, -1].item())


# (rows per sequence, tokens cached per sequence): page size 16 in these engines
FEW_ROWS = [
    ([1, 5, 1, 5], [9, 14, 30, 3]),          # query_start_loc 0, 1, 6, 7, 12: seq 1's rows 14..18 cross a page
    ([5], [40]),                              # one verification alone (rows split between threads)
    ([2], [15]),                              # two rows: every thread computes them (kRedundantRows), across a page
    ([5, 5, 5, 5, 5, 5], [0, 11, 16, 27, 44, 60]),   # six verifying sequences, one with nothing cached yet
    ([17, 1, 3], [20, 7, 31]),                # 17 rows: two attention items of that sequence (16 + 1 positions)
    ([4] * 16, [3 * i for i in range(16)]),   # 64 rows, the region's most
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verification_steps_run_in_one_region_with_the_python_loops_bits(a8w8_ckpt, dtype, threads):
    """Steps where a sequence has a few query rows (a speculative verification's k + 1, mixed with decode rows,
    different context lengths, rows across a page boundary) in the one region: bit-identical to the Python loop."""
    eng = make_engine(a8w8_ckpt, dtype=dtype, max_num_seqs=16, kv_cache_memory="4MiB", max_model_len=256)
    for i, (rows, cached) in enumerate(FEW_ROWS):
        assert _region_step_equals_the_python_loop(eng, rows, cached, threads, seed=i) == 1, rows


@pytest.mark.parametrize("threads", [1, 2])
def test_moe_verification_steps_run_in_one_region_with_the_python_loops_bits(moe_a8w8_ckpt, threads):
    eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", max_num_seqs=16, kv_cache_memory="4MiB", max_model_len=256)
    for i, (rows, cached) in enumerate(FEW_ROWS):
        assert _region_step_equals_the_python_loop(eng, rows, cached, threads, seed=i) == 1, rows


def test_steps_with_a_longer_sequence_keep_the_ops_path(a8w8_ckpt):
    """A sequence of more than 17 rows (a prefill chunk), or more than 64 rows in all: the op-by-op path, the
    same bits."""
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", max_num_seqs=32, kv_cache_memory="4MiB", max_model_len=256)
    for rows, cached in (([18], [5]), ([1, 18, 2], [4, 0, 9]), ([1] * 65, [2] * 65), ([5] * 13, [1] * 13)):
        assert _region_step_equals_the_python_loop(eng, rows, cached, threads=2) == 0, rows


def test_ngram_speculation_runs_its_verifications_in_the_region(a8w8_ckpt):
    """Through the engine: n-gram speculation on the A8W8 model, every step bit-identical to the Python loop
    (Twin), the verification steps in the one region, and the greedy ids those of speculation off."""
    import json

    from spec_helpers import GREEDY, PROMPTS, compare_spec

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "auto_disable_from_batch": None}   # gate off: drafts counted here (test_spec_gate.py)
    off = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256)
    on = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256,
                     speculative_config=json.dumps(spec))
    prompts = [off.tokenizer.encode(p) for p in PROMPTS]
    torch.ops.qwen3_cpu.decode_layers_profile(True)
    twins = Twin(off), Twin(on)
    compare_spec(off, on, prompts, GREEDY, min_accepted=4)
    prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
    assert twins[1].multi_row_region_steps >= 3   # steps with a verifying sequence's rows
    assert prof[0, -1].item() == twins[0].region_steps + twins[1].region_steps


# ----- [spec] EAGLE-3: the region writes the target's aux hidden states -----------------------------------------

def _forward_aux_both(model, kv, ids, pos, meta, aux_layers):
    """forward_aux through the Python loop (the reference) on a copy of the cache, then through the C++ loop on
    the cache itself: hidden states, aux states and every layer's K/V torch.equal. Returns the C++ loop's
    (hidden, aux)."""
    saved = [t.clone() for t in kv.k + kv.v]
    model.use_layer_loop = False
    try:
        ref, ref_aux = model.forward_aux(ids, pos, kv, meta, aux_layers)
    finally:
        model.use_layer_loop = True
    ref_kv = [t.clone() for t in kv.k + kv.v]
    for t, s in zip(kv.k + kv.v, saved):
        t.copy_(s)
    out, aux = model.forward_aux(ids, pos, kv, meta, aux_layers)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert aux.shape == (ids.numel(), len(aux_layers) * model.cfg.hidden_size) and aux.dtype == ref_aux.dtype
    assert torch.equal(aux, ref_aux)
    assert all(torch.equal(a, b) for a, b in zip(kv.k + kv.v, ref_kv))
    return out, aux


# the steps of FEW_ROWS (the region) and two the region refuses (a prefill chunk of 18 rows; 65 rows in all)
AUX_STEPS = FEW_ROWS + [([18], [5]), ([1] * 65, [2] * 65)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("which,dtype", [("dense", "bfloat16"), ("dense", "float32"), ("moe", "bfloat16")])
def test_region_writes_eagle3_aux_states_with_forward_aux_bits(a8w8_ckpt, ckpts, which, dtype, threads):
    """Qwen3ForCausalLM.forward_aux through the C++ loop (the op writes the residual stream entering each aux
    layer: 0 the embeddings, L the last layer's output before the final norm) against its Python loop: the same
    hidden, aux and K/V bits, in the region (one row per thread's own buffers, rows split) and op by op, aux ids
    in any order; dense (2 layers) and mixed dense / sparse (4 layers) A8W8 models."""
    ckpt = a8w8_ckpt if which == "dense" else _moe_mixed(ckpts)
    eng = make_engine(ckpt, dtype=dtype, max_num_seqs=16, kv_cache_memory="8MiB", max_model_len=256)
    model, kv = eng.runner.model, eng.runner.kv_cache
    assert model.layer_loop.applies(kv)
    L = len(model.layers)
    orders = [tuple(range(L + 1))[:3], (L, 0, L // 2), (L - 1,)]
    if which == "moe":
        orders.append((0, 1, 2, 3, 4))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (rows, cached) in enumerate(AUX_STEPS):
            for aux_layers in orders:
                ids, pos, meta = _few_rows_step(eng, rows, cached, seed=i)
                torch.ops.qwen3_cpu.decode_layers_profile(True)
                _, aux = _forward_aux_both(model, kv, ids, pos, meta, aux_layers)
                in_region = torch.ops.qwen3_cpu.decode_layers_profile(False)[0, -1].item()
                assert in_region == _region_shape(rows), rows
                hid = model.cfg.hidden_size
                if 0 in aux_layers:   # slot of layer 0: the embeddings themselves
                    j = aux_layers.index(0)
                    assert torch.equal(aux[:, j * hid:(j + 1) * hid], model.embed(ids))
    finally:
        torch.set_num_threads(old)


class AuxTwin:
    """Runs every forward_aux twice (the Python loop on a copy of the KV cache, then the C++ loop: the same
    hidden, aux and K/V bits, _forward_aux_both) and counts its steps: all, those of the region's shapes, and
    those with a verification (a sequence with cached tokens and several rows)."""

    def __init__(self, eng):
        self.model, self.kv = eng.runner.model, eng.runner.kv_cache
        self.forward_aux = self.model.forward_aux
        self.steps = self.region_steps = self.verify_steps = 0
        self.model.forward_aux = self

    def __call__(self, input_ids, positions, kv_cache, meta, aux_layers):
        m = self.model
        assert m.layer_loop.applies(kv_cache)
        m.forward_aux = self.forward_aux
        try:
            out, aux = _forward_aux_both(m, kv_cache, input_ids, positions, meta, aux_layers)
        finally:
            m.forward_aux = self
        rows = meta.query_start_loc.diff().tolist()
        cached = (meta.seq_lens - meta.query_start_loc.diff()).tolist()
        self.steps += 1
        if _region_shape(rows):
            self.region_steps += 1
            self.verify_steps += any(r > 1 and c > 0 for r, c in zip(rows, cached))
        return out, aux   # the C++ loop's


def test_eagle3_steps_run_in_the_region_with_the_ids_of_speculation_off(a8w8_ckpt, tmp_path, threads=2):
    """Through the engine: an EAGLE-3 head (the copy head: its drafts are accepted) on the A8W8 target; every
    step that hands the head aux states runs the C++ loop with forward_aux's Python-loop bits (AuxTwin), the
    verifications and decode rows in the one region (its profile's count), and the ids (greedy, seeded) are
    those of speculation off. Two threads (rows split or in each thread's own buffers; one thread and the row
    kinds are test_region_writes_eagle3_aux_states_with_forward_aux_bits's)."""
    import json

    from backend_lib.tools.make_eagle3_head import build as build_head
    from spec_helpers import GREEDY, PROMPTS, SEEDED, compare_spec

    head = build_head(a8w8_ckpt, tmp_path / "copy", copy=True)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "min_acceptance": 0.0,
            "auto_disable_from_batch": None}
    off = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256)
    on = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256,
                     speculative_config=json.dumps(spec))
    assert on.runner.aux_layers == (0, 1, 2)
    prompts = [off.tokenizer.encode(p) for p in PROMPTS]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        twin, off_twin = AuxTwin(on), Twin(off)
        base = on.runner.model.forward
        plain_calls = []
        on.runner.model.forward = lambda *a: (plain_calls.append(1), base(*a))[1]
        torch.ops.qwen3_cpu.decode_layers_profile(True)
        compare_spec(off, on, prompts[1:2], GREEDY, min_accepted=4)   # alone (batch-1 rows)
        compare_spec(off, on, prompts, [GREEDY, SEEDED, GREEDY, {**SEEDED, "seed": 3}], min_accepted=4)
        prof = torch.ops.qwen3_cpu.decode_layers_profile(False)
    finally:
        torch.set_num_threads(old)
    assert not plain_calls   # every step of the head's sequences asked for aux states
    assert twin.verify_steps >= 10 and twin.region_steps > twin.verify_steps
    assert prof[0, -1].item() == twin.region_steps + off_twin.region_steps


# ----- float (bf16 / fp32) weights: dense and Qwen3-MoE models in the region -----------------------------------

def _float(ckpts, which):
    """dense: tiny bf16 checkpoint; moe: tiny Qwen3-MoE, bf16 attention and experts; mixed: dense and sparse
    layers (layer 1 dense), unnormalized top-3 of 70 experts (the router's two panels)."""
    if which == "dense":
        return ckpts.get("tiny-bf16", "bf16")
    if which == "moe":
        return ckpts.get("tiny-moe-bf16", "bf16", "tiny-moe")
    return ckpts.get("tiny-moe-mixed-bf16", "bf16", "tiny-moe", num_hidden_layers=4, mlp_only_layers=[1],
                     norm_topk_prob=False, num_experts=70, num_experts_per_tok=3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("which,dtype", [("dense", "bfloat16"), ("dense", "float32"), ("moe", "bfloat16"),
                                         ("mixed", "bfloat16"), ("mixed", "float32")])
def test_float_decode_steps_run_in_one_region_with_the_python_loops_bits(ckpts, which, dtype, batch, threads):
    """FloatLinear projections (float_linear's panels) and float experts (the native MoE op's float GEMMs) in the
    one region: the hidden states, logits and KV caches of every step bit-identical to the Python loop, batch 1
    (every thread's own rows), 2 and 5 (rows split, tokens sharing experts), 1 and 2 threads."""
    if dtype == "float32" and (batch, threads) != (5, 2):
        pytest.skip("covered by the other cases")
    eng = make_engine(_float(ckpts, which), dtype=dtype, max_num_seqs=8, kv_cache_memory="4MiB", max_model_len=256)
    model = eng.runner.model
    lins = [lin for layer in model.layers for lin in model.layer_loop._linears(layer)]
    assert lins and all(type(lin).__name__ == "FloatLinear" for lin in lins)
    assert all(lin.prepared[0].dtype == getattr(torch, dtype) for lin in lins)
    assert model.layer_loop.applies(eng.runner.kv_cache)
    twin, prof, seen = _generate_profiled(eng, batch, threads,
                                          lambda: _routings(model, batch) if which != "dense" else None)
    assert prof[:, _phase("qkv")].sum().item() > 0
    if which != "dense":
        assert batch == 1 or max(len(rows) for rows in seen) > 1   # the rows of a step routed differently
        assert prof[:, _phase("expGateUp")].sum().item() > 0
    assert (prof[:, _phase("gateUp")].sum().item() > 0) == (which != "moe")


@pytest.mark.parametrize("which", ["dense", "mixed"])
def test_float_greedy_ids_equal_the_python_loop_and_do_not_depend_on_the_batch(ckpts, which):
    """Through the engine: the same greedy ids with the layer loop on and off, and batched as alone."""
    eng = make_engine(_float(ckpts, which), dtype="bfloat16", max_num_seqs=8, kv_cache_memory="8MiB",
                      max_model_len=256)
    _assert_loop_ids_equal_the_python_loop(eng, _prompts(eng, 8), steps=16, solo=2)


@pytest.mark.parametrize("threads", [1, 2])
def test_float_verification_steps_run_in_one_region_with_the_python_loops_bits(ckpts, threads):
    """A few rows per sequence (up to 64 rows: the float panels' tiles of 6 rows) on the bf16 mixed model."""
    eng = make_engine(_float(ckpts, "mixed"), dtype="bfloat16", max_num_seqs=16, kv_cache_memory="4MiB",
                      max_model_len=256)
    for i, (rows, cached) in enumerate(FEW_ROWS):
        assert _region_step_equals_the_python_loop(eng, rows, cached, threads, seed=i) == 1, rows
