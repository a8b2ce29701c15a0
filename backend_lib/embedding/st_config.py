"""What a checkpoint's sentence-transformers files say about its embeddings (torch-free).

    modules.json                       the pipeline: Transformer, Pooling, Normalize (any other module is refused)
    1_Pooling/config.json              the pooling: lasttoken (Qwen3-Embedding), mean or cls; include_prompt
    config_sentence_transformers.json  prompts by name ({"query": "Instruct: ...\\nQuery:", "document": ""}),
                                       default_prompt_name, similarity_fn_name (cosine / dot only)
    sentence_bert_config.json          max_seq_length (tokens per input)
    tokenizer_config.json              padding_side (only matters to padded batches; ours are ragged)

A folder without modules.json is read as Qwen3-Embedding's own pipeline (last token, normalized) so a bare
Qwen3 checkpoint can be served as an embedding model too; a pooling mode or module this library does not compute
is a CheckpointError naming the file and the key, never ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.errors import CheckpointError
from ..contract.errors import RequestError

POOLINGS = ("lasttoken", "mean", "cls")
_MODULES = {
    "sentence_transformers.models.Transformer": "transformer",
    "sentence_transformers.models.Pooling": "pooling",
    "sentence_transformers.models.Normalize": "normalize",
    # sentence-transformers >= 5 names its modules by their new home too
    "sentence_transformers.base.modules.Transformer": "transformer",
    "sentence_transformers.base.modules.Pooling": "pooling",
    "sentence_transformers.base.modules.Normalize": "normalize",
}
_POOLING_KEYS = {
    "pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": None, "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: unreadable ({exc})") from None
    if not isinstance(data, (dict, list)):
        raise CheckpointError(f"{path.name}: must be a JSON object")
    return data


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: str = "lasttoken"
    normalize: bool = True
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    max_seq_length: int | None = None
    padding_side: str = "left"
    dimension: int | None = None          # word_embedding_dimension of the pooling config

    @classmethod
    def from_dir(cls, folder: str | Path) -> "EmbeddingSpec":
        folder = Path(folder)
        kwargs: dict = {}
        modules_path = folder / "modules.json"
        if modules_path.is_file():
            modules = _read(modules_path)
            if not isinstance(modules, list):
                raise CheckpointError("modules.json: must be a JSON list of modules")
            kinds = []
            pooling_dir = None
            for i, m in enumerate(modules):
                kind = _MODULES.get(m.get("type")) if isinstance(m, dict) else None
                if kind is None:
                    raise CheckpointError(f"modules.json[{i}]: module type {m.get('type') if isinstance(m, dict) else m!r} "
                                          f"is not supported (supported: Transformer, Pooling, Normalize)")
                kinds.append(kind)
                if kind == "pooling":
                    pooling_dir = folder / str(m.get("path") or "1_Pooling")
            if kinds[:1] != ["transformer"] or kinds.count("pooling") != 1 or kinds.count("normalize") > 1 or \
                    ("normalize" in kinds and kinds.index("normalize") < kinds.index("pooling")):
                raise CheckpointError(f"modules.json: {kinds} is not Transformer, Pooling[, Normalize]")
            kwargs["normalize"] = "normalize" in kinds
            pool = _read(pooling_dir / "config.json")
            modes = [name for key, name in _POOLING_KEYS.items() if pool.get(key)]
            unsupported = [key for key, name in _POOLING_KEYS.items() if pool.get(key) and name is None]
            if unsupported or len(modes) != 1:
                raise CheckpointError(f"{pooling_dir.name}/config.json: pooling {unsupported or modes or 'none'} is not "
                                      f"supported (exactly one of {', '.join(POOLINGS)})")
            kwargs["pooling"] = modes[0]
            kwargs["include_prompt"] = bool(pool.get("include_prompt", True))
            if pool.get("word_embedding_dimension") is not None:
                kwargs["dimension"] = int(pool["word_embedding_dimension"])
        st_path = folder / "config_sentence_transformers.json"
        if st_path.is_file():
            st = _read(st_path)
            prompts = st.get("prompts") or {}
            if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in prompts.items()):
                raise CheckpointError("config_sentence_transformers.json: prompts must map names to strings")
            kwargs["prompts"] = dict(prompts)
            default = st.get("default_prompt_name")
            if default is not None and default not in prompts:
                raise CheckpointError(f"config_sentence_transformers.json: default_prompt_name {default!r} is not "
                                      "one of its prompts")
            kwargs["default_prompt_name"] = default
            sim = st.get("similarity_fn_name") or "cosine"
            if sim not in ("cosine", "dot"):
                raise CheckpointError(f"config_sentence_transformers.json: similarity_fn_name {sim!r} is not "
                                      "supported (cosine, dot)")
            kwargs["similarity"] = sim
        sb_path = folder / "sentence_bert_config.json"
        if sb_path.is_file():
            sb = _read(sb_path)
            if sb.get("max_seq_length") is not None:
                kwargs["max_seq_length"] = int(sb["max_seq_length"])
        tc_path = folder / "tokenizer_config.json"
        if tc_path.is_file():
            side = _read(tc_path).get("padding_side") or "left"
            kwargs["padding_side"] = side
        spec = cls(**kwargs)
        if not spec.include_prompt and spec.pooling != "lasttoken":   # the last token is never the prompt's
            raise CheckpointError("1_Pooling/config.json: include_prompt false is supported with lasttoken only")
        return spec

    def prompt(self, name: str | None) -> str:
        """The prompt prepended to a text: by name, else the default one, else none."""
        if name is None:
            name = self.default_prompt_name
            if name is None:
                return ""
        if name not in self.prompts:
            raise RequestError(f"prompt_name: {name!r} is not one of the model's prompts "
                               f"({', '.join(map(repr, self.prompts)) or 'none'})")
        return self.prompts[name]
