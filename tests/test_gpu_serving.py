"""Serving on GPUs without one: deploy/Dockerfile.gpu (hadolint, what it installs and runs), the KIND_GPU configs
(model_repository/<model>/configs/gpu.pbtxt: the CPU config's model and parameters, one instance per GPU), the
device a KIND_GPU instance gets, and the engine thread binding its device."""
from __future__ import annotations

import io
import json
import re
import subprocess
import threading

import pytest
import torch
from dockerfile_parse import DockerfileParser

from backend_lib.config import EngineConfig
from backend_lib.device import bind_device
from backend_lib.serving.triton_config import engine_config_from_args
from helpers import ROOT, hadolint

GPU_DOCKERFILE = ROOT / "deploy" / "Dockerfile.gpu"
LLM_MODELS = ("qwen3_a8w8", "qwen3_tq")


def _parsed() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(GPU_DOCKERFILE.read_bytes()))   # (a path must end in "Dockerfile")


def _instructions(kind: str) -> list[str]:
    return [i["value"] for i in _parsed().structure if i["instruction"] == kind]


def test_the_gpu_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(GPU_DOCKERFILE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_gpu_image_is_ngc_triton_with_cuda_torch_the_cuda_extra_and_the_gpu_configs():
    df = _parsed()
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3", df.baseimage)
    assert m and (int(m[1]), int(m[2])) >= (25, 3), df.baseimage
    runs = " ".join(_instructions("RUN"))
    assert "torch==2.13.0" in runs and "whl/cpu" not in runs
    assert re.search(r"ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu\d+", GPU_DOCKERFILE.read_text())
    assert 'pip install ".[openai,cuda]"' in runs
    assert df.envs["TRITON_CACHE_DIR"].startswith("/var/cache/qwen3/")
    assert json.loads(_instructions("VOLUME")[0]) == ["/var/cache/qwen3"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", _instructions("USER")[-1])
    assert json.loads(_instructions("ENTRYPOINT")[0]) == ["python3", "-m", "backend_lib.serving.launcher"]
    assert "--model-config-name=gpu" in json.loads(_instructions("CMD")[0])


def _settings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("model", LLM_MODELS)
def test_the_gpu_config_is_the_cpu_config_on_kind_gpu(model):
    cpu = _settings((ROOT / "model_repository" / model / "config.pbtxt").read_text())
    gpu = _settings((ROOT / "model_repository" / model / "configs" / "gpu.pbtxt").read_text())
    assert "instance_group [ { kind: KIND_CPU, count: 1 } ]" in cpu      # the default stays on the CPU
    assert [line.replace("KIND_CPU", "KIND_GPU") for line in cpu] == gpu


def test_a_kind_gpu_instance_gets_its_own_cuda_device_and_the_default_kernels(tmp_path):
    args = {"model_repository": str(tmp_path), "model_instance_kind": "GPU", "model_instance_device_id": "1",
            "model_config": json.dumps({"parameters": {"checkpoint": {"string_value": "x"}}})}
    cfg = engine_config_from_args(args, {"checkpoint": "x"})
    assert cfg.device == "cuda:1" and cfg.kernels == "auto"
    cpu = engine_config_from_args({**args, "model_instance_kind": "CPU"}, {"checkpoint": "x"})
    assert cpu.device == "cpu"


def test_bind_device_sets_the_threads_current_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    bind_device(torch.device("cuda:1"))
    bind_device(torch.device("cpu"))
    assert calls == [torch.device("cuda:1")]


def test_the_engine_binds_its_device_in_the_engine_thread(monkeypatch, bf16_ckpt):
    from backend_lib.engine import EngineLoop, LLMEngine
    from backend_lib.engine import llm_engine

    seen = []
    monkeypatch.setattr(llm_engine, "bind_device", lambda d: seen.append((d, threading.current_thread().name)))
    cfg = EngineConfig(checkpoint=str(bf16_ckpt), dtype="float32", page_size=16, kv_cache_memory="16MiB",
                       max_model_len=256)
    loop = EngineLoop.build(lambda: LLMEngine(cfg), name="gpu-test-engine")
    try:
        assert seen == [(torch.device("cpu"), "gpu-test-engine")]
    finally:
        loop.shutdown()
