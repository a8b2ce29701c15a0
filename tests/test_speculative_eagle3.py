"""EAGLE-3 heads (backend_lib/spec/eagle3.py): the public layout loaded and refused by field / tensor, and the
engine's output with an EAGLE-3 head compared id for id (and logprob for logprob) with the same engine without
speculation. Two heads built by tools/make_eagle3_head.py: a random one (it accepts next to nothing: the test
then proves that drafts cannot change the output) and the `copy` one, a hand-built induction head in the same
layout (aux layer 0 = the target's embeddings through fc; it drafts what followed the current token earlier),
whose drafts are accepted where the random demo weights fall into loops (about 12 of 26 verifications of a
40-token greedy run of "a b a b ..."): the comparisons with it require accepted drafts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend_lib.checkpoint import ModelConfig
from backend_lib.config import EngineConfig
from backend_lib.spec import parse_speculative_config
from backend_lib.spec.eagle3 import Eagle3Config, Eagle3Error, load_eagle3_head
from backend_lib.tools.make_eagle3_head import build as build_head
from helpers import make_engine

PROMPTS = ["Hello, world!", "a b a b a b a b a b a b", "介绍一下北京故宫", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"]
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
SEEDED = {"temperature": 0.3, "top_p": 0.95, "top_k": 50, "seed": 11, "max_tokens": 40, "ignore_eos": True}


def spec(head, k=3, **kw):
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                       "auto_disable_from_batch": None, **kw})   # gate off: drafts counted here (test_spec_gate.py)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, bf16_ckpt):
    root = tmp_path_factory.mktemp("eagle3")
    return {"random": build_head(bf16_ckpt, root / "random", 32000, aux_layers=[0, 1, 2]),
            "speculators": build_head(bf16_ckpt, root / "speculators", 1000, layout="speculators",
                                      aux_layers=[0, 1, 2], embed=True, seed=1),
            "copy": build_head(bf16_ckpt, root / "copy", copy=True),
            "default_ids": build_head(bf16_ckpt, root / "default_ids", 32000),
            "root": root}


# ----- the layout -----------------------------------------------------------------------------------------
def test_both_public_layouts_load_with_their_fields(heads, bf16_ckpt):
    mc = ModelConfig.from_dir(bf16_ckpt)
    cfg = json.loads((heads["random"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    from safetensors import safe_open
    with safe_open(str(heads["random"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_tensor("fc.weight").shape) == (mc.hidden_size, 3 * mc.hidden_size)
        assert tuple(f.get_tensor("midlayer.self_attn.q_proj.weight").shape)[1] == 2 * mc.hidden_size
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert "embed_tokens.weight" not in names and "lm_head.weight" in names
    calls = []
    embed = lambda ids: (calls.append(len(ids)), torch.zeros(len(ids), mc.hidden_size))[1]  # noqa: E731
    head = load_eagle3_head(heads["random"], mc, torch.float32, torch.device("cpu"), embed=embed)
    assert head.aux_layers == (0, 1, 2) and head.cfg.layer_prefix == "midlayer" and head.cfg.draft_vocab_size == 32000
    head.embed(torch.tensor([1, 2]))
    assert calls == [2]        # no embed_tokens.weight: the target's embedding
    # d2t: every draft id lands on a target id t2d marks, in order
    with safe_open(str(heads["random"] / "model.safetensors"), "pt") as f:
        t2d = f.get_tensor("t2d")
    assert bool(t2d[head.d2t_full].all()) and bool((head.d2t_full.diff() > 0).all())
    normed = torch.randn(5, mc.hidden_size)
    draft = torch.nn.functional.linear(normed, head.w["lm_head"]).argmax(-1)
    assert head.draft_ids(normed).tolist() == (draft + head.w["d2t"][draft]).tolist()
    # the speculators layout: layers.0.*, transformer_layer_config, its own embed_tokens
    sp = load_eagle3_head(heads["speculators"], mc, torch.float32, torch.device("cpu"), embed=embed)
    assert sp.cfg.layer_prefix == "layers.0" and sp.cfg.draft_vocab_size == 1000 and "embed" in sp.w
    assert Eagle3Config.from_dir(heads["default_ids"]).aux_layer_ids is None
    assert Eagle3Config.from_dir(heads["default_ids"]).aux_layers(36) == (2, 18, 33)   # vLLM's for Qwen3-8B


def _edit(heads, name, config=None, tensors=None, drop=()):
    """A copy of the random head with config fields set and tensors replaced / dropped."""
    from safetensors.torch import load_file, save_file

    out = heads["root"] / f"edit-{name}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(heads["random"], out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in (config or {}).items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(out / "model.safetensors"))
    t.update(tensors or {})
    for d in drop:
        t.pop(d)
    save_file(t, str(out / "model.safetensors"))
    return out


BAD = [
    ("arch", {"architectures": ["LlamaForCausalLM"]}, None, (), "architectures"),
    ("layers", {"num_hidden_layers": 2}, None, (), "num_hidden_layers"),
    ("hidden", {"target_hidden_size": 128}, None, (), "target_hidden_size"),
    ("vocab", {"vocab_size": 32000, "draft_vocab_size": 32000}, None, (), "vocab_size"),
    ("ids_dup", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}, None, (),
     "eagle_aux_hidden_state_layer_ids"),
    ("ids_far", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}, None, (),
     "eagle_aux_hidden_state_layer_ids"),
    ("no_aux", {"eagle_config": {"use_aux_hidden_state": False}}, None, (), "use_aux_hidden_state"),
    ("fc", None, {"fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}, (), "fc.weight"),
    ("qkv", None, {"midlayer.self_attn.q_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16)}, (),
     "midlayer.self_attn.q_proj.weight"),
    ("lm_head", None, None, ("lm_head.weight",), "lm_head.weight"),
    ("d2t", None, {"d2t": torch.full((32000,), 151936, dtype=torch.int64)}, (), "d2t"),
    ("no_d2t", None, None, ("d2t",), "d2t"),
    ("t2d", None, {"t2d": torch.ones(151936, dtype=torch.bool)}, (), "t2d"),
    ("extra", None, {"midlayer.self_attn.q_norm.weight": torch.ones(32, dtype=torch.bfloat16)}, (),
     "midlayer.self_attn.q_norm.weight"),
    ("embed", {"hidden_size": 32, "head_dim": 16, "intermediate_size": 96, "target_hidden_size": 64}, None, (),
     "embed_tokens.weight"),
]


@pytest.mark.parametrize("name, config, tensors, drop, needle", BAD, ids=[b[0] for b in BAD])
def test_a_head_for_another_target_is_refused_naming_the_field_or_tensor(heads, bf16_ckpt, name, config, tensors,
                                                                         drop, needle):
    folder = _edit(heads, name, config, tensors, drop)
    mc = ModelConfig.from_dir(bf16_ckpt)
    with pytest.raises(Eagle3Error) as e:
        load_eagle3_head(folder, mc, torch.float32, torch.device("cpu"), embed=lambda ids: None)
    assert needle in str(e.value) and "speculative_config.model" in str(e.value), str(e.value)


def test_the_engine_refuses_at_load_naming_the_key(heads, bf16_ckpt):
    with pytest.raises(ValueError, match="speculative_config.model") as e:
        make_engine(bf16_ckpt, speculative_config=spec(heads["default_ids"]))
    assert "eagle_aux_hidden_state_layer_ids" in str(e.value)   # (2, 1, -1): a 2-layer target has no default
    with pytest.raises(ValueError, match="speculative_config.model"):
        make_engine(bf16_ckpt, speculative_config=spec(heads["root"] / "missing"))
    for value, key in (({"method": "eagle3", "num_speculative_tokens": 3}, "speculative_config.model"),
                       ({"method": "eagle3", "model": "", "num_speculative_tokens": 3}, "speculative_config.model"),
                       ({"method": "eagle3", "model": str(heads["random"]), "num_speculative_tokens": 3,
                         "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
                       ({"method": "eagle3", "model": "x", "num_speculative_tokens": 0},
                        "speculative_config.num_speculative_tokens")):
        with pytest.raises(ValueError, match=key):
            parse_speculative_config(value)
    # tensor parallel is no refusal (tests/test_tensor_parallel.py runs EAGLE-3 at TP = 2)
    tp = EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "tensor_parallel_size": "2",
                                   "speculative_config": spec(heads["random"])})
    assert tp.tensor_parallel_size == 2 and tp.speculative.method == "eagle3"
    # a relative head folder resolves against the model's folder, as the checkpoint does
    cfg = EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "speculative_config": spec("random")},
                                   base_dir=str(heads["root"]))
    assert cfg.speculative.model == str(heads["random"])


# ----- the engine: ids (and logprobs) with an EAGLE-3 head equal ids without -------------------------------------
@pytest.fixture(scope="module")
def copy_engine(heads, bf16_ckpt):
    return make_engine(bf16_ckpt, speculative_config=spec(heads["copy"], k=3, min_acceptance=0.0))


@pytest.fixture(scope="module")
def random_engine(heads, bf16_ckpt):
    return make_engine(bf16_ckpt, speculative_config=spec(heads["random"], k=2))


def _run(engine, prompts, datas):
    datas = datas if isinstance(datas, list) else [datas] * len(prompts)
    for i, (p, d) in enumerate(zip(prompts, datas)):
        engine.add_request(f"r{i}", p, engine.make_params(d))
    outs = []
    while engine.has_unfinished():
        outs += [(o.request_id, o.new_token_ids, o.new_text, o.new_logprobs, o.finish_reason) for o in engine.step()]
    return sorted(outs, key=lambda o: o[0])   # each request's deltas, in order


def _compare(off, on, prompts, datas, min_accepted=1):
    before = on.stats.spec_num_accepted_tokens
    assert _run(on, prompts, datas) == _run(off, prompts, datas)
    accepted = on.stats.spec_num_accepted_tokens - before
    assert accepted >= min_accepted, "no draft was accepted: the test exercised no accepted verification"
    assert on.block_manager.num_used == 0 and not on._seqs   # every page back
    return accepted


def _prompts(engine):
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def test_copy_head_greedy_and_seeded_alone_and_batched_equal_plain_decoding(bf16_engine, copy_engine):
    prompts = _prompts(bf16_engine)
    s0 = copy_engine.stats
    _compare(bf16_engine, copy_engine, prompts[:1], {**GREEDY, "logprobs": 2})          # alone
    _compare(bf16_engine, copy_engine, prompts, {**GREEDY, "logprobs": 0})              # batched
    _compare(bf16_engine, copy_engine, prompts, [{**SEEDED, "seed": 11 + i} for i in range(4)])
    s = copy_engine.stats
    drafts = s.spec_num_drafts - s0.spec_num_drafts
    accepted = s.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    assert drafts > 100 and accepted >= 10, (drafts, accepted)
    assert s.spec_accepted_per_pos[1] > (s0.spec_accepted_per_pos or (0, 0))[1]   # runs of two accepted drafts


def test_random_head_equals_plain_decoding_and_accepts_little(bf16_engine, random_engine):
    prompts = _prompts(bf16_engine)
    s0 = random_engine.stats
    _compare(bf16_engine, random_engine, prompts, [GREEDY, SEEDED, {**GREEDY, "logprobs": 1}, SEEDED],
             min_accepted=0)
    s = random_engine.stats
    drafts, drafted = s.spec_num_drafts - s0.spec_num_drafts, s.spec_num_draft_tokens - s0.spec_num_draft_tokens
    assert s.spec_num_accepted_tokens - s0.spec_num_accepted_tokens <= 0.2 * drafted
    # auto-disable: a window of 16 drafted tokens (8 verifications of 2) without acceptance pauses each request
    # for 32 tokens, the rest of its 40
    assert 0 < drafts <= 4 * 8 + 4, drafts


def test_stop_strings_max_tokens_and_opt_outs_inside_accepted_runs(bf16_engine, copy_engine):
    p = _prompts(bf16_engine)[1]
    plain = _run(bf16_engine, [p], GREEDY)
    full, text = [t for o in plain for t in o[1]], "".join(o[2] for o in plain)
    for cut in (7, 8, 9):
        _compare(bf16_engine, copy_engine, [p], {**GREEDY, "max_tokens": cut}, min_accepted=0)
    got = _run(copy_engine, [p], {**GREEDY, "max_tokens": 9})
    assert [t for o in got for t in o[1]] == full[:9] and got[-1][4] == "length"
    stop = text[len(text) * 3 // 4:][:3]
    assert stop.strip()
    _compare(bf16_engine, copy_engine, [p, p], [{**GREEDY, "stop": [stop]}, {**GREEDY, "speculative": "off"}])
    _compare(bf16_engine, copy_engine, [p], {**GREEDY, "stop_token_ids": [full[30]]}, min_accepted=0)


def test_mixed_with_long_prefills_and_the_prefix_cache(bf16_engine, copy_engine):
    """Prefill chunks (64-token budget) beside verifications; a second request whose prompt is cached: the head
    has no target rows for the cached positions and starts at the first one the target computes."""
    prompts = _prompts(bf16_engine)
    long_prompt = bf16_engine.tokenizer.encode("Speculative decoding keeps the output. " * 12)
    _compare(bf16_engine, copy_engine, [prompts[1], long_prompt, prompts[3]], [GREEDY, SEEDED, GREEDY])
    hits = copy_engine.stats.prefix_cache_hits
    _compare(bf16_engine, copy_engine, [long_prompt + prompts[0]], GREEDY)
    assert copy_engine.stats.prefix_cache_hits > hits


def test_head_state_is_freed_with_its_sequence_and_on_preemption(bf16_ckpt, bf16_engine, heads):
    on = make_engine(bf16_ckpt, kv_cache_memory=12 * 16 * 1024, max_model_len=192, max_num_seqs=4,
                     speculative_config=spec(heads["copy"], k=3, min_acceptance=0.0))
    assert on.runner.kv_cache.num_pages == 12
    prompts = _prompts(bf16_engine)
    datas = [{**GREEDY, "max_tokens": 60}, {**SEEDED, "max_tokens": 60}, {**GREEDY, "max_tokens": 64},
             {**SEEDED, "seed": 8, "max_tokens": 60}]
    for i, (p, d) in enumerate(zip(prompts, datas)):
        on.add_request(f"keep{i}", p, on.make_params(d))
    seqs = list(on._seqs.values())
    while on.has_unfinished():
        on.step()
    assert on.stats.num_preemptions > 0
    assert all(s.spec_state is not None and s.spec_state.proposer.k is None and not s.spec_state.proposer.pend
               for s in seqs)   # the head's KV and pending rows went with the sequences
    _compare(bf16_engine, on, prompts, datas)


def test_the_a8w8_layer_loop_target_is_unchanged_by_the_aux_capture(a8w8_ckpt, tmp_path):
    """The A8W8 target runs its C++ layer loop with a head too (forward_aux: the op writes the aux states, its
    few-row steps in the one region, counted by its profile): the same ids and logprobs as without one (bf16,
    the served configuration). Every step's bits against the Python loop: tests/test_layer_loop.py."""
    head = build_head(a8w8_ckpt, tmp_path / "copy", copy=True)
    off = make_engine(a8w8_ckpt, dtype="bfloat16")
    on = make_engine(a8w8_ckpt, dtype="bfloat16", speculative_config=spec(head, k=3, min_acceptance=0.0))
    assert off.runner.model.layer_loop.applies(off.runner.kv_cache)
    prompts = _prompts(off)
    datas = [{**GREEDY, "logprobs": 2}, SEEDED, GREEDY, {**SEEDED, "seed": 3, "logprobs": 0}]
    expected = _run(off, prompts, datas)
    before = on.stats.spec_num_accepted_tokens
    torch.ops.qwen3_cpu.decode_layers_profile(True)
    got = _run(on, prompts, datas)
    in_region = torch.ops.qwen3_cpu.decode_layers_profile(False)[0, -1].item()
    assert got == expected and on.stats.spec_num_accepted_tokens > before
    assert on.block_manager.num_used == 0 and not on._seqs
    assert in_region >= 20   # the head's steps (verifications, decodes, short prefills) in the region


def test_a_failing_head_drafts_nothing_and_the_requests_go_on(bf16_engine, heads, bf16_ckpt, monkeypatch):
    on = make_engine(bf16_ckpt, speculative_config=spec(heads["copy"], k=3, min_acceptance=0.0))
    head = on.spec.proposer.head
    calls = {"n": 0}
    real = head.forward

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected head fault")
        return real(*a, **kw)
    monkeypatch.setattr(head, "forward", flaky)
    prompts = _prompts(bf16_engine)[1:]
    _compare(bf16_engine, on, prompts, [GREEDY, SEEDED, GREEDY], min_accepted=0)
    assert calls["n"] >= 6 and on.stats.spec_num_drafts > 0
