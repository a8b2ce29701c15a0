"""Which cores an engine computes on, and how many threads: the policy for models that share a machine.

One OpenMP team per engine. Two teams as wide as the machine on the same cores do not time-share: each
team's threads spin at every barrier waiting for a partner the OS has descheduled to run the other
team, and both collapse (measured through tritonserver with both LLM models busy on 2 cores: 0.46x of
what fair time-sharing gives). So by default the launcher partitions the cores among the LLM models it
serves (`partition`); each engine pins its thread, and with it the team that thread creates, to its
set (`apply`), and sizes the team to it. An operator may give any model its own `cpu_cores` /
`num_threads` (config.pbtxt or $<MODEL>_CPU_CORES), including overlapping sets; then the wait policy
matters, and the launcher shortens libgomp's spin (GOMP_SPINCOUNT) so that a waiting thread yields the
core soon instead of spinning against a descheduled partner (any other process on the cores, too).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# libgomp spins this many iterations before sleeping at a barrier; its default (300,000; ~0.1-1 ms) is what
# makes a team spin against a partner descheduled for another process. Measured (`python -m bench.cotenancy
# --policy ""`, 0.6B A8W8, batch-4 decode in-process beside a process keeping one of the 2 cores busy):
# default spin 0.33 of its speed alone, 1,000 spins 0.49 (its fair share: 0.5), speed alone unchanged
# (58.7 vs 54.5 tokens/s, noise); 10,000 spins did not help (0.21 on the tiny model, as the default).
# libgomp reads it when it loads, so it is set in the server's environment (the launcher), not here.
SPIN_COUNT = "1000"


def parse_cores(spec: str, field: str = "cpu_cores") -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; an error naming `field` for anything else."""
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                cores.update(range(lo, hi + 1))
            else:
                cores.add(int(part))
    except ValueError:
        raise ValueError(f"{field}: {spec!r} is not a core list like '0-3,6'") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"{field}: {spec!r} is not a core list like '0-3,6'")
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def apply(cpu_cores: str | None, num_threads: int | None) -> tuple[list[int] | None, int | None]:
    """In the engine's thread, before its first parallel region: pins this thread (its OpenMP team inherits
    the mask) to `cpu_cores` and sizes the team (default: one thread per core). Returns what was applied."""
    import torch

    cores = None
    if cpu_cores:
        cores = parse_cores(cpu_cores)
        allowed = set(available_cores())
        missing = [c for c in cores if c not in allowed]
        if missing:
            raise ValueError(f"cpu_cores: {format_cores(missing)} not available to this process "
                             f"(available: {format_cores(sorted(allowed))})")
        os.sched_setaffinity(0, cores)   # pid 0: the calling thread
        num_threads = num_threads or len(cores)
    if num_threads:
        torch.set_num_threads(num_threads)
    return cores, num_threads


def partition(models: list[str], cores: list[int]) -> dict[str, str]:
    """Disjoint contiguous core sets for `models` (in order), as even as possible; {} when there are fewer
    cores than models (nothing to partition: they share, with the short spin)."""
    if len(models) < 2 or len(cores) < len(models):
        return {}
    out, start = {}, 0
    for i, name in enumerate(models):
        n = len(cores) // len(models) + (1 if i < len(cores) % len(models) else 0)
        out[name] = format_cores(cores[start:start + n])
        start += n
    return out
