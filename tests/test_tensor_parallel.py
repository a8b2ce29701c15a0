"""Tensor parallel (backend_lib/parallel): TP = 2 over torch.distributed's gloo, two rank processes on 127.0.0.1,
against TP = 1 on the same checkpoint. A8W8 must give TP = 1's bits (the logits' sha256 at every step, hence the
greedy ids), alone and in a batch; a float checkpoint must give the same bits on every run and alone as batched."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backend_lib.parallel.shard import shard_heads, split
from helpers import make_engine

PROMPTS = ["9707,11,1879,0", "3,4,5", "151644,872,198,9707"]
DTYPES = "float32,bfloat16"


def run_check(checkpoint, tp: int, *extra: str) -> dict:
    args = [sys.executable, "-m", "backend_lib.parallel.check", "--checkpoint", str(checkpoint), "--tp", str(tp),
            "--max-tokens", "6", *extra]
    for p in PROMPTS:
        args += ["--prompt-ids", p]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def alone_equals_batched(run: dict) -> None:
    ids, digests = run["batched"]
    assert [a[0][0] for a in run["alone"]] == ids
    assert [a[1][0] for a in run["alone"]] == digests


def test_a8w8_tp2_computes_tp1s_bits(a8w8_ckpt):
    one = run_check(a8w8_ckpt, 1, "--dtype", DTYPES, "--layer-loop")
    two = run_check(a8w8_ckpt, 2, "--dtype", DTYPES)
    assert two["tp"] == 2
    for dtype in DTYPES.split(","):
        assert two[dtype] == one[dtype], dtype       # ids and the logits' bits of every step, alone and batched
        alone_equals_batched(two[dtype][0])
        assert len(set(two[dtype][0]["batched"][0][0])) > 1   # the random model does not collapse into one token


def test_moe_a8w8_tp2_with_experts_split_computes_tp1s_bits(moe_a8w8_ckpt):
    """Qwen3-MoE at TP = 2: attention sharded by heads, the experts split whole across the ranks (expert parallel,
    parallel/moe.py), each pair's output taken from its expert's rank and combined in TP = 1's order."""
    one = run_check(moe_a8w8_ckpt, 1, "--dtype", DTYPES)
    two = run_check(moe_a8w8_ckpt, 2, "--dtype", DTYPES)
    for dtype in DTYPES.split(","):
        assert two[dtype] == one[dtype], dtype
        alone_equals_batched(two[dtype][0])


def test_float_tp2_is_deterministic_and_batch_invariant(bf16_ckpt):
    runs = run_check(bf16_ckpt, 2, "--dtype", "bfloat16", "--repeat", "2")["bfloat16"]
    assert runs[0] == runs[1]
    alone_equals_batched(runs[0])


