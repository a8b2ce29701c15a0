"""Triton model qwen3_a8w8: the LLM glue shared by every model of this repository (backend_lib.serving)."""
try:
    from backend_lib.serving.triton_llm import TritonLLMModel
except ImportError:  # a source checkout that was not pip-installed: import from the repository root
    import os
    import sys

    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
    from backend_lib.serving.triton_llm import TritonLLMModel


class TritonPythonModel(TritonLLMModel):
    pass
