"""Hugging Face model ids as `checkpoint` / `tokenizer`: resolved through huggingface_hub's cache, built here in the
hub's own layout; never the network."""
from __future__ import annotations

import time

import pytest
from huggingface_hub import constants

from backend_lib.checkpoint.hub import parse_hub_id
from backend_lib.config import EngineConfig
from helpers import make_engine, make_hub_cache

REV1, REV2 = "1" * 40, "2" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch, bf16_ckpt):
    """An offline hub cache holding test-org/qwen3-tiny at two revisions (main -> REV1)."""
    cache = tmp_path / "hub"
    make_hub_cache(cache, "test-org/qwen3-tiny", bf16_ckpt, REV1)
    make_hub_cache(cache, "test-org/qwen3-tiny", bf16_ckpt, REV2, refs=("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_form():
    assert parse_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_hub_id("RedHatAI/Qwen3-8B-quantized.w8a8@9c925d64d72725edaf899c6cb9c377fd0709d9c5") == (
        "RedHatAI/Qwen3-8B-quantized.w8a8", "9c925d64d72725edaf899c6cb9c377fd0709d9c5")
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_an_id in ("../../demo_checkpoints/qwen3-0.6b-a8w8", "./org/name", "a/b/c", "name", "org/na..me",
                      "org--x/name", "org/name@"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_hub_id_resolves_to_its_snapshot_and_serves_the_same_ids_as_the_folder(hub, bf16_ckpt, bf16_engine):
    cfg = EngineConfig.from_params({"checkpoint": "test-org/qwen3-tiny", "tokenizer": f"test-org/qwen3-tiny@{REV2}"},
                                   base_dir=str(bf16_ckpt.parent))
    snapshots = hub / "models--test-org--qwen3-tiny" / "snapshots"
    assert cfg.checkpoint == str(snapshots / REV1)          # refs/main
    assert cfg.tokenizer == str(snapshots / REV2)           # pinned by commit
    assert EngineConfig.from_params({"checkpoint": "test-org/qwen3-tiny@v2"}).checkpoint == str(snapshots / REV2)
    ids, greedy = [11, 22, 33, 44], {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    hub_engine = make_engine(cfg.checkpoint, tokenizer=cfg.tokenizer)
    from_hub = hub_engine.generate([ids], hub_engine.make_params(greedy))
    assert from_hub == bf16_engine.generate([ids], bf16_engine.make_params(greedy))
    assert len(from_hub[0]["output_ids"]) == 6


def test_a_local_folder_wins_over_an_id_of_the_same_name(hub, tmp_path, bf16_ckpt):
    base = tmp_path / "models" / "qwen3_tq"
    (base / "test-org" / "qwen3-tiny").mkdir(parents=True)
    cfg = EngineConfig.from_params({"checkpoint": "test-org/qwen3-tiny"}, base_dir=str(base))
    assert cfg.checkpoint == str(base / "test-org" / "qwen3-tiny")
    assert EngineConfig.from_params({"checkpoint": str(bf16_ckpt)}).checkpoint == str(bf16_ckpt)


@pytest.mark.parametrize("param", ["checkpoint", "tokenizer"])
def test_an_id_missing_from_the_offline_cache_is_an_error_naming_the_parameter(hub, bf16_ckpt, param):
    params = {"checkpoint": str(bf16_ckpt), param: "test-org/absent"}
    with pytest.raises(ValueError, match=rf"^{param}: Hugging Face model 'test-org/absent' is not in the Hub cache "
                                         rf".*HF_HUB_OFFLINE is set"):
        EngineConfig.from_params(params)
    with pytest.raises(ValueError, match=rf"^{param}: .*test-org/qwen3-tiny@{'3' * 40}.*not in the Hub cache"):
        EngineConfig.from_params({**params, param: f"test-org/qwen3-tiny@{'3' * 40}"})


def test_online_without_a_reachable_hub_the_cached_snapshot_is_used_and_a_missing_one_named(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")     # nothing listens: connection refused
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2, raising=False)
    t0 = time.time()
    cfg = EngineConfig.from_params({"checkpoint": "test-org/qwen3-tiny"})
    assert cfg.checkpoint.endswith(REV1)
    with pytest.raises(ValueError, match=r"^checkpoint: Hugging Face model 'test-org/absent' .*cannot be reached"):
        EngineConfig.from_params({"checkpoint": "test-org/absent"})
    assert time.time() - t0 < 60
