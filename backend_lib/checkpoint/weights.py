"""safetensors weights of a checkpoint folder: one file or shards, memory-mapped, never pickle."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

log = logging.getLogger(__name__)


class WeightStore:
    """Name -> tensor over the folder's safetensors files (read lazily through mmap)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index.name}: unreadable weight_map ({exc})") from None
            for name, fname in weight_map.items():
                path = self.folder / fname
                if not path.is_file():
                    raise CheckpointError(f"{index.name}: shard {fname} (holding {name}) is missing")
                self._file_of[name] = path
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                pickles = [p.name for p in self.folder.glob("*.bin")] + [p.name for p in self.folder.glob("*.pt")]
                hint = f" (found {pickles}; pickle checkpoints are never loaded, convert to safetensors)" if pickles else ""
                raise CheckpointError(f"checkpoint folder {self.folder} has no *.safetensors files{hint}")
            for path in files:
                for name in self._open(path).keys():
                    self._file_of[name] = path
        log.info("checkpoint %s: %d tensors in %d safetensors file(s)", self.folder, len(self._file_of),
                 len(set(self._file_of.values())))

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"{path.name}: not a readable safetensors file ({exc})") from None
            self._handles[path] = handle
        return handle

    def release(self) -> None:
        """Closes the open files. A tensor read through a handle is a view of the file's mapping, and the
        mapping (with every page read so far counted in the process's RSS) lives while the handle or any
        such view does: the loader copies what it keeps and releases the store as it goes, so the
        checkpoint is never resident beside the packed weights. Reads reopen a file as needed."""
        self._handles.clear()

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple[torch.dtype, ...] | None = None,
            ) -> torch.Tensor:
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        try:
            tensor = self._open(path).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path.name}: tensor {name!r} could not be read ({exc})") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
        if dtypes is not None and tensor.dtype not in dtypes:
            raise CheckpointError(
                f"tensor {name!r} has dtype {tensor.dtype}, expected one of {[str(d) for d in dtypes]}")
        return tensor
