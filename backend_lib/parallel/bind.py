"""Binding each tensor-parallel rank of one host to its own cores, as vLLM's CPU backend binds its ranks
(VLLM_CPU_OMP_THREADS_BIND: each rank's OpenMP threads on the cores of one NUMA node, one thread per core) and
SGLang runs one rank per sub-NUMA cluster: two ranks never share a core, and a rank's weights and KV cache, first
touched by its own threads after the binding, are allocated on its node (Linux's first-touch policy: the memory
binding vLLM asks libnuma for, without a dependency).

The host's cores (those this process may use, or the operator's `cpu_cores`) are split into the ranks' shares:
whole NUMA nodes per rank when there are at least as many nodes as ranks on the host, otherwise contiguous, even
runs of cores. Ranks on other hosts (QWEN3_TP_SPAWN=0 without LOCAL_RANK / LOCAL_WORLD_SIZE) own their host and
are not split. QWEN3_TP_BIND=0 turns binding off.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os

from .. import cpu_policy

log = logging.getLogger(__name__)


def numa_nodes() -> list[list[int]]:
    """The cores of each NUMA node (sysfs), in node order; [] when the host shows none."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"),
                       key=lambda p: int(p.split("/node")[-1].split("/")[0])):
        text = open(path).read().strip()
        if text:
            nodes.append(cpu_policy.parse_cores(text))
    return nodes


def rank_cores(local_rank: int, local_size: int, cores: list[int], nodes: list[list[int]]) -> list[int]:
    """This rank's share of `cores`: whole NUMA nodes when there are at least as many (non-empty) nodes as ranks,
    else an even contiguous run. Every rank gets at least one core (ranks share when there are fewer cores)."""
    allowed = set(cores)
    nodes = [[c for c in n if c in allowed] for n in nodes]
    nodes = [n for n in nodes if n]
    if len(nodes) >= local_size:
        lo, hi = local_rank * len(nodes) // local_size, (local_rank + 1) * len(nodes) // local_size
        return sorted(c for n in nodes[lo:hi] for c in n)
    if len(cores) < local_size:
        return [cores[local_rank % len(cores)]]
    lo, hi = local_rank * len(cores) // local_size, (local_rank + 1) * len(cores) // local_size
    return cores[lo:hi]


_PIN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_state: dict = {}


@_PIN
def _pin_thread(_arg) -> None:
    cores = _state["cores"]
    os.sched_setaffinity(0, [cores[_state["num"]() % len(cores)]])


def pin_threads(cores: list[int], threads: int) -> None:
    """`threads` OpenMP threads, thread i on core i (one parallel region in which each thread pins itself, as
    cpu_policy.set_team does for a whole set); the calling thread, the team's master, on the first core."""
    import torch

    os.sched_setaffinity(0, [cores[0]] if threads <= len(cores) else cores)
    torch.set_num_threads(threads)
    gomp = cpu_policy._gomp() if threads > 1 else None
    if gomp is None or threads > len(cores):
        return
    if "num" not in _state:
        lib = next((line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line), None)
        fn = ctypes.CDLL(lib).omp_get_thread_num
        fn.restype = ctypes.c_int
        _state["num"] = fn
    _state["cores"] = list(cores)
    gomp(_pin_thread, None, threads, 0)


def local_rank(rank: int) -> tuple[int, int] | None:
    """(this rank's index, ranks) among those on this host, or None (not split: this host is the rank's own)."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return None


def worker_env() -> dict:
    """What a worker rank 0 starts needs to bind itself: the host's cores as rank 0 saw them before binding (a
    child inherits the mask of the thread that starts it)."""
    return {"QWEN3_TP_HOST_CORES": cpu_policy.format_cores(_state["host"])} if "host" in _state else {}


def host_share(rank: int, size: int) -> tuple[int, int] | None:
    """(index, ranks) of this rank among the ranks on its host: LOCAL_RANK / LOCAL_WORLD_SIZE when set (rank 0
    sets them for the workers it starts), rank 0 that starts its workers itself: (0, size); otherwise None."""
    env = local_rank(rank)
    if env is not None:
        return env
    if rank == 0 and size > 1 and os.environ.get("QWEN3_TP_SPAWN", "1") != "0":
        return 0, size
    return None


def bind_rank(local: tuple[int, int] | None, cpu_cores: str | None, num_threads: int | None) -> list[int] | None:
    """Binds this process's compute thread and its OpenMP team to the rank's share of the host's cores; returns
    the cores (None: not bound, the ordinary cpu_cores / num_threads policy applies)."""
    if local is None or local[1] < 2 or os.environ.get("QWEN3_TP_BIND", "1") == "0":
        return None
    if cpu_cores:
        base = cpu_policy.parse_cores(cpu_cores)
    elif os.environ.get("QWEN3_TP_HOST_CORES"):   # a worker rank 0 started (its mask is rank 0's thread's)
        base = cpu_policy.parse_cores(os.environ["QWEN3_TP_HOST_CORES"])
    else:
        base = cpu_policy.available_cores()
    _state["host"] = base
    cores = rank_cores(local[0], local[1], base, numa_nodes())
    threads = num_threads or len(cores)
    import threading

    import torch

    _state["before"] = (threading.get_ident(), os.sched_getaffinity(0), torch.get_num_threads())
    pin_threads(cores, threads)
    log.info("tensor parallel rank %d/%d bound to cores %s (%d threads)", local[0], local[1],
             cpu_policy.format_cores(cores), threads)
    return cores


def unbind() -> None:
    """Rank 0's engine ends: its thread gets back the mask and team size it had (a process that builds another
    engine in the same thread, as the tests do, is not left on one core). Other threads: nothing to undo."""
    import threading

    import torch

    before = _state.pop("before", None)
    if before is not None and before[0] == threading.get_ident():
        os.sched_setaffinity(0, before[1])
        torch.set_num_threads(before[2])
