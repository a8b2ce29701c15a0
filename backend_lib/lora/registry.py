"""The adapters a model serves: the names it knows (configured, or registered at run time) and, of those, at most
`max_loras` resident (validated, packed for the kernels, on the device), the least recently used evicted first.

Requests resolve their `lora_name` here, in the caller's thread (make_request), so a slow or failing load
fails that request alone with an error naming the field, and the engine thread only ever sees adapters that
are loaded. A sequence holds its adapter object while it runs: evicting an adapter drops the registry's
reference, and the memory goes when the last sequence using it ends.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from ..contract.errors import RequestError
from ..contract.fields import check_lora_name
from .adapter import BaseShape, LoraAdapter, LoraError, load_adapter

log = logging.getLogger(__name__)

MULTI_LORA_FILE = "multi_lora.json"


def parse_lora_modules(value, where: str = "lora_modules") -> dict[str, str]:
    """`name=path` pairs (space or comma separated), a JSON object {name: path} or a list of
    {"name": ..., "path": ...} objects (vLLM's --lora-modules forms) -> {name: path}; ValueError naming `where`."""
    if value is None or value == "":
        return {}
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        from ..contract.json_input import loads

        try:
            value = loads(value, where)
        except RequestError as exc:
            raise ValueError(str(exc)) from None
    if isinstance(value, str):
        items = {}
        for pair in value.replace(",", " ").split():
            name, sep, path = pair.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{where}: {pair!r} is not name=path")
            items[name] = path
        value = items
    if isinstance(value, list):
        items = {}
        for i, entry in enumerate(value):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                    entry.get("path"), str) or set(entry) - {"name", "path", "base_model_name"}:
                raise ValueError(f"{where}[{i}]: expected {{\"name\": ..., \"path\": ...}}, got {entry!r}")
            items[entry["name"]] = entry["path"]
        value = items
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected name=path pairs or a JSON object, got {value!r}")
    out = {}
    for name, path in value.items():
        try:
            check_lora_name(name, f"{where}: adapter name")
        except RequestError as exc:
            raise ValueError(str(exc)) from None
        if name in out:
            raise ValueError(f"{where}: adapter {name!r} is named twice")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}.{name}: the path must be a non-empty string, got {path!r}")
        out[name] = path
    return out


def read_multi_lora(folder: str | Path) -> dict[str, str]:
    """vllm_backend's multi_lora.json ({"name": "/path/to/adapter", ...}) in `folder`, or {} when there is none."""
    path = Path(folder) / MULTI_LORA_FILE
    if not path.is_file():
        return {}
    return parse_lora_modules(path.read_text(), str(path))


def resolve_path(value: str, where: str, base_dir: str | None) -> str:
    """A folder (relative to base_dir) or a Hub id in the offline cache, as checkpoints are (the configuration's
    adapters only: a request's lora_path goes through runtime_path)."""
    from ..checkpoint.hub import resolve

    return resolve(value, where, base_dir)


def parse_lora_roots(value, base_dir: str | None = None) -> tuple[str, ...]:
    """lora_roots (comma-separated folders, or a sequence of them) as real paths (relative ones against base_dir)."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    roots = []
    for item in items:
        item = os.path.expanduser(str(item).strip())
        if not item:
            continue
        if not os.path.isabs(item) and base_dir is not None:
            item = os.path.join(base_dir, item)
        roots.append(os.path.realpath(item))
    return tuple(dict.fromkeys(roots))


NOT_IN_ROOTS = "lora_path: not an adapter folder inside this model's lora_roots"
MAX_PATH_LEN = 4096


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def runtime_path(value, roots: tuple[str, ...]) -> tuple[str, str]:
    """(real folder, its root) for a request's lora_path: relative to a root (an `org/name` too: never a Hub
    download on the request path), or absolute, and inside a root once every symlink is resolved (the folder and
    the two files an adapter is read from); RequestError otherwise. The error is one and the same whether the path
    exists or not and never repeats it: a client learns nothing of the server's filesystem outside the roots."""
    if not roots:
        raise RequestError("lora_path: this model takes no lora_path (no lora_roots are configured: the folders "
                           "run-time adapters may come from)")
    if not isinstance(value, str) or not value or len(value) > MAX_PATH_LEN or "\0" in value:
        raise RequestError(f"lora_path: must be a non-empty string of at most {MAX_PATH_LEN} characters")
    from .adapter import CONFIG_FILE, WEIGHTS_FILE

    for root in roots:
        real = os.path.realpath(value if os.path.isabs(value) else os.path.join(root, value))
        if not _inside(real, root) or real == root or not os.path.isdir(real):
            continue
        if all(not os.path.lexists(os.path.join(real, f)) or _inside(os.path.realpath(os.path.join(real, f)), root)
               for f in (CONFIG_FILE, WEIGHTS_FILE)):
            return real, root
    raise RequestError(NOT_IN_ROOTS)


