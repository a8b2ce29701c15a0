"""Cores and threads of co-located engines: parsing, the launcher's default partition, pinning."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from backend_lib import cpu_policy
from backend_lib.config import EngineConfig
from backend_lib.serving.launcher import cpu_partition, llm_models


def test_parse_and_format_cores():
    assert cpu_policy.parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_policy.format_cores([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="cpu_cores"):
            cpu_policy.parse_cores(bad)
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig.from_params({"checkpoint": "x", "cpu_cores": "two"})
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig.from_params({"checkpoint": "x", "num_threads": "0"})


def test_partition_is_disjoint_contiguous_and_even():
    assert cpu_policy.partition(["a", "b"], [0, 1]) == {"a": "0", "b": "1"}
    assert cpu_policy.partition(["a", "b"], list(range(5))) == {"a": "0-2", "b": "3-4"}
    assert cpu_policy.partition(["a", "b", "c"], [0, 1]) == {}        # fewer cores than models: they share
    assert cpu_policy.partition(["a"], [0, 1]) == {}                  # alone: every core


def _repo(tmp_path, models: dict[str, str]):
    for name, pbtxt in models.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(pbtxt)
        code = "class TritonPythonModel(TritonLLMModel): pass" if name.startswith("llm") else "class T: pass"
        (tmp_path / name / "1" / "model.py").write_text(code)
    return tmp_path


def test_launcher_shares_the_cores_among_the_llm_models_it_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_policy, "available_cores", lambda: [0, 1, 2, 3])
    repo = _repo(tmp_path / "repo", {"llm_a": "", "llm_b": "", "llm_c": 'parameters { key: "cpu_cores", value: '
                                                                         '{ string_value: "0" } }', "tok": ""})
    args = ["--model-repository", str(repo)]
    assert [n for n, _ in llm_models(args)] == ["llm_a", "llm_b", "llm_c"]
    env = cpu_partition(args, {}, tmp_path)
    flags = tmp_path / "busy"
    # default: work-conserving, one slot each in one flags file (all idle), over every core; llm_c chose its own
    assert (env["LLM_A_CPU_SHARE"], env["LLM_B_CPU_SHARE"]) == (f"{flags}#0#0-3", f"{flags}#1#0-3")
    assert flags.read_bytes() == bytes(2 * cpu_policy.SLOT.size)
    assert not any(k.endswith("_CPU_CORES") for k in env) and "LLM_C_CPU_SHARE" not in env
    assert env["GOMP_SPINCOUNT"] == cpu_policy.SPIN_COUNT
    static = cpu_partition(args, {"QWEN3_CPU_PARTITION": "static"}, tmp_path)
    assert (static["LLM_A_CPU_CORES"], static["LLM_B_CPU_CORES"]) == ("0-1", "2-3")
    assert not any(k.endswith("_CPU_SHARE") for k in static)
    # the operator's choices win: an env override, the off switch, an explicit wait policy
    assert "LLM_A_CPU_SHARE" not in cpu_partition(args, {"LLM_A_NUM_THREADS": "2"}, tmp_path)
    assert "LLM_B_CPU_SHARE" not in cpu_partition(args, {"LLM_A_NUM_THREADS": "2"}, tmp_path)   # the only one left
    off = cpu_partition(args, {"QWEN3_CPU_PARTITION": "off", "OMP_WAIT_POLICY": "active"}, tmp_path)
    assert not any(k.endswith(("_CPU_CORES", "_CPU_SHARE")) for k in off) and "GOMP_SPINCOUNT" not in off
    explicit = args + ["--model-control-mode=explicit", "--load-model", "llm_b"]
    assert [n for n, _ in llm_models(explicit)] == ["llm_b"]


def _share(tmp_path, monkeypatch, slots: int, cores: list[int]):
    """CoreShares of `slots` models over `cores`, with the team changes recorded instead of applied."""
    applied: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(cpu_policy, "available_cores", lambda: cores)
    flags = cpu_policy.create_share_file(tmp_path / "busy", slots)
    shares = [cpu_policy.CoreShare(cpu_policy.format_share(flags, i, cores)) for i in range(slots)]
    for i, s in enumerate(shares):
        monkeypatch.setattr(s, "_apply", lambda c, i=i, s=s: (applied.append((i, c)), setattr(s, "current", c)))
    return shares, applied


def test_core_share_gives_every_core_to_the_model_busy_alone(tmp_path, monkeypatch):
    (a, b), applied = _share(tmp_path, monkeypatch, 2, [0, 1, 2, 3])
    a.start(), b.start()   # loading: every model its part, as if all were busy
    assert applied == [(0, [0, 1]), (1, [2, 3])]
    applied.clear()
    assert a.before_step() == [0, 1, 2, 3]          # b idle: a takes every core
    assert a.before_step() == [0, 1, 2, 3] and applied == [(0, [0, 1, 2, 3])]   # applied once, not per step
    assert b.before_step() == [2, 3]                # b joins: its part at once (what it loaded with) ...
    assert a.before_step() == [0, 1]                # ... a gives it back at its next step
    b.idle()
    assert a.before_step() == [0, 1, 2, 3]
    assert applied == [(0, [0, 1, 2, 3]), (0, [0, 1]), (0, [0, 1, 2, 3])]


def test_core_share_splits_among_the_busy_models_only_and_ignores_dead_ones(tmp_path, monkeypatch):
    (a, b, c), _ = _share(tmp_path, monkeypatch, 3, list(range(6)))
    a.before_step(), c.before_step()
    assert a.target() == [0, 1, 2] and c.target() == [3, 4, 5]   # b idle: a and c split the six cores
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cpu_policy.SLOT.pack_into(a._map, 2 * cpu_policy.SLOT.size, dead.pid)   # c's process died while busy
    assert a.target() == list(range(6))
    a.close()
    assert b.busy_slots() == [1]                   # a closed (idle), c dead: b sees itself alone


def test_core_share_is_validated_with_its_name(tmp_path):
    for bad in ("", "/x", "/x#a#0", "/x#0#two"):
        with pytest.raises(ValueError, match="cpu_share"):
            cpu_policy.parse_share(bad)
    with pytest.raises(ValueError, match="cpu_share"):
        EngineConfig.from_params({"checkpoint": "x", "cpu_share": "nope"})
    flags = cpu_policy.create_share_file(tmp_path / "busy", 2)
    with pytest.raises(ValueError, match="cpu_share: slot 2 of 2"):
        cpu_policy.CoreShare(cpu_policy.format_share(flags, 2, cpu_policy.available_cores()))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_apply_pins_the_calling_thread_and_sizes_the_team():
    import torch

    core = sorted(os.sched_getaffinity(0))[-1]
    seen = {}
    before = torch.get_num_threads()

    def engine_thread():
        seen["applied"] = cpu_policy.apply(str(core), None)
        seen["mask"] = os.sched_getaffinity(0)
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen["applied"] == ([core], 1) and seen["mask"] == {core} and seen["threads"] == 1
    assert len(os.sched_getaffinity(0)) >= 2   # only that thread was pinned
    torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_cores: 4096 not available"):
        cpu_policy.apply("4096", None)


def _team_masks() -> list[set[int]]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            out.append(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_set_team_pins_every_thread_of_the_openmp_team():
    """libgomp's pool threads keep the mask they were created with: pinning the engine thread alone would leave
    the team's other threads on every core."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    seen = {}
    before = torch.get_num_threads()
    x = torch.zeros(1 << 22)

    def engine_thread():
        cpu_policy.set_team(cores, 2)
        x.add_(1)                                        # a 2-thread parallel region: the pool thread exists
        cpu_policy.set_team([cores[-1]], 2)
        x.add_(1)
        seen["narrow"] = sum(m == {cores[-1]} for m in _team_masks())
        cpu_policy.set_team(cores, 2)
        seen["wide"] = sum(m == {cores[-1]} for m in _team_masks())

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    torch.set_num_threads(before)
    assert seen == {"narrow": 2, "wide": 0}             # the engine thread and its pool thread, then neither