def test_heads_split_with_kv_heads_replicated_when_fewer_than_ranks():
    s = shard_heads(16, 8, 1, 2)
    assert (s.heads, s.kv_heads) == (slice(8, 16), slice(4, 8))
    # 4 query heads per KV head; 8 ranks over 2 KV heads: ranks 0-3 read KV head 0, ranks 4-7 KV head 1
    assert [shard_heads(16, 2, r, 8).kv_heads for r in range(8)] == [slice(0, 1)] * 4 + [slice(1, 2)] * 4
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_heads(6, 2, 0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_heads(12, 3, 0, 2)
    with pytest.raises(ValueError, match="intermediate_size"):
        split(3072 + 1, 0, 2, "intermediate_size")


def test_a_rank_that_fails_fails_the_run_naming_it(tmp_path):
    from backend_lib.parallel.check import launch

    with pytest.raises(RuntimeError, match="rank 0 exited"):
        launch(["--checkpoint", str(tmp_path / "missing"), "--tp", "2", "--prompt-ids", "1,2"], 2, timeout_s=120)


def test_a_rank_killed_mid_run_fails_the_run_and_leaves_no_rank(a8w8_ckpt, monkeypatch):
    """Rank 1 dies (SIGKILL from its own fault hook) after loading: rank 0 must not wait in its collective."""
    import time

    from backend_lib.parallel.check import launch

    monkeypatch.setenv("QWEN3_TP_DIE_RANK", "1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with -9"):
        launch(["--checkpoint", str(a8w8_ckpt), "--tp", "2", "--prompt-ids", "1,2"], 2, timeout_s=240)
    assert time.monotonic() - t0 < 120


# ----- the engine with tensor_parallel_size: 2 (rank 0 in this process, rank 1 a worker it starts) -----------

ENGINE_PROMPTS = [[9707, 11, 1879, 0], [3, 4, 5], [151644, 872, 198, 9707, 11, 1879, 0, 3, 4, 5, 6, 7, 8, 9, 10,
                                                  11, 12, 13, 14, 15, 16, 17, 18, 19]]


def engine_ids(engine, seeded: bool) -> list[list[int]]:
    from backend_lib.sampling.params import SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=12, ignore_eos=True) if seeded
              else SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for i in range(len(ENGINE_PROMPTS))]
    batched = [r["output_ids"] for r in engine.generate(ENGINE_PROMPTS, params)]
    alone = [engine.generate([p], [q])[0]["output_ids"] for p, q in zip(ENGINE_PROMPTS, params)]
    assert alone == batched
    return batched


@pytest.mark.parametrize("kv_cache", ["bf16", "tq"])
def test_the_engine_at_tp2_gives_tp1s_greedy_and_seeded_ids(a8w8_ckpt, kv_cache):
    from helpers import make_engine

    one = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache=kv_cache)
    want = engine_ids(one, False), engine_ids(one, True)
    del one
    two = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache=kv_cache, tensor_parallel_size=2, num_threads=1)
    try:
        assert (engine_ids(two, False), engine_ids(two, True)) == want
        # the same prompt again: its full pages come from the prefix cache (and the partial one by copy, on both)
        assert engine_ids(two, False) == want[0]
        assert two.stats.prefix_cache_hits > 0
    finally:
        two.runner.tp.close()


@pytest.fixture(scope="module")
def tp_adapters(tmp_path_factory, bf16_ckpt):
    """Two PEFT adapters of the tiny architecture: every projection (r 8), and the MLP only with rsLoRA (r 4)."""
    from helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("tp_adapters")
    return {"all": str(make_peft_adapter(bf16_ckpt, root / "all", r=8, seed=1)[0]),
            "mlp": str(make_peft_adapter(bf16_ckpt, root / "mlp", r=4, alpha=8, use_rslora=True, seed=3, std=0.2,
                                         targets=("gate_proj", "up_proj", "down_proj"))[0])}


def lora_jobs(engine):
    """Base rows and both adapters' rows, greedy and seeded, over the engine prompts."""
    jobs = []
    for i, prompt in enumerate(ENGINE_PROMPTS[1:]):
        for lora in (None, "all", "mlp"):
            seeded = {"temperature": 0.9, "seed": 11 + i} if i % 2 else {"temperature": 0}
            jobs.append((prompt, engine.make_params({**seeded, "max_tokens": 8, "ignore_eos": True,
                                                     **({"lora_name": lora} if lora else {})})))
    return jobs


def run_jobs(engine, jobs) -> list[list[int]]:
    together = [r["output_ids"] for r in engine.generate([p for p, _ in jobs], [q for _, q in jobs])]
    assert [engine.generate([p], [q])[0]["output_ids"] for p, q in jobs] == together
    return together


