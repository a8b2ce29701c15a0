"""Triton model qwen3_tokenizer: text or chat messages -> input_ids (backend_lib.serving)."""
try:
    from backend_lib.serving.triton_tokenizer import TritonTokenizerModel
except ImportError:  # a source checkout that was not pip-installed: import from the repository root
    import os
    import sys

    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
    from backend_lib.serving.triton_tokenizer import TritonTokenizerModel


class TritonPythonModel(TritonTokenizerModel):
    pass
