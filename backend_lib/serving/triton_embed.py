"""The Triton embedding and rerank models (qwen3_embed, qwen3_rerank): not decoupled, dynamically batched.

One class serves both; the `task` parameter of config.pbtxt says which (embed: a Qwen3-Embedding checkpoint,
rerank: a Qwen3-Reranker one) and so which inputs and outputs it declares (schema.py EMBED_* / RERANK_*).
A dynamic batch's requests are checked one by one (a bad one gets its own INVALID_ARG error naming the input,
the others their results), then every good one runs in one ragged forward (backend_lib/embedding/model.py), where
each text's vector is the bits it gets alone. Errors never carry tracebacks or paths (those go to the log).

Parameters: those of backend_lib.embedding.model.EmbedConfig (checkpoint, task, dtype, device, max_model_len,
max_batch_tokens, ...), each overridable by $<MODEL>_<PARAMETER> as the LLM models' are.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ..contract.errors import RequestError
from .log import get_logger, setup as setup_logging
from .launcher import mark_load
from .request import list_values, scalar, text_value
from .schema import EMBED_INPUTS, EMBED_OUTPUTS, RERANK_INPUTS, RERANK_OUTPUTS, declare

log = get_logger()
MAX_TEXT_BYTES = 1 << 20


def _task_of(config: dict) -> str:
    return ((config.get("parameters") or {}).get("task") or {}).get("string_value") or "embed"


def embed_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt parameters with their environment overrides ($QWEN3_EMBED_CHECKPOINT=...)."""
    from ..embedding.model import EmbedConfig

    model_config = json.loads(args["model_config"])
    name = args["model_name"]
    params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    for key in EmbedConfig.__dataclass_fields__:
        env = os.environ.get(f"{name.upper()}_{key.upper()}")
        if env:
            params[key] = env
            log.info("%s: %s from $%s_%s = %s", name, key, name.upper(), key.upper(), env)
    kind = args.get("model_instance_kind", "CPU")
    if kind == "GPU":
        params["device"] = f"cuda:{args.get('model_instance_device_id', '0')}"
    elif params.get("device", "") in ("", "auto"):
        params["device"] = "cpu"
    return params


class TritonEmbedModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        task = _task_of(auto_complete_model_config.as_dict())
        inputs, outputs = (RERANK_INPUTS, RERANK_OUTPUTS) if task == "rerank" else (EMBED_INPUTS, EMBED_OUTPUTS)
        return declare(auto_complete_model_config, inputs, outputs)

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        from ..checkpoint.hub import resolve
        from ..embedding.model import EmbedConfig, EmbeddingModel

        setup_logging(pb_utils)
        self.pb = pb_utils
        self.name = args["model_name"]
        mark_load(self.name, "loading")
        config = json.loads(args["model_config"])
        self.batched = config.get("max_batch_size", 0) > 0
        try:
            params = embed_parameters(args)
            for key in ("checkpoint", "tokenizer"):   # a folder (relative to the model's) or a Hub id
                if params.get(key):
                    params[key] = resolve(params[key], key, args["model_repository"])
            cfg = EmbedConfig.from_params(params)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        self.task = cfg.task
        self.model = EmbeddingModel(cfg)
        from .embed_metrics import EmbedMetrics

        self.metrics = EmbedMetrics(pb_utils, {"model": self.name, "version": str(args.get("model_version") or "1")})
        mark_load(self.name, "ready")
        log.info("%s: %s model from %s (max_model_len %d)", self.name, cfg.task, cfg.checkpoint,
                 self.model.max_model_len)

    # ----- one request's inputs -------------------------------------------------------------------------
    def _get(self, request, name):
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _text(self, request, name):
        arr = self._get(request, name)
        return None if arr is None else text_value(name, scalar(name, arr), MAX_TEXT_BYTES)

    def _embed_item(self, request) -> tuple[list[int], int | None]:
        m = self.model
        text, ids_arr = self._text(request, "text_input"), self._get(request, "input_ids")
        prompt_name = self._text(request, "prompt_name")
        dims = self._get(request, "dimensions")
        d = None if dims is None else int(scalar("dimensions", dims))
        m.check_dimensions(d)
        if (text is None) == (ids_arr is None):
            raise RequestError("text_input or input_ids: send one of them")
        if ids_arr is not None:
            if prompt_name is not None:
                raise RequestError("prompt_name: only with text_input (input_ids are taken as they are)")
            ids = [int(i) for i in list_values("input_ids", ids_arr)]
            m.check_ids(ids, "input_ids")
        else:
            if not text:
                raise RequestError("text_input: is empty")
            ids = m.encode(text, m.spec.prompt(prompt_name))
            m.check_ids(ids, "text_input")
        return ids, d

    def _rerank_item(self, request) -> tuple[list[int], None]:
        query, doc = self._text(request, "query"), self._text(request, "document")
        for name, value in (("query", query), ("document", doc)):
            if value is None:
                raise RequestError(f"{name}: is required")
        ids = self.model.rerank_ids(query, doc, self._text(request, "instruction"))
        self.model.check_ids(ids, "document")
        return ids, None

    def _out(self, name: str, arr: np.ndarray):
        return self.pb.Tensor(name, arr[None, :] if self.batched else arr)

    def execute(self, requests):
        pb = self.pb
        t0 = time.perf_counter()
        responses: list = [None] * len(requests)
        items, where = [], []
        parse = self._rerank_item if self.task == "rerank" else self._embed_item
        for i, request in enumerate(requests):   # each request on its own: one bad request never fails the batch
            try:
                items.append(parse(request))
                where.append(i)
            except RequestError as exc:
                responses[i] = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(
                    str(exc), pb.TritonError.INVALID_ARG))
            except Exception:
                log.exception("%s: request failed", self.name)
                responses[i] = self._internal()
        answered = False
        if items:
            try:
                seqs = [ids for ids, _ in items]
                if self.task == "rerank":
                    values = [np.array([s], dtype=np.float32) for s in self.model.rerank(seqs)]
                    out_name = "score"
                else:
                    values = [v.numpy() for v in self.model.embed(seqs, [d for _, d in items])]
                    out_name = "embedding"
                for i, (ids, _), value in zip(where, items, values):
                    responses[i] = pb.InferenceResponse(output_tensors=[
                        self._out(out_name, value), self._out("num_input_tokens", np.array([len(ids)], np.uint32))])
                answered = True
            except Exception:
                log.exception("%s: forward failed", self.name)
                for i in where:
                    responses[i] = self._internal()
        tokens = sum(len(ids) for ids, _ in items) if answered else 0
        self.metrics.record(tokens, len(where) if answered else 0, len(requests) - (len(where) if answered else 0))
        log.debug("%s: %d requests (%d tokens) in %.1f ms", self.name, len(requests), tokens,
                  (time.perf_counter() - t0) * 1e3)
        return responses

    def finalize(self):
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop()

    def _internal(self):
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(
            f"internal error in the {self.task} model (logged by the server)", pb.TritonError.INTERNAL))
