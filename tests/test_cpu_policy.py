"""Cores and threads of co-located engines: parsing, the launcher's default partition, pinning."""
from __future__ import annotations

import os
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


def test_launcher_partitions_the_llm_models_it_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_policy, "available_cores", lambda: [0, 1, 2, 3])
    repo = _repo(tmp_path, {"llm_a": "", "llm_b": "", "llm_c": 'parameters { key: "cpu_cores", value: '
                                                                '{ string_value: "0" } }', "tok": ""})
    args = ["--model-repository", str(repo)]
    assert [n for n, _ in llm_models(args)] == ["llm_a", "llm_b", "llm_c"]
    env = cpu_partition(args, {})
    assert (env["LLM_A_CPU_CORES"], env["LLM_B_CPU_CORES"]) == ("0-1", "2-3")   # llm_c chose its own
    assert "LLM_C_CPU_CORES" not in env and "TOK_CPU_CORES" not in env
    assert env["GOMP_SPINCOUNT"] == cpu_policy.SPIN_COUNT
    # the operator's choices win: an env override, the off switch, an explicit wait policy
    assert "LLM_A_CPU_CORES" not in cpu_partition(args, {"LLM_A_NUM_THREADS": "2"})
    assert "LLM_B_CPU_CORES" not in cpu_partition(args, {"LLM_A_NUM_THREADS": "2"})   # the only one left
    off = cpu_partition(args, {"QWEN3_CPU_PARTITION": "off", "OMP_WAIT_POLICY": "active"})
    assert not any(k.endswith("_CPU_CORES") for k in off) and "GOMP_SPINCOUNT" not in off
    explicit = args + ["--model-control-mode=explicit", "--load-model", "llm_b"]
    assert [n for n, _ in llm_models(explicit)] == ["llm_b"]


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