def test_lora_and_an_int8_head_at_tp2_give_tp1s_ids(a8w8_ckpt, tp_adapters):
    """LoRA at TP = 2 (parallel/lora.py: B sharded with the column-parallel layers, the adapted rows' input gathered
    for the row-parallel ones) with lm_head_quant int8: every row's ids are TP = 1's, alone and in a mixed batch.
    max_loras 1: the adapters evict each other, so the workers get, drop and get again their shards."""
    opts = dict(dtype="bfloat16", lora_modules=tp_adapters, max_loras=1, lm_head_quant="int8")
    one = make_engine(a8w8_ckpt, **opts)
    jobs = lora_jobs(one)
    want = run_jobs(one, jobs)
    for k in range(0, len(jobs), 3):   # the base and each adapter give different tokens
        assert len({tuple(x) for x in want[k:k + 3]}) == 3
    del one
    two = make_engine(a8w8_ckpt, tensor_parallel_size=2, num_threads=1, **opts)
    try:
        assert run_jobs(two, lora_jobs(two)) == want
        shipper = two.runner.model._shipper
        assert shipper.next_slot > 2            # shipped again after an eviction
        assert len(shipper.live) <= 2 + len(shipper.gone)
    finally:
        two.runner.tp.close()


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "auto_disable_from_batch": None}   # gate off: drafts counted here (test_spec_gate.py)
LOOPING = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [9707, 11, 9707, 11, 9707, 11, 9707, 11]]


