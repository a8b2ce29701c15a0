"""n choices of one request: at most MAX_N, each its own engine request; choice j of a seeded request is seeded
seed + j (as vLLM derives its n > 1 children's seeds), so a seeded request is reproducible."""

MAX_N = 16                     # choices per prompt (vLLM's n, TensorRT-LLM's num_return_sequences)


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice j (0-based) of a request seeded `seed` (None: unseeded, as are all its choices)."""
    if seed is None or not j:
        return seed
    return (int(seed) + j) % 2**64
