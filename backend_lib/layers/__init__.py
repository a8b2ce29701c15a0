"""Building blocks of the Qwen3 forward, each a thin module over backend_lib.kernels. The model calls their
`forward` directly (no nn.Module hooks on the decode path: see models/qwen3.py)."""
