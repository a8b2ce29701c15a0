"""A decode step's glue never reads a device value on the host: ModelRunner.decode_logits (metadata built on
the device from the block tables and cached lengths, embedding, every layer, the KV cache, the logits) runs
under FakeTensorMode on device="cuda" tensors with the Triton kernel set (custom ops with fake
implementations). Any .tolist(), .item() or data-dependent shape raises there; the reference attention (which
loops over sequences on the host) does, the control that the check bites."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from backend_lib.checkpoint import ModelConfig, parse_quantization_config  # noqa: E402
from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.engine.model_runner import ModelRunner  # noqa: E402
from backend_lib.kernels import REFERENCE  # noqa: E402
from backend_lib.kernels.triton.kernel_set import KERNELS as TRITON  # noqa: E402
from backend_lib.kv_cache.metadata import AttentionMetadata  # noqa: E402

CUDA = torch.device("cuda")


def _fake_cuda(obj, mode: FakeTensorMode, seen: set):
    """The same object graph with every tensor replaced by a fake CUDA tensor of its shape, strides and dtype
    (a CPU-only torch cannot .to('cuda'), even fake; it can create fake CUDA tensors)."""
    if isinstance(obj, torch.Tensor):
        with mode:
            t = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=CUDA)
        return nn.Parameter(t, requires_grad=False) if isinstance(obj, nn.Parameter) else t
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fake_cuda(x, mode, seen) for x in obj)
    ours = isinstance(obj, nn.Module) or type(obj).__module__.startswith("backend_lib")
    if id(obj) in seen or not ours:
        return obj
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        for store in (obj._parameters, obj._buffers, obj._modules):
            for k, v in store.items():
                store[k] = _fake_cuda(v, mode, seen)
    for k, v in list(vars(obj).items()):
        if not k.startswith("_"):
            vars(obj)[k] = _fake_cuda(v, mode, seen)
    return obj


def _runner(ckpt, kernels, kv_cache):
    cfg = EngineConfig(checkpoint=str(ckpt), page_size=16, kv_cache_memory="4MiB", max_num_seqs=4, kv_cache=kv_cache)
    mc = ModelConfig.from_dir(str(ckpt))
    runner = ModelRunner(cfg, mc, parse_quantization_config(mc.quantization_config), torch.device("cpu"),
                         torch.bfloat16, kernels, 256)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    _fake_cuda(runner.model, mode, set())
    _fake_cuda(runner.kv_cache, mode, set())
    runner.device = CUDA
    return runner, mode


def _decode(runner, mode):
    with mode, torch.no_grad():   # (inference_mode + fake CUDA tensors: slicing fails on a CPU-only torch)
        ids = torch.tensor([5, 6, 7], device=CUDA)
        tables = torch.tensor([[0, 1], [2, 3], [4, 0]], dtype=torch.int32, device=CUDA)
        cached = torch.tensor([17, 3, 9], dtype=torch.int32, device=CUDA)
        return runner.decode_logits(ids, tables, cached)


@pytest.mark.parametrize("kv_cache", ["bf16", "tq"])
def test_a_decode_step_with_the_triton_kernels_never_syncs(a8w8_ckpt, kv_cache):
    runner, mode = _runner(a8w8_ckpt, TRITON, kv_cache)
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    logits = _decode(runner, mode)
    assert logits.device.type == "cuda" and logits.dtype == torch.float32
    assert tuple(logits.shape) == (3, runner.model.cfg.vocab_size)


def test_a_w4a16_decode_step_with_the_triton_int4_gemm_never_syncs(ckpts):
    """GPTQ desc_act (the act-order perm gathered in the kernel) through the Triton set's packed int4 GEMM."""
    ckpt = ckpts.get("tiny-gptq-g64-asym-descact", "gptq", group_size=64, symmetric=False, desc_act=True)
    runner, mode = _runner(ckpt, TRITON, "bf16")
    assert runner.model.layers[0].mlp.down_proj.prepared[0].dtype == torch.uint8
    logits = _decode(runner, mode)
    assert logits.device.type == "cuda" and tuple(logits.shape) == (3, runner.model.cfg.vocab_size)


@pytest.mark.parametrize("kv_cache", ["bf16", "tq"])
def test_a_verification_graphs_step_never_syncs(a8w8_ckpt, kv_cache):
    """[spec] What a verification graph holds (engine/cuda_graphs.py's VerifyGraphs._step over its device buffers:
    bucket 4, k = 2, 13 rows over 5 sequence slots, several rows a sequence) reads nothing on the host either."""
    from backend_lib.engine.cuda_graphs import VerifyGraphs

    runner, mode = _runner(a8w8_ckpt, TRITON, kv_cache)
    with mode, torch.no_grad():
        logits, aux = VerifyGraphs(runner, 4, 16, 2, capture=False)._step(4, None)
    assert logits.device.type == "cuda" and tuple(logits.shape) == (13, runner.model.cfg.vocab_size) and aux is None


def test_the_check_catches_a_host_sync(a8w8_ckpt):
    """The Triton set with the reference's attention, which reads query_start_loc and seq_lens on the host."""
    runner, mode = _runner(a8w8_ckpt, replace(TRITON, paged_attention=REFERENCE.paged_attention), "bf16")
    with pytest.raises(DataDependentOutputException):
        _decode(runner, mode)