def spec_and_structured_ids(engine) -> tuple:
    greedy = engine.make_params({"temperature": 0, "max_tokens": 24, "ignore_eos": True})
    seeded = engine.make_params({"temperature": 0.7, "seed": 3, "max_tokens": 24, "ignore_eos": True})
    spec = [r["output_ids"] for r in engine.generate(LOOPING + LOOPING, [greedy, greedy, seeded, seeded])]
    datas = [{"temperature": 1.0, "seed": 1, "max_tokens": 30, "structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2,4}"}},
             {"temperature": 0, "max_tokens": 30, "guided_choice": ["alpha", "beta", "gamma delta"]},
             {"temperature": 0.8, "seed": 4, "max_tokens": 30, "structured_outputs": {
                 "json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 "disable_any_whitespace": True}}]
    res = engine.generate([ENGINE_PROMPTS[0]] * 3, [engine.make_params(d) for d in datas])
    assert res[1]["text"] in ("alpha", "beta", "gamma delta")
    return spec, [r["output_ids"] for r in res]


def test_speculative_decoding_and_structured_output_at_tp2_give_tp1s_ids(a8w8_ckpt):
    """n-gram speculative decoding at TP = 2 (the verification rows go through the sharded forward): the ids equal
    TP = 1's with speculation off; structured output (masks on rank 0's sampler) equals TP = 1's too."""
    one = make_engine(a8w8_ckpt, dtype="bfloat16")
    want = spec_and_structured_ids(one)
    del one
    two = make_engine(a8w8_ckpt, dtype="bfloat16", tensor_parallel_size=2, num_threads=1,
                      speculative_config=json.dumps(SPEC))
    try:
        assert spec_and_structured_ids(two) == want
        stats = two.spec.stats()
        assert stats["spec_num_accepted_tokens"] > 0, stats
    finally:
        two.runner.tp.close()


EAGLE_PROMPTS = LOOPING + [ENGINE_PROMPTS[0]]


def eagle3_ids(engine) -> list[list[int]]:
    """Greedy and seeded ids of EAGLE_PROMPTS, batched and each alone (equal)."""
    params = [engine.make_params({"temperature": 0, "max_tokens": 16, "ignore_eos": True}),
              engine.make_params({"temperature": 0.7, "seed": 5, "max_tokens": 16, "ignore_eos": True}),
              engine.make_params({"temperature": 0, "max_tokens": 16, "ignore_eos": True})]
    jobs = [(p, q) for p in EAGLE_PROMPTS for q in params[:2]]
    return run_jobs(engine, jobs)


def eagle3_watched(engine):
    """eagle3_ids, and what the head was given and gave: each observe's (prompt, start, aux rows) and each
    propose's drafts, in order."""
    proposer, seen, drafts = engine.spec.proposer, [], []
    observe, propose = proposer.observe, proposer.propose

    def watch_observe(seq, state, start, rows):
        seen.append((tuple(seq.prompt_ids), start, rows.clone()))
        return observe(seq, state, start, rows)

    def watch_propose(rows):
        out = propose(rows)
        drafts.append([(tuple(r.seq.prompt_ids), list(d)) for r, d in zip(rows, out)])
        return out
    proposer.observe, proposer.propose = watch_observe, watch_propose
    return eagle3_ids(engine), seen, drafts


def test_eagle3_at_tp2_gives_speculation_offs_ids_and_tp1s_aux_states_and_drafts(a8w8_ckpt, a8w8_engine, tmp_path,
                                                                                     caplog):
    """EAGLE-3 at TP = 2 (the head on rank 0, whole; the aux states rank 0's replicated residual stream; the
    target's embedding rows gathered for the head): the ids equal speculation off's, greedy and seeded, alone and
    batched, and the aux rows the head is fed (prefill chunks and k + 1 verification rows) and every draft it makes
    equal TP = 1 EAGLE-3's bit for bit (A8W8: TP = N computes TP = 1's bits). The copy head (aux layer 0 through
    fc, no embed_tokens: the target's embedding) has its drafts accepted."""
    import torch

    from backend_lib.parallel.runtime import RankFailure
    from backend_lib.tools.make_eagle3_head import build as build_head

    head = build_head(a8w8_ckpt, tmp_path / "copy", copy=True)
    cfg = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "min_acceptance": 0.0,
                      "auto_disable_from_batch": None})
    want = eagle3_ids(a8w8_engine)
    one = make_engine(a8w8_ckpt, dtype="bfloat16", speculative_config=cfg)
    got1, seen1, drafts1 = eagle3_watched(one)
    stats1 = one.spec.stats()
    del one
    assert got1 == want and stats1["spec_num_accepted_tokens"] > 0, stats1
    two = make_engine(a8w8_ckpt, dtype="bfloat16", tensor_parallel_size=2, num_threads=1, speculative_config=cfg)
    try:
        got2, seen2, drafts2 = eagle3_watched(two)
        assert got2 == want
        assert [(p, s) for p, s, _ in seen2] == [(p, s) for p, s, _ in seen1]
        assert all(torch.equal(a[2], b[2]) for a, b in zip(seen2, seen1))
        assert drafts2 == drafts1 and two.spec.stats() == stats1
        assert two.block_manager.num_used == 0 and not two._seqs
        # a rank lost while the head embeds (before the step's forward): no drafts, then the step fails naming it
        two.add_request("r", EAGLE_PROMPTS[0], two.make_params({"temperature": 0, "max_tokens": 8}))
        two.step()                             # the prompt; the next step drafts
        two.runner.tp.procs[0].kill()
        two.runner.tp.procs[0].wait()
        with pytest.raises(RankFailure, match="rank 1 exited with -9") as info:
            two.step()
        (out,) = info.value.outputs
        assert out.finish_reason == "error" and "rank 1 exited" in out.error
        assert "EAGLE-3 head failed; 1 row(s) draft nothing" in caplog.text   # its embed met the lost rank first
    finally:
        two.runner.tp.close(1.0)


def test_a_dead_rank_fails_the_step_and_the_next_ones_naming_it(a8w8_ckpt):
    from helpers import make_engine

    from backend_lib.parallel.runtime import RankFailure
    from backend_lib.sampling.params import SamplingParams

    engine = make_engine(a8w8_ckpt, dtype="bfloat16", tensor_parallel_size=2, num_threads=1)
    sup = engine.runner.tp
    try:
        assert engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0]["finish_reason"]
        sup.procs[0].kill()
        sup.procs[0].wait()
        engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
        with pytest.raises(RankFailure, match="rank 1 exited with -9") as info:
            engine.step()
        (out,) = info.value.outputs
        assert out.finish_reason == "error" and "rank 1 exited" in out.error
    finally:
        sup.close(1.0)
    assert all(p.poll() is not None for p in sup.procs)


