"""LoRA adapters as models of the OpenAI front, vLLM's way: `--lora-modules name=path` at start, and
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` at run time; an adapter's name is usable as `model`
and `/v1/models` lists it with its `parent` (the Triton LLM model it runs on) and `root` (its path).

A request for an adapter goes to its parent with `lora_name` and `lora_path` in sampling_parameters: the Triton
model loads the adapter on first use (its `allow_runtime_lora` parameter must be true; an adapter given without
a path is one the Triton model already serves by name, and only `lora_name` is sent), keeps at most
`max_loras` resident and evicts the least recently used (docs/lora.md). A load is checked at once: the front
sends the parent a one-token request with the adapter, so a malformed adapter is a 400 naming the field at load,
not at the first real request.
"""
from __future__ import annotations

import os

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import check_lora_name
from client.triton_inputs import build_inputs
from .errors import APIError, bad_request
from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def parse_lora_modules_arg(values: list[str] | None) -> dict[str, tuple[str, str | None]]:
    """--lora-modules entries: `name=path` or a JSON object {"name", "path", "base_model_name"?} (vLLM's forms)."""
    out: dict[str, tuple[str, str | None]] = {}
    for value in values or []:
        if value.strip().startswith("{"):
            from backend_lib.contract.json_input import loads

            entry = loads(value, "--lora-modules")
            if not isinstance(entry, dict) or set(entry) - {"name", "path", "base_model_name"} or not isinstance(
                    entry.get("name"), str) or not isinstance(entry.get("path", ""), str):
                raise ValueError(f"--lora-modules: {value!r} is not {{\"name\": ..., \"path\": ..., "
                                 "\"base_model_name\": ...}")
            # without a path: an adapter its Triton model already serves (lora_modules / multi_lora.json)
            name, path, parent = entry["name"], entry.get("path") or None, entry.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
            parent = None
        try:
            check_lora_name(name, "--lora-modules")
        except RequestError as exc:
            raise ValueError(str(exc)) from None
        if name in out:
            raise ValueError(f"--lora-modules: adapter {name!r} is named twice")
        out[name] = (path, parent)
    return out


class LoraAdapters:
    """name -> (path, parent model); parent None: the default (--lora-base-model, else the first LLM model); path
    None: an adapter the parent serves by name (only lora_name is sent, so it needs no allow_runtime_lora)."""

    def __init__(self, modules: dict[str, tuple[str | None, str | None]] | None = None,
                 default_parent: str | None = None):
        self._adapters = dict(modules or {})
        self._loading: set[str] = set()   # names a load is checking now: a second load of one is refused
        self.default_parent = default_parent

    def __contains__(self, name) -> bool:
        return name in self._adapters

    async def _parent(self, gateway, parent: str | None) -> str:
        if parent is not None:
            return parent
        if self.default_parent is not None:
            return self.default_parent
        models = await gateway.llm_models()
        if not models:
            raise APIError(503, "no LLM model is ready to run LoRA adapters on", type="server_error")
        return models[0]

    async def route(self, gateway, gen) -> None:
        """A generation for an adapter runs on its parent with the adapter named in sampling_parameters."""
        entry = self._adapters.get(gen.model)
        if entry is None:
            return
        path, parent = entry
        gen.sampling["lora_name"] = gen.model
        if path is not None:   # else the parent serves it by name (its lora_modules / multi_lora.json)
            gen.sampling["lora_path"] = path
        gen.model = await self._parent(gateway, parent)

    async def cards(self, gateway) -> list[dict]:
        """vLLM's cards; `root` is the path only when it is relative (to the parent's lora_roots): the server's
        absolute paths are never shown to API clients."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "triton",
                 "root": path if path is not None and not os.path.isabs(path) else None,
                 "parent": await self._parent(gateway, parent)} for name, (path, parent) in self._adapters.items()]

    async def load(self, gateway, body: LoadLoRAAdapterRequest) -> str:
        name, path, parent = body.lora_name, body.lora_path, body.base_model_name
        if name in self._adapters:
            raise bad_request(f"lora_name: the LoRA adapter '{name}' has already been loaded", "lora_name")
        if name in self._loading:   # two loads of one new name: the first one decides, the other is told
            raise bad_request(f"lora_name: the LoRA adapter '{name}' is being loaded by another request", "lora_name")
        self._loading.add(name)
        try:
            target = await self._parent(gateway, parent)
            if name in await gateway.model_names():   # any served model: an LLM, the tokenizer, an ensemble
                raise bad_request(f"lora_name: '{name}' is the name of a model", "lora_name")
            await gateway.require_llm(target)
            # one token with the adapter: the parent loads and validates it now (a 400 naming the field if it fails)
            stream = gateway.stream(target, build_inputs(None, [0], stream=True, max_tokens=1, sampling_parameters={
                "lora_name": name, "lora_path": path, "temperature": 0}))
            try:
                async for _ in stream:
                    pass
            finally:
                stream.close()
            self._adapters[name] = (path, parent)
        finally:
            self._loading.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        name = body.lora_name
        if name not in self._adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        del self._adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

