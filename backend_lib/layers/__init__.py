"""Building blocks of the Qwen3 forward, each a thin module over backend_lib.kernels."""
