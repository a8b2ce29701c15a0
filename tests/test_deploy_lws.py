"""deploy/k8s/leaderworkerset: the multi-host tensor-parallel manifest. LeaderWorkerSet is a CRD the Kubernetes
schemas do not hold, so its pod templates are validated as PodTemplates (strict) and its own fields against the
LWS v1 API's documented ones; the leader and worker must agree on the model's settings, and the worker's command
must name a real model's config.pbtxt and the rendezvous variables the worker entry point reads."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from backend_lib.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
LWS = ROOT / "deploy" / "k8s" / "leaderworkerset" / "leaderworkerset.yaml"
K8S_VERSION = "1.30.0"
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "startupPolicy", "rolloutStrategy", "networkConfig"}
LWS_TEMPLATE = {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
RESTART_POLICIES = {"RecreateGroupOnPodRestart", "None"}


def doc() -> dict:
    (d,) = [d for d in yaml.safe_load_all(LWS.read_text()) if d]
    return d


def env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("which", ["leaderTemplate", "workerTemplate"])
def test_the_pod_templates_are_valid_pod_templates(which):
    tmpl = doc()["spec"]["leaderWorkerTemplate"][which]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": tmpl}, K8S_VERSION, strict=True)


def test_the_leaderworkerset_fields_are_the_apis():
    d = doc()
    assert d["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and d["kind"] == "LeaderWorkerSet"
    assert set(d["spec"]) <= LWS_SPEC and set(d["spec"]["leaderWorkerTemplate"]) <= LWS_TEMPLATE
    lwt = d["spec"]["leaderWorkerTemplate"]
    assert isinstance(lwt["size"], int) and lwt["size"] >= 2
    assert lwt["restartPolicy"] in RESTART_POLICIES and d["spec"]["startupPolicy"] in {"LeaderCreated", "LeaderReady"}


def test_leader_and_workers_agree_and_the_worker_command_is_the_entry_point():
    lwt = doc()["spec"]["leaderWorkerTemplate"]
    (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
    (worker,) = lwt["workerTemplate"]["spec"]["containers"]
    le, we = env(leader), env(worker)
    size = str(lwt["size"])
    assert le["QWEN3_A8W8_TENSOR_PARALLEL_SIZE"] == we["QWEN3_A8W8_TENSOR_PARALLEL_SIZE"] == size
    assert le["QWEN3_TP_SPAWN"] == "0"
    params = EngineConfig.field_names()
    for var, value in we.items():            # every model setting of the worker is the leader's too
        assert var.startswith("QWEN3_A8W8_") and var[len("QWEN3_A8W8_"):].lower() in params, var
        assert le[var] == value, var
    script = " ".join(worker["args"])
    for var, lws in (("RANK", "LWS_WORKER_INDEX"), ("WORLD_SIZE", "LWS_GROUP_SIZE"),
                     ("MASTER_ADDR", "LWS_LEADER_ADDRESS")):
        assert f'{var}="${lws}"' in script
    port = re.search(r"MASTER_PORT=(\d+)", script).group(1)
    assert port == le["QWEN3_TP_MASTER_PORT"]
    assert int(port) in [p["containerPort"] for p in leader["ports"]]
    assert "-m backend_lib.parallel.runtime" in script
    config = re.search(r"--model-config (\S+)", script).group(1)
    assert config.startswith("/opt/qwen3/model_repository/")
    assert (ROOT / "model_repository" / config[len("/opt/qwen3/model_repository/"):]).is_file()


def test_the_worker_entry_point_reads_that_config(tmp_path, monkeypatch):
    from backend_lib.parallel.runtime import config_from_pbtxt

    monkeypatch.setenv("QWEN3_A8W8_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("QWEN3_A8W8_CHECKPOINT", str(tmp_path))
    cfg = config_from_pbtxt(str(ROOT / "model_repository" / "qwen3_a8w8" / "config.pbtxt"), "qwen3_a8w8")
    assert cfg.tensor_parallel_size == 2 and cfg.checkpoint == str(tmp_path)