def test_tensor_parallel_size_is_validated_naming_it(a8w8_ckpt):
    from backend_lib.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(checkpoint=str(a8w8_ckpt), tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 with cpu_share"):
        EngineConfig(checkpoint=str(a8w8_ckpt), tensor_parallel_size=2, cpu_share="/tmp/flags#0#0-1").validate()
    with pytest.raises(ValueError, match="tensor_parallel_size: 'x' is not an integer"):
        EngineConfig.from_params({"checkpoint": str(a8w8_ckpt), "tensor_parallel_size": "x"})


# ----- through tritonserver: config.pbtxt's tensor_parallel_size: 2 -------------------------------------------

def _rank_processes() -> list[int]:
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"backend_lib.parallel.runtime" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def _assert_no_rank_left(before: set, seconds: float = 10) -> None:
    """No rank process beyond `before` is alive within `seconds` (the server stopped, its workers with it)."""
    import time

    deadline = time.monotonic() + seconds
    while set(_rank_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_rank_processes()) - before


@pytest.mark.slow
@pytest.mark.server
def test_tritonserver_streams_tp2_ids_equal_to_tp1_and_a_killed_rank_fails_cleanly(tmp_path, a8w8_ckpt):
    import os
    import signal

    from helpers import GREEDY, PROMPT, SERVER_ENGINE, collect, make_engine

    from harness.triton_server import TritonServer, make_repository

    eng = make_engine(a8w8_ckpt, **{k: int(v) for k, v in SERVER_ENGINE.items() if k != "dtype" and v.isdigit()},
                      dtype="bfloat16")
    params = eng.make_params({**GREEDY["sampling_parameters"], "max_tokens": 12})
    want = eng.generate([eng.tokenizer.encode(PROMPT)], params)[0]["output_ids"]
    seeded = {"temperature": 0.9, "seed": 5, "ignore_eos": True, "max_tokens": 12}
    want_seeded = eng.generate([eng.tokenizer.encode(PROMPT)], eng.make_params(seeded))[0]["output_ids"]
    del eng
    before = set(_rank_processes())
    repo = make_repository(tmp_path / "models", {
        "qwen3_tp": {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(a8w8_ckpt),
                     "tensor_parallel_size": "2", "num_threads": "1"}})
    server = TritonServer(repo, tmp_path / "tritonserver.log").start()
    try:
        ids = lambda rs: [i for _, got, _ in rs for i in got]  # noqa: E731
        res = collect(server.grpc_url, "qwen3_tp", prompt=PROMPT, sampling_parameters={
            **GREEDY["sampling_parameters"], "max_tokens": 12})
        assert res[-1][0] != "ERROR", res
        assert ids(res) == want
        res = collect(server.grpc_url, "qwen3_tp", prompt=PROMPT, sampling_parameters=seeded)
        assert ids(res) == want_seeded
        (worker,) = set(_rank_processes()) - before
        os.kill(worker, signal.SIGKILL)
        res = collect(server.grpc_url, "qwen3_tp", prompt=PROMPT, sampling_parameters={
            **GREEDY["sampling_parameters"], "max_tokens": 4})
        assert res[-1][0] == "ERROR" and "tensor parallel rank 1 exited" in str(res[-1][1]), res
    finally:
        server.stop()
    _assert_no_rank_left(before)


@pytest.mark.slow
@pytest.mark.server
def test_tritonserver_streams_moe_tp2_with_experts_split_ids_equal_to_tp1(tmp_path, moe_a8w8_ckpt):
    """A Qwen3-MoE A8W8 model at tensor_parallel_size 2 (experts split over the ranks, EP = 2) through tritonserver:
    greedy and seeded streams, alone and two at once, give the ids the in-process TP = 1 engine gives; no rank
    process is left after the server stops."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import GREEDY, PROMPT, SERVER_ENGINE, collect, make_engine

    from harness.triton_server import TritonServer, make_repository

    eng = make_engine(moe_a8w8_ckpt, **{k: int(v) for k, v in SERVER_ENGINE.items() if k != "dtype" and v.isdigit()},
                      dtype="bfloat16")
    greedy = {**GREEDY["sampling_parameters"], "max_tokens": 12}
    seeded = {"temperature": 0.9, "seed": 5, "ignore_eos": True, "max_tokens": 12}
    want = [eng.generate([eng.tokenizer.encode(p)], eng.make_params(sp))[0]["output_ids"]
            for p, sp in ((PROMPT, greedy), (PROMPT, seeded), ("Hello", greedy))]
    del eng
    before = set(_rank_processes())
    repo = make_repository(tmp_path / "models", {
        "qwen3_moe_tp": {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(moe_a8w8_ckpt),
                         "tensor_parallel_size": "2", "num_threads": "1"}})
    server = TritonServer(repo, tmp_path / "tritonserver.log").start()
    try:
        ids = lambda rs: [i for _, got, _ in rs for i in got]  # noqa: E731
        def run(job):
            return collect(server.grpc_url, "qwen3_moe_tp", prompt=job[0], sampling_parameters=job[1])
        assert ids(run((PROMPT, greedy))) == want[0]
        assert ids(run((PROMPT, seeded))) == want[1]
        with ThreadPoolExecutor(2) as pool:   # two at once: a batch of two rows across the split experts
            both = list(pool.map(run, [(PROMPT, seeded), ("Hello", greedy)]))
        assert [ids(r) for r in both] == want[1:]
    finally:
        server.stop()
    _assert_no_rank_left(before)


@pytest.mark.parametrize("k", [7, 1023, 1024, 3000])
def test_row_parallel_a8w8_sums_exactly_through_the_kernel_sets_gemm(k):
    """One rank's share: the kernel set's A8W8 GEMM over marked slabs gives the int32 sums the reference gets,
    at the largest products (every |q| = 127 against weights of +-127: |sum| reaches 127 * 127 * K)."""
    import torch

    from backend_lib.kernels import get_kernels
    from backend_lib.kernels.reference.ops import a8w8_linear
    from backend_lib.parallel import TPGroup
    from backend_lib.parallel.linear import RowParallelA8W8

    g = torch.Generator().manual_seed(k)
    w = torch.randint(-127, 128, (40, k), dtype=torch.int8, generator=g)
    w[0] = 127
    w[1] = -127
    scale = torch.rand(40, generator=g) / 100
    x = torch.randn(5, k, generator=g)
    x[0] = 3.0                       # every q = 127: row 0's sums are 127 * 127 * K
    x[1, : k // 2] = 0.0
    for kernels in (get_kernels("cpu", "cpu"), get_kernels("cpu", "reference")):
        layer = RowParallelA8W8(w, scale, TPGroup(), kernels)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(layer(x.to(dtype)), a8w8_linear(x.to(dtype), w, scale)), (kernels.name, dtype)


def test_a_worker_started_from_its_config_pbtxt_joins_rank_0(tmp_path, a8w8_ckpt, monkeypatch):
    """The other-host form (a LeaderWorkerSet's worker pod): rank 0 spawns nothing (QWEN3_TP_SPAWN=0) and waits at
    its master address; the worker reads the model's config.pbtxt with the $<MODEL>_<PARAMETER> overrides. A
    worker whose configuration disagrees with rank 0's fails naming the parameter."""
    import os
    import socket
    import subprocess
    import sys

    from helpers import SERVER_ENGINE, make_engine

    from harness.triton_server import make_repository

    repo = make_repository(tmp_path / "models", {"qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt),
                                                               "tensor_parallel_size": "2", "num_threads": "1"}})
    opts = {k: int(v) for k, v in SERVER_ENGINE.items() if k != "dtype" and v.isdigit()}
    one = make_engine(a8w8_ckpt, dtype="bfloat16", **opts)
    want = engine_ids(one, False)
    del one

    def join(env_extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("QWEN3_TP_SPAWN", "0")
        monkeypatch.setenv("QWEN3_TP_MASTER_PORT", str(port))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2", **env_extra)
        worker = subprocess.Popen([sys.executable, "-m", "backend_lib.parallel.runtime", "--model-config",
                                   str(repo / "qwen3_a8w8" / "config.pbtxt")], env=env, stderr=subprocess.PIPE,
                                  text=True)
        return worker

    worker = join({})
    two = make_engine(a8w8_ckpt, dtype="bfloat16", tensor_parallel_size=2, num_threads=1, **opts)
    try:
        assert engine_ids(two, False) == want
    finally:
        two.runner.tp.close()
    rc = worker.wait(30)
    assert rc == 0, worker.stderr.read()[-3000:]
    del two
    import torch.distributed as dist
    assert not dist.is_initialized()

    worker = join({"QWEN3_A8W8_PAGE_SIZE": "32"})
    with pytest.raises(Exception):
        make_engine(a8w8_ckpt, dtype="bfloat16", tensor_parallel_size=2, num_threads=1, **opts)
    assert worker.wait(60) != 0
    assert "page_size differs from rank 0's" in worker.stderr.read()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def test_each_rank_gets_whole_numa_nodes_or_an_even_run_of_cores():
    from backend_lib.parallel.bind import rank_cores

    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cores(r, 2, list(range(8)), nodes) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 4 nodes, 2 ranks: two whole nodes each; an operator's cpu_cores restrict them
    four = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [rank_cores(r, 2, list(range(8)), four) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cores(r, 2, [0, 1, 4, 5], nodes) for r in range(2)] == [[0, 1], [4, 5]]
    # one node (this machine): an even contiguous split; fewer cores than ranks: they share
    assert [rank_cores(r, 2, [0, 1], [[0, 1]]) for r in range(2)] == [[0], [1]]
    assert [rank_cores(r, 3, list(range(7)), []) for r in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [rank_cores(r, 3, [0, 1], []) for r in range(3)] == [[0], [1], [0]]


def test_the_step_channel_packs_one_message_and_unpacks_it_bit_for_bit(tmp_path):
    """A step's tensors (any dtype, 0 to 2 dimensions, empty ones) through the shared-memory broadcast between two
    ends of one ShmExchange file (the rank-0 and worker sides in this process)."""
    import torch

    from backend_lib.parallel.channel import StepChannel, float_word, word_float
    from backend_lib.parallel.group import TPGroup
    from backend_lib.parallel.shm import ShmExchange

    path = str(tmp_path / "x")
    r0 = TPGroup(0, 2, None, ShmExchange(path, 0, 2, 1 << 16, True, 5.0))
    r1 = TPGroup(1, 2, None, ShmExchange(path, 1, 2, 1 << 16, False, 5.0))
    ts = [torch.arange(5), torch.tensor(7), torch.zeros((0,), dtype=torch.int32), torch.randn(3, 4).bfloat16(),
          torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.tensor([1.5, -0.0])]
    for _ in range(3):    # both buffers, then the first again
        StepChannel(r0, None).send(5, 3, float_word(0.125), ts)
        op, a, b, got = StepChannel(r1, None).recv()
        assert (op, a, word_float(b)) == (5, 3, 0.125)
        raw = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()  # noqa: E731
        assert all(x.dtype == y.dtype and x.shape == y.shape and raw(x) == raw(y) for x, y in zip(ts, got))
        assert len(got) == len(ts)
