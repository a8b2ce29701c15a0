"""Triton model qwen3_embed: texts or token ids -> embeddings (backend_lib.serving.triton_embed)."""
try:
    from backend_lib.serving.triton_embed import TritonEmbedModel
except ImportError:  # a source checkout that was not pip-installed: import from the repository root
    import os
    import sys

    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
    from backend_lib.serving.triton_embed import TritonEmbedModel


class TritonPythonModel(TritonEmbedModel):
    pass