def test_device_decode_metadata_equals_the_host_construction():
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    cached = torch.tensor([17, 40], dtype=torch.int32)
    meta, positions = AttentionMetadata.for_decode(tables, cached, 16)
    assert positions.tolist() == [17, 40]
    assert meta.slot_mapping.tolist() == [1 * 16 + 1, 4 * 16 + 8]
    assert meta.query_start_loc.tolist() == [0, 1, 2] and meta.seq_lens.tolist() == [18, 41]
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32

    # the CPU's construction from the host's lists: the same tensors (values, dtypes), random tables and lengths
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = int(torch.randint(1, 6, (1,), generator=g))
        pages = [torch.randperm(64, generator=g)[:int(torch.randint(1, 5, (1,), generator=g))].tolist() for _ in range(b)]
        cached = [int(torch.randint(0, 16 * len(p), (1,), generator=g)) for p in pages]
        tables = torch.zeros((b, max(map(len, pages))), dtype=torch.int32)
        for i, p in enumerate(pages):
            tables[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
        want, want_pos = AttentionMetadata.for_decode(tables, torch.tensor(cached, dtype=torch.int32), 16)
        got, got_pos = AttentionMetadata.for_decode_host(pages, cached, tables, 16)
        assert torch.equal(got_pos, want_pos) and got_pos.dtype == want_pos.dtype
        for f in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
            x, y = getattr(got, f), getattr(want, f)
            assert torch.equal(x, y) and x.dtype == y.dtype, f


class _DeviceToHost(TorchDispatchMode):
    """Counts the ops that take a CUDA tensor and give a CPU one (device-to-host copies)."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cuda" for t in ins) and any(t.device.type == "cpu" for t in outs):
            self.copies += 1
        return out


def _sampled_seqs(vocab):
    from backend_lib.contract.fields import SamplingLimits
    from backend_lib.sampling import SamplingParams

    class Grammar:
        active = True

        def fill_mask(self, out):
            out.fill_(0x5555)

    class Seq:
        def __init__(self, grammar=None, **kw):
            self.params = SamplingParams(**kw).validate(SamplingLimits(), vocab)
            self.prompt_ids, self.output_ids, self.min_tokens_blocked_ids = [5, 9, 5], [4, 4], [0]
            self.generator = torch.Generator().manual_seed(3)
            self.grammar = grammar
    return [Seq(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                frequency_penalty=0.3, logprobs=2),
            Seq(temperature=0, min_tokens=4, logprobs=0), Seq(grammar=Grammar(), temperature=1.1, seed=7)]


def test_a_sampled_decode_step_makes_one_device_to_host_copy(a8w8_ckpt):
    """decode_logits, then the sampling pipeline's sync-free form over non-greedy rows (top-k/p, min-p, penalties,
    min_tokens, a grammar mask, logprobs) on fake CUDA tensors: no host sync, and exactly one device-to-host copy
    (the packed ids and logprobs). The host form over the same fake logits reads them on the host: the control."""
    from backend_lib.sampling import Sampler

    runner, mode = _runner(a8w8_ckpt, TRITON, "bf16")
    vocab = runner.model.cfg.vocab_size
    seqs = _sampled_seqs(vocab)
    meta = Sampler().metadata(seqs, vocab)              # the host side: parameters, masks, the draws
    assert meta.mask is not None and meta.rows[0].seen and meta.rows[1].blocked
    meta.mask = _fake_cuda(meta.mask, mode, set())      # (the real one is copied to the device in the pass)
    logits = _decode(runner, mode)
    counter = _DeviceToHost()
    with mode, counter, torch.no_grad():
        lists, packed = Sampler().device_pass(logits, meta, sync_free=True)
    assert counter.copies == 1 and lists is None and packed.device.type == "cpu"
    assert tuple(packed.shape) == (3, 6 + 2 * 2) and packed.dtype == torch.float64
    host_reads = (DataDependentOutputException, DynamicOutputShapeException)
    with mode, torch.no_grad(), pytest.raises(host_reads):   # copies B x vocab logits, reads them on the host
        Sampler()(logits.cpu(), seqs)


@pytest.mark.parametrize("fmt", ["a8w8", "bf16", "w4a16", "gptq-descact"])
def test_a_moe_decode_step_with_the_fused_triton_moe_never_syncs(moe_a8w8_ckpt, moe_bf16_ckpt, ckpts, fmt):
    """Qwen3-MoE: the router, the top-k, the pairs' sort and padding (kernels/triton/moe.py's align) and the
    fused expert kernels (act-order experts: their perms gathered in the kernels) all stay on the device. The
    composed path (kernels/moe.py, which counts each expert's pairs on the host) does not: the control."""
    from backend_lib.kernels.triton.experts import PackedExperts

    ckpt = {"a8w8": moe_a8w8_ckpt, "bf16": moe_bf16_ckpt}.get(fmt) or (
        ckpts.get("tiny-moe-w4a16", "w4a16", "tiny-moe") if fmt == "w4a16" else
        ckpts.get("tiny-moe-gptq-descact-own-perms", "gptq", "tiny-moe", group_size=16, desc_act=True,
                  shared_perm=False))
    runner, mode = _runner(ckpt, TRITON, "bf16")
    sparse = [m for m in runner.model.modules() if hasattr(m, "moe_weights")]
    assert sparse and all(isinstance(m.moe_weights, PackedExperts) for m in sparse)
    logits = _decode(runner, mode)
    assert logits.device.type == "cuda" and tuple(logits.shape) == (3, runner.model.cfg.vocab_size)
    for m in sparse:             # back to the per-expert pairs (a plain attribute, not the packed submodule)
        del m.moe_weights
        vars(m)["moe_weights"] = m.expert_pairs
    with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):   # bincount, .tolist()
        _decode(runner, mode)
