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


def test_int8_lm_head_is_the_a8w8_kernel_on_a_per_channel_head_and_keeps_the_embedding(a8w8_ckpt):
    """lm_head_quant: int8: logits are exactly the A8W8 reference on the per-channel int8 head (fp32 activations
    quantized per token), the tied embedding still returns the checkpoint's rows, and greedy ids do not depend
    on the batch. The default keeps the checkpoint's float head."""
    from backend_lib.config import EngineConfig
    from backend_lib.kernels.reference import a8w8_linear
    from backend_lib.layers.linear import A8W8Linear, FloatLinear

    assert isinstance(make_engine(a8w8_ckpt, dtype="bfloat16").runner.model.lm_head, FloatLinear)
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", lm_head_quant="int8")
    model = eng.runner.model
    assert isinstance(model.lm_head, A8W8Linear)
    embed = safe_open(str(a8w8_ckpt / "model.safetensors"), "pt").get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([0, 7, 9707, 151935])
    assert torch.equal(model.embed(ids), embed[ids].to(torch.bfloat16))
    w_q, w_s = quantize_per_token(embed.to(torch.bfloat16))
    hidden = torch.randn(5, embed.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        got = model.logits(hidden)
    assert got.dtype == torch.float32
    assert torch.equal(got, a8w8_linear(hidden.float(), w_q, w_s.reshape(-1)))
    prompts = [[9707, 11, 1879, 0, 576], [40, 1079, 264], [151644, 872, 198, 9707]]
    params = eng.make_params({"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    alone = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in eng.generate(prompts, params)] == alone
    with pytest.raises(ValueError, match="lm_head_quant"):
        EngineConfig.from_params({"checkpoint": "x", "lm_head_quant": "int2"})