class LoraRegistry:
    def __init__(self, modules: dict[str, str], base: BaseShape, max_loras: int, max_rank: int, kernels, device,
                 allow_runtime: bool = False, base_dir: str | None = None, roots=None, prepare: bool = True):
        """prepare False: adapters keep their fp32 A and B as read (tensor parallel: parallel/lora.py shards and
        prepares them per rank) instead of the kernel set's form."""
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self.prepare = prepare
        self.kernels, self.device = kernels, device
        self.allow_runtime, self.base_dir = allow_runtime, base_dir
        self.roots = parse_lora_roots(roots, base_dir)
        self._known: dict[str, str] = dict(modules)
        self._shown: dict[str, str] = {}   # a request-registered name -> the root its errors show paths under
        self._configured = frozenset(modules)      # names from the configuration: never replaced or removed
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0
        for name in list(modules):   # every configured adapter is validated at start; the last max_loras stay
            self._load(name)

    @property
    def configured(self) -> frozenset[str]:
        """The names of the configuration (lora_modules / multi_lora.json)."""
        return self._configured

    def names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._known)

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def _load(self, name: str) -> LoraAdapter:
        adapter = self._resident.get(name)
        if adapter is not None:
            self._resident.move_to_end(name)
            return adapter
        adapter = load_adapter(name, self._known[name], self.base, self.max_rank)
        if self.prepare:
            adapter.prepare(self.kernels, self.device)
        self.loads += 1
        self._resident[name] = adapter
        while len(self._resident) > self.max_loras:
            evicted, _ = self._resident.popitem(last=False)
            log.info("LoRA adapter %r evicted (max_loras %d)", evicted, self.max_loras)
        log.info("LoRA adapter %r loaded from %s (r %d, %s)", name, adapter.path, adapter.rank,
                 ", ".join(adapter.modules))
        return adapter

    def get(self, name, path=None) -> LoraAdapter:
        """The adapter a request names (loaded if it is not resident); RequestError naming the field."""
        check_lora_name(name)
        with self._lock:
            known_before = name in self._known
            if path is not None:
                self._register_locked(name, path, "lora_path", from_request=True)
            if name not in self._known:
                # only the configuration's names: the ones other clients registered are theirs to know
                known = ", ".join(sorted(self._configured)) or "none"
                raise RequestError(f"lora_name: unknown LoRA adapter {name!r} (known: {known})")
            try:
                return self._load(name)
            except LoraError as exc:
                if not known_before:    # a path that failed to load registers nothing
                    self._known.pop(name, None)
                message = str(exc)
                root = self._shown.get(name)
                if root is not None:   # an adapter from a request: its paths relative to the root, as sent
                    message = message.replace(root.rstrip(os.sep) + os.sep, "")
                if not known_before:
                    self._shown.pop(name, None)
                raise RequestError(f"lora_name: {message}") from None

    def _register_locked(self, name: str, path, where: str, from_request: bool = False) -> None:
        if not self.allow_runtime:
            raise RequestError(f"{where}: loading adapters at run time is off for this model (allow_runtime_lora)")
        root = None
        if from_request:
            local, root = runtime_path(path, self.roots)
        else:
            if not isinstance(path, str) or not path:
                raise RequestError(f"{where}: must be a non-empty string, got {path!r}")
            try:
                local = resolve_path(path, where, self.base_dir)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        current = self._known.get(name)
        if current is not None and os.path.realpath(current) != os.path.realpath(local):
            if name in self._configured:
                # the configured folder is not named: requests never see the server's paths
                raise RequestError(f"{where}: LoRA adapter {name!r} is configured from another folder; use another "
                                   "lora_name")
            # a name registered at run time follows its latest path (the OpenAI front's unload + load); requests
            # in flight keep the adapter they started with, and pages are keyed by content, never shared
            self._resident.pop(name, None)
        self._known[name] = local
        if root is not None:
            self._shown[name] = root
        else:
            self._shown.pop(name, None)

    def register(self, name, path) -> LoraAdapter:
        """Run-time load (validated at once): the name then serves requests like a configured one."""
        check_lora_name(name)
        with self._lock:
            known_before = name in self._known
            self._register_locked(name, path, "lora_path")
            try:
                return self._load(name)
            except LoraError as exc:
                if not known_before:
                    self._known.pop(name, None)
                raise RequestError(f"lora_path: {exc}") from None

    def unregister(self, name) -> None:
        check_lora_name(name)
        with self._lock:
            if name not in self._known:
                raise RequestError(f"lora_name: unknown LoRA adapter {name!r}")
            if name in self._configured:
                raise RequestError(f"lora_name: LoRA adapter {name!r} is configured (lora_modules / "
                                   "multi_lora.json); it cannot be unloaded at run time")
            self._known.pop(name)
            self._shown.pop(name, None)
            self._resident.pop(name, None)
