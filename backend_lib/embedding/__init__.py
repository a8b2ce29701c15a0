"""Embeddings and rerank scores over the Qwen3 decoder (model.py); the sentence-transformers files (st_config.py)."""