def test_an_engine_with_a_core_share_resizes_per_step_and_idles(tmp_path, a8w8_ckpt, monkeypatch):
    from backend_lib.engine import EngineLoop
    from helpers import make_engine

    cores = cpu_policy.available_cores()
    if len(cores) < 2:
        pytest.skip("needs two cores")
    flags = cpu_policy.create_share_file(tmp_path / "busy", 2)
    loop = EngineLoop.build(lambda: make_engine(a8w8_ckpt, cpu_share=cpu_policy.format_share(flags, 0, cores)))
    try:
        share = loop.engine.core_share
        assert share.current == cpu_policy.parse_cores(cpu_policy.partition([0, 1], cores)[0])   # loading
        params = loop.engine.make_params({"temperature": 0, "max_tokens": 4, "ignore_eos": True})

        def run(rid):
            import queue
            q: queue.Queue = queue.Queue()
            loop.submit(rid, [9707, 11, 1879], params, q.put)
            while not q.get(timeout=120).finished:
                pass
        run("alone")
        assert share.current == cores
        cpu_policy.SLOT.pack_into(share._map, cpu_policy.SLOT.size, os.getppid())   # the other model is busy
        run("shared")
        assert share.current == cpu_policy.parse_cores(cpu_policy.partition([0, 1], cores)[0])
        for _ in range(100):   # the loop marks the engine idle before it waits
            if cpu_policy.SLOT.unpack_from(share._map, 0)[0] == 0:
                break
            threading.Event().wait(0.01)
        assert cpu_policy.SLOT.unpack_from(share._map, 0)[0] == 0
    finally:
        loop.shutdown()
