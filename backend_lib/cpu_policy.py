"""Which cores an engine computes on, and how many threads: the policy for models that share a machine.

One OpenMP team per engine. Two teams as wide as the machine on the same cores do not time-share: each
team's threads spin at every barrier waiting for a partner the OS has descheduled to run the other
team, and both collapse (measured through tritonserver with both LLM models busy on 2 cores: 0.46x of
what fair time-sharing gives). So the cores are never given to two busy teams at once, but they are not
left idle either: the launcher makes a `CoreShare` for the LLM models it serves (a file of per-model
busy flags, one slot each), and each engine, once per step, marks itself busy and takes the cores that
`partition` gives it among the models busy at that moment: all of them when it is alone, its share of
the disjoint split when others are busy (`CoreShare.before_step`); an engine with nothing to do marks
itself idle (`CoreShare.idle`). A change of width takes effect at the next step of each engine, so two
teams overlap for at most one step. The team is resized and re-pinned between parallel regions
(`set_team`: the engine thread's mask, the team size, and one parallel region in which every thread of
the pool pins itself, since libgomp's pool threads keep the mask they were created with).

An operator may give any model its own `cpu_cores` / `num_threads` (config.pbtxt or $<MODEL>_CPU_CORES),
including overlapping sets, fixed for the engine's life (`apply`); then the wait policy matters, and the
launcher shortens libgomp's spin (GOMP_SPINCOUNT) so that a waiting thread yields the core soon instead
of spinning against a descheduled partner (any other process on the cores, too).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
from pathlib import Path

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


def partition(models: list, cores: list[int]) -> dict:
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


# ----- work-conserving sharing among the launcher's LLM models ------------------------------------------
SLOT = struct.Struct("<i")   # one per model: the pid of its process while its engine is busy, else 0


def create_share_file(path: str | os.PathLike, slots: int) -> Path:
    """The busy flags of `slots` models, all idle (the launcher makes it once, before the models load)."""
    path = Path(path)
    path.write_bytes(bytes(SLOT.size * slots))
    return path


def format_share(path: str | os.PathLike, slot: int, cores: list[int]) -> str:
    """The `cpu_share` parameter of one model: '<flags file>#<slot>#<all the cores shared>'."""
    return f"{path}#{slot}#{format_cores(cores)}"


def parse_share(spec: str) -> tuple[str, int, list[int]]:
    parts = spec.rsplit("#", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        raise ValueError(f"cpu_share: {spec!r} is not '<flags file>#<slot>#<cores>' (the launcher sets it)")
    return parts[0], int(parts[1]), parse_cores(parts[2], "cpu_share")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class CoreShare:
    """One engine's view of the share file; used only by the engine's thread."""

    def __init__(self, spec: str):
        path, self.slot, self.cores = parse_share(spec)
        allowed = set(available_cores())
        missing = [c for c in self.cores if c not in allowed]
        if missing:
            raise ValueError(f"cpu_share: cores {format_cores(missing)} not available to this process")
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slots = len(self._map) // SLOT.size
        if not 0 <= self.slot < self.slots or self.slots > len(self.cores):
            raise ValueError(f"cpu_share: slot {self.slot} of {self.slots} models on {len(self.cores)} cores")
        self.pid = os.getpid()
        self.current: list[int] | None = None
        self.switches = 0

    def busy_slots(self) -> list[int]:
        """Slots whose model is busy now (a flag left by a process that died counts as idle)."""
        out = []
        for i in range(self.slots):
            (pid,) = SLOT.unpack_from(self._map, i * SLOT.size)
            if i == self.slot or (pid and _alive(pid)):
                out.append(i)
        return out

    def target(self) -> list[int]:
        """This engine's cores now: its part of the split among the busy models (every core when alone)."""
        return parse_cores(partition(self.busy_slots(), self.cores).get(self.slot) or format_cores(self.cores))

    def start(self) -> list[int]:
        """Before the engine loads: its share as if every model were busy (they load at the same time)."""
        cores = parse_cores(partition(list(range(self.slots)), self.cores).get(self.slot)
                            or format_cores(self.cores))
        self._apply(cores)
        return cores

    def before_step(self) -> list[int]:
        """In the engine thread before a step: marks the model busy, then sizes and pins its team."""
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid)
        cores = self.target()
        if cores != self.current:
            self._apply(cores)
        return cores

    def idle(self) -> None:
        """The engine has nothing to compute: the others may take its cores at their next step."""
        SLOT.pack_into(self._map, self.slot * SLOT.size, 0)

    def _apply(self, cores: list[int]) -> None:
        set_team(cores, len(cores))
        self.current = cores
        self.switches += 1
        log.debug("cpu_share: %d threads on cores %s (switch %d)", len(cores), format_cores(cores), self.switches)

    def close(self) -> None:
        self.idle()
        self._map.close()


_PIN_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_pin_state: dict = {}


def _gomp():
    """libgomp's GOMP_parallel (the entry point of `#pragma omp parallel`), from the copy torch loaded."""
    if "fn" not in _pin_state:
        _pin_state["fn"] = None
        try:
            lib = next((line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line), None)
            if lib:
                fn = ctypes.CDLL(lib).GOMP_parallel
                fn.argtypes, fn.restype = [_PIN_CB, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
                _pin_state["fn"] = fn
        except (OSError, AttributeError):
            pass
    return _pin_state["fn"]


@_PIN_CB
def _pin_self(_arg) -> None:
    os.sched_setaffinity(0, _pin_state["cores"])


def set_team(cores: list[int], threads: int) -> None:
    """Between parallel regions, in the engine thread: `threads` OpenMP threads on `cores`. libgomp keeps its
    pool threads across regions of any width (a 1-thread region does not touch them) and a new one inherits
    the creating thread's mask, so the engine thread is pinned first and then every thread of a `threads`
    wide region pins itself (ctypes into the GOMP_parallel torch's kernels use; ~60 us here)."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    gomp = _gomp() if threads > 1 else None
    if gomp is not None:
        _pin_state["cores"] = list(cores)
        gomp(_pin_self, None, threads, 0)
