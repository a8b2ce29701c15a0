"""LoRA adapters (backend_lib/lora): real PEFT adapters of the tiny checkpoints against transformers + peft, one
batch of many adapters equal to each alone, prefix-cache isolation, the registry's LRU, and hostile adapters
and requests refused naming the file and field."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.config import EngineConfig
from backend_lib.lora import LoraError
from backend_lib.contract.errors import RequestError
from helpers import make_engine, make_hub_cache, make_peft_adapter

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "介绍一下北京故宫",
           "def fib(n):\n    return n"]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, bf16_ckpt):
    """Three PEFT adapters of the bf16 checkpoint: every projection (r 8), a subset with rsLoRA (r 16), MLP only (r 4);
    with the peft models that wrote them."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_peft_adapter(bf16_ckpt, root / "all", r=8, seed=1),
        "qv_rs": make_peft_adapter(bf16_ckpt, root / "qv_rs", r=16, alpha=32, targets=("q_proj", "v_proj"), seed=2,
                                   use_rslora=True, std=0.15),
        "mlp": make_peft_adapter(bf16_ckpt, root / "mlp", r=4, alpha=8, targets=("gate_proj", "up_proj", "down_proj"),
                                 seed=3, std=0.2),
    }


def modules(adapters):
    return {name: str(path) for name, (path, _) in adapters.items()}


@pytest.fixture(scope="module")
def fp32_engine(bf16_ckpt, adapters):
    return make_engine(bf16_ckpt, lora_modules=modules(adapters))


def greedy(engine, max_tokens=16, **kw):
    return engine.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def hf_greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["all", "qv_rs", "mlp"])
def test_greedy_and_logprobs_equal_transformers_with_peft(fp32_engine, adapters, name):
    eng, (_, peft_model) = fp32_engine, adapters[name]
    base = [r["output_ids"] for r in eng.generate([eng.tokenizer.encode(p) for p in PROMPTS], greedy(eng))]
    for prompt, base_ids in zip(PROMPTS, base):
        ids = eng.tokenizer.encode(prompt)
        ours = eng.generate([ids], greedy(eng, lora_name=name))[0]["output_ids"]
        assert ours == hf_greedy(peft_model, ids, 16)
        assert ours != base_ids, "the adapter must change the output, or the comparison shows nothing"
    ids = eng.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        logits = peft_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(eng.score(ids, lora_name=name)[1:]), ref, rtol=0, atol=1e-4)


def test_an_adapter_of_some_layers_equals_peft(tmp_path, bf16_ckpt):
    path, peft_model = make_peft_adapter(bf16_ckpt, tmp_path / "l1", r=8, seed=7, std=0.3, layers_to_transform=[1])
    assert json.loads((path / "adapter_config.json").read_text())["layers_to_transform"] == [1]
    eng = make_engine(bf16_ckpt, lora_modules={"l1": str(path)})
    ids = eng.tokenizer.encode(PROMPTS[3])
    ours = eng.generate([ids], greedy(eng, lora_name="l1"))[0]["output_ids"]
    assert ours == hf_greedy(peft_model, ids, 16)
    assert ours != eng.generate([ids], greedy(eng))[0]["output_ids"]


