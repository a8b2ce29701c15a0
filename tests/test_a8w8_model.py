"""A8W8 at model level: our int8 engine against transformers running the same checkpoint.

transformers loads the compressed-tensors checkpoint; we run it in fp32 with the weights
dequantized exactly (int8 * fp32 scale) and the per-token int8 activation quantization emulated by
forward pre-hooks on every quantized Linear. Our engine computes the same thing with int8 x int8 ->
int32 GEMMs. A weight-only run of the same transformers model shows how large the figure would be
if activation quantization were missing or wrong.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from backend_lib.kernels.reference import quantize_per_token
from helpers import make_engine

TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 " * 3


def _logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def reference_runs(a8w8_ckpt):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(a8w8_ckpt), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    f = safe_open(str(a8w8_ckpt / "model.safetensors"), "pt")
    quantized = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w = f.get_tensor(f"{name}.weight")
            assert w.dtype == torch.int8
            mod.weight.data = w.float() * f.get_tensor(f"{name}.weight_scale").float()
            quantized.append(mod)
    eng = make_engine(a8w8_ckpt)
    ids = eng.tokenizer.encode(TEXT)
    weight_only = _logprobs(model, ids)

    def fake_quant(_mod, args):
        x = args[0]
        q, s = quantize_per_token(x.reshape(-1, x.shape[-1]))
        return ((q.float() * s).reshape(x.shape).to(x.dtype),)

    hooks = [m.register_forward_pre_hook(fake_quant) for m in quantized]
    emulated = _logprobs(model, ids)
    for h in hooks:
        h.remove()
    ours = torch.tensor(eng.score(ids)[1:])
    return ours, emulated, weight_only


def test_score_matches_transformers_with_emulated_activation_quant(reference_runs):
    ours, emulated, weight_only = reference_runs
    delta = (ours - emulated).abs().mean().item()
    wo_delta = (weight_only - emulated).abs().mean().item()
    print(f"\nA8W8 fp32: mean |delta logprob| vs emulated = {delta:.2e}; weight-only vs emulated = {wo_delta:.2e}")
    assert delta < 0.01
    assert wo_delta > 10 * delta, "the comparison could not tell missing activation quantization apart"


def test_bf16_compute_stays_close(a8w8_ckpt, reference_runs):
    _, emulated, _ = reference_runs
    eng = make_engine(a8w8_ckpt, dtype="bfloat16")
    ours = torch.tensor(eng.score(eng.tokenizer.encode(TEXT))[1:])
    delta = (ours - emulated).abs().mean().item()
    print(f"\nA8W8 bf16 compute: mean |delta logprob| vs fp32 emulation = {delta:.3f}")
    assert delta < 0.15
