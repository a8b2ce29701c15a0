"""The deployment artifacts: deploy/Dockerfile (hadolint, and its ENTRYPOINT + CMD run under its ENV against a
stand-in for the image's tritonserver binary) and the Kubernetes manifests of deploy/k8s (the Kubernetes
schemas, offline, and how the pieces refer to each other)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from backend_lib.config import EngineConfig
from backend_lib.serving import launcher
from helpers import ROOT, hadolint

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"     # the oldest Kubernetes the manifests are meant for; also checked at the newest


def instructions(kind: str) -> list[str]:
    return [i["value"] for i in DockerfileParser(str(DOCKERFILE)).structure if i["instruction"] == kind]


# ----- Dockerfile ------------------------------------------------------------------------------------------


def test_the_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_defect(tmp_path):
    """The lint is live: the same file with an unpinned apt install and a root user fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("# hadolint ignore=DL3008\n", "").replace("USER 1000:1000", ""))
    proc = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3008" in proc.stdout


def test_the_image_is_ngc_triton_with_cpu_torch_the_project_and_a_kernel_cache():
    df = DockerfileParser(str(DOCKERFILE))
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3", df.baseimage)
    assert m and (int(m[1]), int(m[2])) >= (25, 3), df.baseimage          # the gRPC cancellation race fixed
    runs = " ".join(instructions("RUN"))
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in runs
    assert 'pip install ".[openai]"' in runs
    copies = instructions("COPY")
    for folder in ("backend_lib", "model_repository", "openai_frontend"):
        assert any(c.split()[0] == folder for c in copies), folder
    assert df.envs["QWEN3_KERNEL_CACHE"].startswith("/var/cache/qwen3/")
    assert df.envs["HF_HOME"].startswith("/var/cache/qwen3/")
    assert json.loads(instructions("VOLUME")[0]) == ["/var/cache/qwen3"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", instructions("USER")[-1])   # numeric, not root
    assert json.loads(instructions("ENTRYPOINT")[0]) == ["python3", "-m", "backend_lib.serving.launcher"]


FAKE_TRITONSERVER = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
extern char **environ;
static volatile sig_atomic_t got = 0;
static void on_term(int s) { got = s; }
int main(int argc, char **argv) {
    const char *out = getenv("FAKE_OUT");
    char path[4096];
    signal(SIGTERM, on_term);
    FILE *f = fopen(out, "w");
    for (int i = 1; i < argc; i++) fprintf(f, "%s\n", argv[i]);
    fclose(f);
    snprintf(path, sizeof path, "%s.env", out);
    f = fopen(path, "w");
    for (char **e = environ; *e; e++) fprintf(f, "%s\n", *e);
    fclose(f);
    if (getenv("FAKE_ENGINE_DIES")) {              /* what a model does when its engine thread dies */
        f = fopen(getenv("QWEN3_ENGINE_DEAD"), "a");
        fprintf(f, "model qwen3_a8w8: the engine has died\n");
        fclose(f);
    }
    while (!got) usleep(10000);
    const char *flag = getenv("QWEN3_STOP_FLAG");
    snprintf(path, sizeof path, "%s.term", out);
    f = fopen(path, "w");
    fprintf(f, "%d %d\n", (int)got, flag != NULL && access(flag, F_OK) == 0);
    fclose(f);
    return 0;
}
"""


@pytest.fixture(scope="module")
def image_tritonserver(tmp_path_factory) -> Path:
    """A compiled stand-in for /opt/tritonserver/bin/tritonserver (a real ELF binary, as the launcher requires):
    it records its arguments and environment, and on SIGTERM whether the stop flag already existed."""
    root = tmp_path_factory.mktemp("image-bin")
    (root / "fake.c").write_text(FAKE_TRITONSERVER)
    subprocess.run(["cc", "-O1", "-o", str(root / "tritonserver"), str(root / "fake.c")], check=True)
    return root


def run_image(image_bin: Path, out: Path, extra_env=None) -> subprocess.Popen:
    """The container's command: ENTRYPOINT + CMD under the Dockerfile's ENV, the image's server first on PATH."""
    entry = json.loads(instructions("ENTRYPOINT")[0])
    cmd = json.loads(instructions("CMD")[0])
    assert entry[0] == "python3"
    env = {**os.environ, **DockerfileParser(str(DOCKERFILE)).envs, "FAKE_OUT": str(out), **(extra_env or {})}
    env["PATH"] = f"{image_bin}{os.pathsep}{env['PATH']}"
    env.pop("QWEN3_TRITONSERVER", None)
    return subprocess.Popen([sys.executable, *entry[1:], *cmd], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_the_image_command_runs_the_launcher_over_the_images_tritonserver(image_tritonserver, tmp_path):
    out = tmp_path / "server"
    proc = run_image(image_tritonserver, out)
    wait_for(out.with_suffix(".env"))
    time.sleep(0.2)
    args = out.read_text().splitlines()
    assert args == json.loads(instructions("CMD")[0]) + [f"--exit-timeout-secs={launcher.DEFAULT_EXIT_TIMEOUT_S}"]
    env = dict(line.split("=", 1) for line in out.with_suffix(".env").read_text().splitlines() if "=" in line)
    df_env = DockerfileParser(str(DOCKERFILE)).envs
    assert env["QWEN3_KERNEL_CACHE"] == df_env["QWEN3_KERNEL_CACHE"] and env["HF_HOME"] == df_env["HF_HOME"]
    assert env[launcher.STOP_FLAG_ENV] and env[launcher.ENGINE_DEAD_ENV]
    assert "LD_LIBRARY_PATH" not in env or "nvidia_pytriton" not in env["LD_LIBRARY_PATH"]  # not the bundled one
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)                    # docker stop / Kubernetes
    assert proc.wait(30) == 0 and time.time() - t0 < 5
    assert out.with_suffix(".term").read_text().split() == [str(int(signal.SIGTERM)), "1"]   # flag first


def test_in_the_image_a_dead_engine_ends_the_container_with_status_3(image_tritonserver, tmp_path):
    out = tmp_path / "server"
    proc = run_image(image_tritonserver, out, {"FAKE_ENGINE_DIES": "1"})
    assert proc.wait(30) == launcher.ENGINE_DEAD_EXIT
    assert out.with_suffix(".term").read_text().split() == [str(int(signal.SIGTERM)), "1"]
    assert "model qwen3_a8w8: the engine has died; stopping the server" in proc.stderr.read()


# ----- Kubernetes ------------------------------------------------------------------------------------------


def manifests() -> dict[str, list[dict]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind: str) -> dict:
    (doc,) = [d for docs in manifests().values() for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    docs = manifests()
    assert {"deployment.yaml", "service.yaml", "hpa.yaml", "pvc.yaml", "pdb.yaml"} <= set(docs)
    for name, resources in docs.items():
        for doc in resources:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_is_live():
    doc = by_kind("Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/", "port": 8000}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_the_manifests():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == set(manifests()) - {"hpa.yaml", "prometheus-adapter-rules.yaml"} | {"../grafana"}


GRAFANA = ROOT / "deploy" / "grafana"


def dashboard_configmap() -> dict:
    """The ConfigMap deploy/grafana/kustomization.yaml generates, built as kustomize builds it (one data key per
    file, named after the file; the generator's labels; no name hash)."""
    (gen,) = yaml.safe_load((GRAFANA / "kustomization.yaml").read_text())["configMapGenerator"]
    assert gen["options"]["disableNameSuffixHash"] is True   # a stable name Grafana's sidecar and people can find
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": gen["name"], "labels": gen["options"]["labels"]},
            "data": {f: (GRAFANA / f).read_text() for f in gen["files"]}}


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_the_grafana_dashboard_ships_as_a_labelled_configmap(version):
    cm = dashboard_configmap()
    kubernetes_validate.validate(cm, version, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"     # what Grafana's dashboard sidecar selects
    (name,) = cm["data"]
    assert name.endswith(".json") and json.loads(cm["data"][name])["uid"] == "qwen3-triton"
    assert len(json.dumps(cm)) < 1024 * 1024 // 2                     # far from the 1 MiB object limit


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (it builds the kustomization)")
def test_kubectl_kustomize_builds_the_manifests_with_the_dashboard():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"] == dashboard_configmap()["metadata"] and cm["data"] == dashboard_configmap()["data"]
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service", "PersistentVolumeClaim",
                                          "PodDisruptionBudget"}


def test_the_deployment_service_hpa_and_image_fit_together():
    dep, svc, hpa, pdb = by_kind("Deployment"), by_kind("Service"), by_kind("HorizontalPodAutoscaler"), \
        by_kind("PodDisruptionBudget")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items() and pdb["spec"]["selector"]["matchLabels"] == \
        dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["replicas"] >= 2
    assert svc["spec"]["sessionAffinity"] == "ClientIP"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    rules = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"][0]
    assert rules["seriesQuery"].startswith("vllm:num_requests_waiting{") and \
        rules["name"]["as"] == "vllm_num_requests_waiting"

    (triton,) = [c for c in pod["spec"]["containers"] if c["name"] == "triton"]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    args = dict(a.split("=", 1) for a in triton["args"])
    assert int(args["--http-port"]) == ports["http"] and int(args["--metrics-port"]) == ports["metrics"]
    assert int(args["--grpc-port"]) == ports["grpc"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["metrics"]
    assert "command" not in triton      # the image's ENTRYPOINT: the launcher
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60   # download + kernel compilation
    assert triton["resources"]["requests"]["memory"] and triton["resources"]["limits"]["memory"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > 5 + launcher.DEFAULT_EXIT_TIMEOUT_S + launcher.KILL_GRACE_S        # preStop + drain

    mounts = {m["name"]: m["mountPath"] for m in triton["volumeMounts"]}
    df_env = DockerfileParser(str(DOCKERFILE)).envs
    assert df_env["QWEN3_KERNEL_CACHE"].startswith(mounts["cache"] + "/")
    assert df_env["HF_HOME"].startswith(mounts["cache"] + "/")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == by_kind("PersistentVolumeClaim")["metadata"]["name"]

    # the models the init container selects exist, and the env overrides name real models and parameters
    (init,) = pod["spec"]["initContainers"]
    selected = re.findall(r"/opt/qwen3/model_repository/(\w+)", " ".join(init["args"]))
    assert selected and all((ROOT / "model_repository" / m / "config.pbtxt").is_file() for m in selected)
    assert args["--model-repository"] == {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["models"]
    params = EngineConfig.field_names()
    for var in (e["name"] for e in triton["env"] if e["name"].startswith("QWEN3_")):
        model = next((m for m in selected if var.startswith(m.upper() + "_")), None)
        assert model and var[len(model) + 1:].lower() in params, var