def test_a8w8_base_equals_the_emulated_reference_with_peft(tmp_path, a8w8_ckpt, bf16_ckpt):
    """The adapter on the A8W8 base: transformers with the int8 weights dequantized exactly and the per-token int8
    activation quantization emulated on every base linear (as tests/test_a8w8_model.py), the adapter through peft
    on the un-quantized input: the same greedy ids."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from backend_lib.kernels.reference import quantize_per_token

    path, _ = make_peft_adapter(bf16_ckpt, tmp_path / "ad", r=8, seed=5, std=0.15)
    model = AutoModelForCausalLM.from_pretrained(str(a8w8_ckpt), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    f = safe_open(str(a8w8_ckpt / "model.safetensors"), "pt")
    quantized = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.weight.data = f.get_tensor(f"{name}.weight").float() * f.get_tensor(f"{name}.weight_scale").float()
            quantized.append(mod)

    def fake_quant(_mod, args):
        q, s = quantize_per_token(args[0].reshape(-1, args[0].shape[-1]))
        return ((q.float() * s).reshape(args[0].shape),)

    for m in quantized:
        m.register_forward_pre_hook(fake_quant)
    ref = PeftModel.from_pretrained(model, str(path)).eval()
    eng = make_engine(a8w8_ckpt, lora_modules={"ad": str(path)})
    changed = 0
    for prompt in PROMPTS:
        ids = eng.tokenizer.encode(prompt)
        ours = eng.generate([ids], greedy(eng, lora_name="ad"))[0]["output_ids"]
        assert ours == hf_greedy(ref, ids, 16)
        changed += ours != eng.generate([ids], greedy(eng))[0]["output_ids"]
    assert changed, "the adapter must change the output"


@pytest.mark.parametrize("which", ["bf16", "a8w8", "gptq-descact-own-perms"])
def test_a_batch_of_three_adapters_and_base_rows_equals_each_alone(which, ckpts, bf16_ckpt, a8w8_ckpt, adapters):
    """On each base kind (W4A16 too: a GPTQ checkpoint whose q/k/v keep their own permutations, not fused)."""
    base = {"bf16": bf16_ckpt, "a8w8": a8w8_ckpt}.get(which) or ckpts.get(
        "tiny-gptq-g32-descact-own-perms", "gptq", group_size=32, desc_act=True, shared_perm=False)
    eng = make_engine(base, dtype="bfloat16", lora_modules=modules(adapters), enable_prefix_caching=False)
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        for lora in (None, "all", "qv_rs", "mlp"):
            kw = {"lora_name": lora} if lora else {}
            seeded = {"temperature": 1.0, "seed": 100 + i} if i % 2 else {}
            jobs.append((eng.tokenizer.encode(prompt), greedy(eng, 12, **kw, **seeded)))
    alone = [eng.generate([ids], p)[0]["output_ids"] for ids, p in jobs]
    together = [r["output_ids"] for r in eng.generate([ids for ids, _ in jobs], [p for _, p in jobs])]
    assert together == alone
    for k in range(0, len(jobs), 4):   # per prompt: the base and each adapter give different tokens
        assert len({tuple(x) for x in alone[k:k + 4]}) == 4


def test_the_prefix_cache_never_shares_pages_between_adapters(bf16_ckpt, adapters):
    eng = make_engine(bf16_ckpt, lora_modules=modules(adapters))
    ids = eng.tokenizer.encode(PROMPTS[1])
    assert len(ids) > 2 * 16
    cold = {lora: eng.generate([ids], greedy(eng, 8, **({"lora_name": lora} if lora else {})))[0]["output_ids"]
            for lora in (None, "all", "mlp")}
    assert eng.stats.prefix_cache_hits == 0, "three different adapters (one the base) must share no page"
    for lora in (None, "all", "mlp"):
        hits = eng.stats.prefix_cache_hits
        again = eng.generate([ids], greedy(eng, 8, **({"lora_name": lora} if lora else {})))[0]["output_ids"]
        assert again == cold[lora]
        assert eng.stats.prefix_cache_hits > hits, "the same adapter reuses its own pages"


def test_registry_keeps_at_most_max_loras_resident_lru(bf16_ckpt, adapters):
    eng = make_engine(bf16_ckpt, lora_modules=modules(adapters), max_loras=2)
    reg = eng.lora
    assert reg.resident() == ["qv_rs", "mlp"]        # all three validated at start; the last two stay
    ids = eng.tokenizer.encode(PROMPTS[0])
    first = eng.generate([ids], greedy(eng, 8, lora_name="all"))[0]["output_ids"]
    assert reg.resident() == ["mlp", "all"]
    eng.generate([ids], greedy(eng, 8, lora_name="mlp"))
    assert reg.resident() == ["all", "mlp"]
    loads = reg.loads
    assert eng.generate([ids], greedy(eng, 8, lora_name="all"))[0]["output_ids"] == first
    assert reg.loads == loads, "a resident adapter is not loaded again"
    eng.generate([ids], greedy(eng, 8, lora_name="qv_rs"))
    assert reg.resident() == ["all", "qv_rs"] and reg.loads == loads + 1
    # evicted while in flight: the running request keeps its adapter
    eng.add_request("r1", ids, greedy(eng, 8, lora_name="mlp"))
    out = [t for o in eng.step() for t in o.new_token_ids]
    eng.make_request("x", ids, greedy(eng, 1, lora_name="all"))
    eng.make_request("y", ids, greedy(eng, 1, lora_name="qv_rs"))
    assert "mlp" not in reg.resident()
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.new_token_ids]
    alone = make_engine(bf16_ckpt, lora_modules={"mlp": modules(adapters)["mlp"]})
    assert out == alone.generate([ids], greedy(alone, 8, lora_name="mlp"))[0]["output_ids"]


def test_runtime_register_unregister_and_lora_path(bf16_ckpt, adapters):
    root = os.path.dirname(modules(adapters)["all"])
    eng = make_engine(bf16_ckpt, enable_lora=True, allow_runtime_lora=True, lora_roots=root)
    ids = eng.tokenizer.encode(PROMPTS[0])
    with pytest.raises(RequestError, match=r"lora_name: unknown LoRA adapter 'all' \(known: none\)"):
        eng.make_params({"lora_name": "all"}) and eng.make_request("a", ids, eng.make_params({"lora_name": "all"}))
    eng.lora.register("all", modules(adapters)["all"])
    via_register = eng.generate([ids], greedy(eng, 8, lora_name="all"))[0]["output_ids"]
    eng.lora.unregister("all")
    with pytest.raises(RequestError, match="unknown LoRA adapter 'all'"):
        eng.make_request("a", ids, greedy(eng, 8, lora_name="all"))
    via_path = eng.generate([ids], greedy(eng, 8, lora_name="x", lora_path=modules(adapters)["all"]))[0]["output_ids"]
    assert via_path == via_register
    # a run-time name follows its latest path (the OpenAI front's unload + load under the same name)
    mlp = make_engine(bf16_ckpt, lora_modules={"mlp": modules(adapters)["mlp"]}, allow_runtime_lora=True,
                      lora_roots=root)
    assert eng.generate([ids], greedy(eng, 8, lora_name="x", lora_path=modules(adapters)["mlp"]))[0]["output_ids"] \
        == mlp.generate([ids], greedy(mlp, 8, lora_name="mlp"))[0]["output_ids"]
    with pytest.raises(RequestError, match="lora_path: LoRA adapter 'mlp' is configured from"):
        mlp.lora.get("mlp", modules(adapters)["all"])
    with pytest.raises(RequestError, match="lora_name: LoRA adapter 'mlp' is configured .* cannot be unloaded"):
        mlp.lora.unregister("mlp")
    with pytest.raises(RequestError, match="lora_path: loading adapters at run time is off"):
        make_engine(bf16_ckpt, enable_lora=True).lora.register("other", modules(adapters)["all"])


def test_an_adapter_by_hub_id_from_the_offline_cache(tmp_path, monkeypatch, bf16_ckpt, adapters, fp32_engine):
    from huggingface_hub import constants

    make_hub_cache(tmp_path / "hub", "test-org/tiny-lora", adapters["all"][0], "7" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "lora_modules": "hub=test-org/tiny-lora",
                                    "dtype": "float32", "page_size": "16", "kv_cache_memory": "64MiB",
                                    "max_model_len": "1024"})
    assert cfg.lora_modules["hub"].endswith("7" * 40)
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(cfg)
    ids = eng.tokenizer.encode(PROMPTS[2])
    assert eng.generate([ids], greedy(eng, 8, lora_name="hub"))[0]["output_ids"] == \
        fp32_engine.generate([ids], greedy(fp32_engine, 8, lora_name="all"))[0]["output_ids"]


def test_requests_naming_adapters_fail_alone_naming_the_field(fp32_engine, bf16_engine):
    eng = fp32_engine
    ids = eng.tokenizer.encode(PROMPTS[0])
    with pytest.raises(RequestError, match=r"lora_name: unknown LoRA adapter 'nope' \(known: all, mlp, qv_rs\)"):
        eng.make_request("a", ids, greedy(eng, lora_name="nope"))
    with pytest.raises(RequestError, match="lora_name must be a non-empty string"):
        eng.make_params({"lora_name": 7})
    with pytest.raises(RequestError, match=r"lora_path: loading adapters at run time is off"):
        eng.make_request("a", ids, greedy(eng, lora_name="z", lora_path="/tmp"))
    with pytest.raises(RequestError, match="lora_path: needs lora_name"):
        eng.make_request("a", ids, greedy(eng, lora_path="/tmp"))
    with pytest.raises(RequestError, match="lora_name: 'all': this model serves no LoRA adapters"):
        bf16_engine.make_request("a", ids, greedy(bf16_engine, lora_name="all"))
    with pytest.raises(RequestError, match="unknown key 'lora_id'"):
        eng.make_params({"lora_id": "all"})
    assert eng.generate([ids], greedy(eng, 4, lora_name="all"))[0]["finish_reason"] == "length"


def _copy(src, dst, config=None, tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps({**cfg, **(config or {})}))
    t = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(t) if tensors else t, str(dst / "adapter_model.safetensors"))
    return dst


def _rename(t, old, new):
    return {k.replace(old, new): v for k, v in t.items()}


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
HOSTILE = {
    "malformed JSON": (dict(config="{\"r\": 8,"), r"adapter_config.json: .*malformed JSON"),
    "rank over the limit": (dict(config={"r": 32}), r"adapter_config.json: r 32 exceeds max_lora_rank 16"),
    "DoRA": (dict(config={"use_dora": True}), r"adapter_config.json: use_dora \(True\) is not supported \(DoRA\)"),
    "bias": (dict(config={"bias": "all"}), r"adapter_config.json: bias 'all' is not supported"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), r"adapter_config.json: modules_to_save"),
    "rank_pattern": (dict(config={"rank_pattern": {"q_proj": 4}}), r"adapter_config.json: rank_pattern"),
    "unknown field": (dict(config={"lora_magic": 3}), r"adapter_config.json: field 'lora_magic' \(3\) is not"),
    "non-LoRA": (dict(config={"peft_type": "IA3"}), r"adapter_config.json: peft_type 'IA3' is not supported"),
    "target the base lacks": (dict(config={"target_modules": ["q_proj", "fc1"]}),
                              r"adapter_config.json: target_modules names 'fc1', which the Qwen3 base does not have"),
    "tensor of a module the base lacks": (dict(tensors=lambda t: _rename(t, "self_attn.q_proj", "self_attn.fc1")),
                                          r"adapter_model.safetensors: tensor '.*self_attn.fc1.lora_A.weight' adapts"),
    "layer the base lacks": (dict(tensors=lambda t: _rename(t, "layers.1.", "layers.9.")),
                             r"adapter_model.safetensors: tensor '.*layers.9.*' adapts layer 9; the base has 2"),
    "wrong shape": (dict(tensors=lambda t: {**t, KEY: torch.zeros(8, 65)}),
                    r"adapter_model.safetensors: tensor '.*q_proj.lora_A.weight' has shape \[8, 65\], expected \[8, 64\]"),
    "lm_head": (dict(tensors=lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
                r"adapter_model.safetensors: tensor 'base_model.model.lm_head.lora_A.weight' is not a LoRA A/B"),
    "missing B": (dict(tensors=lambda t: {k: v for k, v in t.items() if k != KEY.replace("lora_A", "lora_B")}),
                  r"adapter_model.safetensors: layer 0 q_proj has lora_A but no lora_B"),
    "layers_to_transform": (dict(config={"layers_to_transform": [1]}),
                            r"tensor '.*layers.0.*' adapts layer 0, which layers_to_transform does not list"),
    "NaN": (dict(tensors=lambda t: {**t, KEY: torch.full((8, 64), float("nan"))}), r"holds NaN"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_adapters_are_refused_naming_file_and_field(tmp_path, fp32_engine, adapters, case):
    kwargs, message = HOSTILE[case]
    bad = _copy(adapters["all"][0], tmp_path / "bad", **kwargs)
    from backend_lib.lora import BaseShape, load_adapter

    with pytest.raises(LoraError, match=message):
        load_adapter("bad", bad, BaseShape.of(fp32_engine.model_config), 16)


def test_a_hostile_adapter_loaded_at_run_time_fails_that_request_alone(tmp_path, bf16_ckpt, adapters):
    eng = make_engine(bf16_ckpt, allow_runtime_lora=True, lora_modules={"all": modules(adapters)["all"]},
                      lora_roots=str(tmp_path))
    bad = _copy(adapters["all"][0], tmp_path / "bad", config={"r": 64})
    ids = eng.tokenizer.encode(PROMPTS[0])
    ok = greedy(eng, 6, lora_name="all")
    eng.add_request("good", ids, ok)
    with pytest.raises(RequestError, match=r"lora_name: adapter 'bad': .*adapter_config.json: r 64 exceeds"):
        eng.make_request("bad", ids, greedy(eng, 6, lora_name="bad", lora_path=str(bad)))
    with pytest.raises(RequestError, match="lora_name: unknown LoRA adapter 'bad'"):
        eng.make_request("bad", ids, greedy(eng, 6, lora_name="bad"))
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert out == eng.generate([ids], ok)[0]["output_ids"]


def test_engine_parameters(bf16_ckpt, tmp_path):
    (tmp_path / "x/y").mkdir(parents=True)
    cfg = EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "enable_lora": "true", "max_loras": "3",
                                    "max_lora_rank": "64", "lora_modules": '{"a": "x/y", "b": "/abs/ad"}'},
                                   base_dir=str(tmp_path))
    assert cfg.lora_enabled and cfg.max_loras == 3 and cfg.max_lora_rank == 64
    assert cfg.lora_modules == {"a": str(tmp_path / "x/y"), "b": "/abs/ad"}
    with pytest.raises(ValueError, match="max_loras: must be positive"):
        EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "max_loras": "0"})
    with pytest.raises(ValueError, match=r"lora_modules: 'a' is not name=path"):
        EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "lora_modules": "a"})
    with pytest.raises(ValueError, match=r"enable_lora: 'maybe' is not a boolean"):
        EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "enable_lora": "maybe"})


def test_the_lora_bench_runs_and_reports_both_rates(capsys):
    from bench.lora import main

    assert main(["--size", "tiny", "--batch", "4", "--adapters", "2", "--rank", "8", "--tokens", "2",
                 "--prompt-len", "16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["decode_tokens_per_s_base"] > 0 and out["decode_tokens_per_s_lora"] > 0
    assert out["ttft_cold_adapter_s"] > 0 and out["adapters"] == 2


def test_the_openai_fronts_lora_modules_argument():
    from openai_frontend.lora import parse_lora_modules_arg

    assert parse_lora_modules_arg(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
                                   '{"name": "c"}']) == {"a": ("/x", None), "b": ("/y", "m"), "c": (None, None)}
    for bad, message in ((["a"], "'a' is not name=path"), (["a=/x", "a=/y"], "'a' is named twice"),
                         (['{"name": "a", "rank": 3}'], "is not {"), ([" a=/x"], "without surrounding spaces")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_lora_modules_arg(bad)


@pytest.mark.parametrize("fused", ["qkv", "o", "gate_up", "down"])
def test_each_rows_update_is_bit_identical_whatever_shares_its_batch(fp32_engine, fused):
    """The per-row update itself (not only the ids): a row alone, and the same row in a batch of three adapters and
    base rows, give the same bits; base rows are the base linear's output bit for bit."""
    from backend_lib.lora.layer import LoraBatch

    layer = fp32_engine.runner.model.layers[1]
    lin = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
           "down": layer.mlp.down_proj}[fused]
    reg, ctx = fp32_engine.lora, fp32_engine.runner.lora_ctx
    rows = [reg.get("all"), None, reg.get("qv_rs"), reg.get("mlp"), reg.get("all"), None, reg.get("qv_rs")] * 3
    x = torch.randn(len(rows), lin.base.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with ctx.use(LoraBatch.of(rows, "cpu")):
            together = lin(x)
        base = lin.base(x)
        for i, a in enumerate(rows):
            with ctx.use(LoraBatch.of([a], "cpu")):
                alone = lin(x[i:i + 1])
            assert torch.equal(alone[0], together[i]), i
            touched = a is not None and a.delta(1, fused) is not None
            assert torch.equal(together[i], base[i]) != touched, i


def test_a_requests_lora_path_comes_only_from_the_lora_roots_and_errors_disclose_no_path(tmp_path, bf16_ckpt,
                                                                                         adapters):
    from backend_lib.lora.registry import NOT_IN_ROOTS

    root, outside = tmp_path / "roots" / "adapters", tmp_path / "elsewhere"
    root.mkdir(parents=True)
    outside.mkdir()
    (root / "org").mkdir()
    _copy(adapters["all"][0], root / "org" / "name")
    secret = _copy(adapters["all"][0], outside / "secret")
    (root / "link-out").symlink_to(secret)                     # a folder that leads out of the root
    (root / "files-out").mkdir()                               # a folder inside whose files lead out
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "files-out" / f).symlink_to(secret / f)
    eng = make_engine(bf16_ckpt, allow_runtime_lora=True, lora_modules={"mlp": modules(adapters)["mlp"]},
                      lora_roots=f"{root}, {tmp_path / 'missing-root'}")
    ids = eng.tokenizer.encode(PROMPTS[0])
    ok = eng.generate([ids], greedy(eng, 6, lora_name="r", lora_path="org/name"))[0]["output_ids"]   # not a Hub id
    assert ok == eng.generate([ids], greedy(eng, 6, lora_name="r2", lora_path=str(root / "org" / "name")))[0][
        "output_ids"]
    hostile = [str(secret), "link-out", "files-out", "../../elsewhere/secret", "/etc", "/no/such/folder", "nope",
               "org/../../../elsewhere/secret", "Qwen/Qwen3-0.6B", str(root)]
    for i, path in enumerate(hostile):
        with pytest.raises(RequestError) as exc:
            eng.make_request("h", ids, greedy(eng, 2, lora_name=f"h{i}", lora_path=path))
        assert str(exc.value) == NOT_IN_ROOTS, path   # one message, whether the path exists or not
    # a bad adapter inside the root: its error names the file relative to the root, never the server's path
    _copy(adapters["all"][0], root / "bad", config={"r": 64})
    with pytest.raises(RequestError, match=r"^lora_name: adapter 'b': bad/adapter_config.json: r 64") as exc:
        eng.make_request("b", ids, greedy(eng, 2, lora_name="b", lora_path="bad"))
    assert str(tmp_path) not in str(exc.value)
    # unknown names list the configured adapters only, never the names other clients registered
    with pytest.raises(RequestError, match=r"^lora_name: unknown LoRA adapter 'zz' \(known: mlp\)$"):
        eng.make_request("z", ids, greedy(eng, 2, lora_name="zz"))
    with pytest.raises(RequestError, match="is configured from another folder; use another lora_name$"):
        eng.make_request("m", ids, greedy(eng, 2, lora_name="mlp", lora_path="org/name"))
    no_roots = make_engine(bf16_ckpt, allow_runtime_lora=True)
    with pytest.raises(RequestError, match="lora_path: this model takes no lora_path"):
        no_roots.make_request("n", ids, greedy(no_roots, 2, lora_name="n", lora_path=str(root / "org" / "name")))
