"""GPU check of `kernels: triton`: random weights in Qwen3-0.6B and Qwen3-8B shapes built on the device (no
checkpoint to carry), in at most 7 minutes.

    python -m bench.gpu_check [--json OUT.json] [--models 0.6b,8b] [--context 512]
    python -m bench.gpu_check --dry-run      # CPU: Triton's interpreter, tiny shapes (what CI runs)

1. kernels against the reference set on the device: A8W8 bit for bit (M = 1, 16, 64), float linear, RMSNorm,
   paged attention (bf16 tolerance), TurboQuant codes; one decode step's logits of the whole model;
2. int8 GEMV (M = 1) bandwidth as a share of the device's (a device-to-device copy of 1 GiB measures that);
3. decode tokens/s at batch 1 / 16 / 64 (context `--context` per sequence), CUDA graphs off and on, as a share
   of the bandwidth floor (weights + the KV read once per step at the measured bandwidth);
4. the fused MoE (A8W8, one Qwen3-30B-A3B layer's 128 experts of width 768, 8 per token) bit for bit against
   the reference at 1 and 16 tokens, and its time and bandwidth over the routed experts' bytes.
JSON out (--json), a table printed last. Runs on torch 2.11 / triton 3.6 as on the pinned versions.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = {   # hidden, heads, kv heads, head_dim, intermediate, layers, vocab
    "tiny": (64, 4, 2, 32, 128, 2, 512),
    "0.6b": (1024, 16, 8, 128, 3072, 28, 151936),
    "8b": (4096, 32, 8, 128, 12288, 36, 151936),
}
BUDGET_S = 7 * 60 - 30
MOE_SHAPES = {"tiny": (64, 32, 8, 2), "30b-a3b": (2048, 768, 128, 8)}   # hidden, expert width, experts, per token


def build_model(shape: str, kernels, device, dtype, seed: int = 0):
    """A Qwen3 decoder with random A8W8 weights (per-channel scales sized for unit-scale outputs), tied head."""
    import torch

    from backend_lib.checkpoint import ModelConfig
    from backend_lib.checkpoint.rope import RopeConfig
    from backend_lib.layers.attention import Qwen3Attention
    from backend_lib.layers.linear import A8W8Linear, FloatLinear
    from backend_lib.layers.mlp import Qwen3MLP
    from backend_lib.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

    hid, h, kvh, d, inter, n_layers, vocab = SHAPES[shape]
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hid, intermediate_size=inter, num_layers=n_layers, num_heads=h,
                      num_kv_heads=kvh, head_dim=d, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, max_positions=40960),
                      max_position_embeddings=40960,
                      tie_word_embeddings=True, torch_dtype="bfloat16", quantization_config=None, eos_token_ids=(),
                      generation_defaults={})
    g = torch.Generator(device=device).manual_seed(seed)

    def a8w8(n, k):
        w = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
        s = (torch.rand(n, generator=g, device=device) + 0.5) / (127 * 0.58 * k ** 0.5)
        return A8W8Linear(w, s, kernels)

    def ones(n):
        return (1 + 0.1 * torch.rand(n, generator=g, device=device)).to(dtype)

    layers = []
    for i in range(n_layers):
        attn = Qwen3Attention(i, a8w8((h + 2 * kvh) * d, hid), a8w8(hid, h * d), ones(d), ones(d), h, kvh, d, 1e-6,
                              kernels)
        layers.append(Qwen3DecoderLayer(attn, Qwen3MLP(a8w8(2 * inter, hid), a8w8(hid, inter), kernels), ones(hid),
                                        ones(hid), 1e-6, kernels))
    head = FloatLinear((torch.randn(vocab, hid, generator=g, device=device) * 0.05).to(dtype), kernels)
    return Qwen3ForCausalLM(cfg, None, layers, ones(hid), head, 4096, kernels)


def weight_bytes(model) -> int:
    """What one decode step reads of the model: parameters (norms) and each linear's prepared weight."""
    import torch

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        prepared = getattr(m, "prepared", None)
        for t in prepared if isinstance(prepared, tuple) else (prepared,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int) -> float:
    """Seconds per call (after one warm-up call)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def device_bandwidth(device, dry: bool) -> float:
    """Bytes/s of a device-to-device copy (read + write), the floor's yardstick."""
    import torch

    n = (16 if dry else 1024) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * n / timed(lambda: b.copy_(a), device, 3 if dry else 20)


def kernel_checks(tri, ref, shape, device, dtype) -> list[dict]:
    import torch

    from backend_lib.kv_cache import tq_codec

    hid, h, kvh, d, inter, _, _ = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(1)
    out = []
    w = torch.randint(-128, 128, (2 * inter, hid), generator=g, device=device, dtype=torch.int8)
    ws = torch.rand(2 * inter, generator=g, device=device) * 0.01
    for m in (1, 16, 64):
        x = (torch.randn(m, hid, generator=g, device=device) * 3).to(dtype)
        same = torch.equal(tri.a8w8_linear(x, tri.a8w8_prepare(w, ws)), ref.a8w8_linear(x, ref.a8w8_prepare(w, ws)))
        out.append({"check": f"a8w8_linear M={m} {2 * inter}x{hid}", "bit_exact": same, "ok": same})
    x = torch.randn(16, hid, generator=g, device=device).to(dtype)
    wf = (torch.randn(4096, hid, generator=g, device=device) * 0.05).to(dtype)
    err = (tri.float_linear(x, tri.float_prepare(wf), torch.float32)
           - ref.float_linear(x, wf, torch.float32)).abs().max()
    out.append({"check": "float_linear fp32 out", "max_abs_err": err.item(), "ok": err.item() < 1e-2})
    nw = (1 + 0.1 * torch.rand(hid, generator=g, device=device)).to(dtype)
    err = (tri.rms_norm(x, nw, 1e-6).float() - ref.rms_norm(x, nw, 1e-6).float()).abs().max()
    out.append({"check": "rms_norm", "max_abs_err": err.item(), "ok": err.item() < 5e-2})
    # paged attention: three sequences (decode, chunk, prompt) on scattered pages
    page = 16
    lens, qlens = [70, 40, 33], [1, 9, 33]
    n_pages = sum(-(-n // page) for n in lens) + 2
    kw = 16
    kc = torch.randn(n_pages, kvh, page // kw, d, kw, generator=g, device=device).to(dtype)
    vc = torch.randn(n_pages, kvh, page, d, generator=g, device=device).to(dtype)
    perm = torch.randperm(n_pages, generator=g, device=device).to(torch.int32)
    tables, start = [], 0
    for n in lens:
        k = -(-n // page)
        tables.append(torch.nn.functional.pad(perm[start:start + k], (0, 5 - k)))
        start += k
    bt = torch.stack(tables)
    qsl = torch.tensor([0, 1, 10, 43], dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(qlens), h, d, generator=g, device=device).to(dtype)
    err = (tri.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5).float()
           - ref.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5).float()).abs().max()
    out.append({"check": "paged_attention bf16", "max_abs_err": err.item(), "ok": err.item() < 2e-2})
    rot = tq_codec.tq_rotation(d, 3).to(device)
    cents, bounds = tq_codec.tq_codebook(d, device)
    rows = torch.randn(32, 1, d, generator=g, device=device).to(dtype)
    codes = []
    for ks in (tri, ref):
        kc8 = torch.zeros(2, 1, 1, d // 2, 16, dtype=torch.uint8, device=device)
        vc8 = torch.zeros(2, 1, 16, d // 2, dtype=torch.uint8, device=device)
        sk, sv = torch.zeros(2, 1, 16, device=device), torch.zeros(2, 1, 16, device=device)
        ks.tq_write(rows, rows, kc8, sk, vc8, sv, torch.arange(32, device=device), rot, cents, bounds)
        codes.append(vc8)
    same = int((codes[0] != codes[1]).sum().item())
    out.append({"check": "tq_write codes", "codes_differing": same, "ok": same <= 2})   # fp32 rounding at a boundary
    return out


def moe_checks(tri, ref, device, dtype, dry: bool):
    """(checks, timings) of the fused A8W8 MoE on one layer of random experts."""
    import torch

    from backend_lib.layers.linear import A8W8Linear

    hid, inter, e_n, k = MOE_SHAPES["tiny" if dry else "30b-a3b"]
    g = torch.Generator(device=device).manual_seed(2)
    raw = [(torch.randint(-128, 128, (2 * inter, hid), generator=g, device=device, dtype=torch.int8),
            torch.rand(2 * inter, generator=g, device=device) * 0.01,
            torch.randint(-128, 128, (hid, inter), generator=g, device=device, dtype=torch.int8),
            torch.rand(hid, generator=g, device=device) * 0.01) for _ in range(e_n)]
    ref_pairs = [(A8W8Linear(a, b, ref), A8W8Linear(c, d, ref)) for a, b, c, d in raw]
    packed = tri.pack_experts([(A8W8Linear(a, b, tri), A8W8Linear(c, d, tri)) for a, b, c, d in raw])
    checks, timings = [], []
    for m in (1, 16):
        x = (torch.randn(m, hid, generator=g, device=device) * 3).to(dtype)
        w, ids = torch.topk(torch.softmax(torch.randn(m, e_n, generator=g, device=device), -1), k)
        w = w.to(dtype)
        got = tri.moe_experts(x, ids, w, packed)
        same = torch.equal(got, ref.moe_experts(x, ids, w, ref_pairs))
        checks.append({"check": f"fused moe a8w8 T={m} E={e_n} k={k}", "bit_exact": same, "ok": same})
        t = timed(lambda: tri.moe_experts(x, ids, w, packed), device, 1 if dry else 50)
        touched = int(ids.unique().numel())
        nbytes = touched * (3 * hid * inter + 4 * (3 * inter + hid))     # int8 weights + fp32 scales
        timings.append({"shape": f"T={m} E={e_n} k={k} {hid}x{inter}", "experts_touched": touched, "us": t * 1e6,
                        "GBps": nbytes / t / 1e9})
    return checks, timings


def decode_setup(model, shape, batch, context, device, dtype, kernels):
    import torch

    from backend_lib.kv_cache import DenseKVCache

    _, _, kvh, d, _, n_layers, _ = SHAPES[shape]
    page = 16 if device.type == "cpu" else 128
    per_seq = -(-(context + 1) // page)
    cache = DenseKVCache(n_layers, batch * per_seq, page, kvh, d, dtype, device, kernels)
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=device).reshape(batch, per_seq)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), device=device)
    kv_bytes = 2 * n_layers * kvh * d * torch.empty((), dtype=dtype).element_size() * batch * (context + 1)
    return cache, tables, ctx, ids, page, kv_bytes


def decode_fn(model, cache, ids, tables, ctx, page):
    from backend_lib.kv_cache.metadata import AttentionMetadata

    def step():
        meta, positions = AttentionMetadata.for_decode(tables, ctx, page)
        return model.logits(model(ids, positions, cache, meta))
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined
    import torch
    import triton

    from backend_lib.kernels import REFERENCE, get_kernels

    t_start = time.time()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    tri = get_kernels(device, "triton")
    shapes = ["tiny"] if args.dry_run else [s.strip() for s in args.models.split(",")]
    batches = (1, 2) if args.dry_run else (1, 16, 64)
    context = 20 if args.dry_run else args.context
    iters = 1 if args.dry_run else 10
    bw = device_bandwidth(device, args.dry_run)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "dry_run": args.dry_run,
           "device_bandwidth_GBps": bw / 1e9, "checks": [], "gemv": [], "decode": [], "skipped": []}
    moe_c, res["moe"] = moe_checks(tri, REFERENCE, device, dtype, args.dry_run)
    res["checks"] += [{"model": "moe", **c} for c in moe_c]
    for m in res["moe"]:
        m["share_of_device"] = m["GBps"] * 1e9 / bw
    for shape in shapes:
        res["checks"] += [{"model": shape, **c} for c in kernel_checks(tri, REFERENCE, shape, device, dtype)]
        hid, _, _, _, inter, _, _ = SHAPES[shape]
        w = torch.randint(-128, 128, (2 * inter, hid), device=device, dtype=torch.int8)
        p = tri.a8w8_prepare(w, torch.rand(2 * inter, device=device))
        x = torch.randn(1, hid, device=device).to(dtype)
        t = timed(lambda: tri.a8w8_linear(x, p), device, 3 if args.dry_run else 50)
        gemv_bw = (w.numel() + 4 * w.shape[0]) / t
        res["gemv"].append({"model": shape, "shape": f"1x{hid} @ {2 * inter}x{hid} int8", "us": t * 1e6,
                            "GBps": gemv_bw / 1e9, "share_of_device": gemv_bw / bw})
        model = build_model(shape, tri, device, dtype)
        wbytes = weight_bytes(model)
        if shape in ("tiny", "0.6b"):     # the whole model against the reference set, one decode step
            ref_model = build_model(shape, REFERENCE, device, dtype)
            cache, tables, ctx, ids, page, _ = decode_setup(model, shape, 2, context, device, dtype, tri)
            a = decode_fn(model, cache, ids, tables, ctx, page)()
            cache_r = decode_setup(ref_model, shape, 2, context, device, dtype, REFERENCE)[0]
            b = decode_fn(ref_model, cache_r, ids, tables, ctx, page)()
            res["checks"].append({"model": shape, "check": "decode step logits vs reference",
                                  "max_abs_err": (a - b).abs().max().item(),
                                  "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
                                  "ok": bool(torch.isfinite(a).all())})
            del ref_model, cache_r
        for batch in batches:
            if time.time() - t_start > BUDGET_S:
                res["skipped"].append(f"{shape} batch {batch}: out of time")
                continue
            cache, tables, ctx, ids, page, kv_bytes = decode_setup(model, shape, batch, context, device, dtype, tri)
            step = decode_fn(model, cache, ids, tables, ctx, page)
            floor_s = (wbytes + kv_bytes) / bw
            row = {"model": shape, "batch": batch, "context": context, "weight_bytes": wbytes, "kv_bytes": kv_bytes,
                   "floor_tokens_per_s": batch / floor_s}
            with torch.inference_mode():
                t = timed(step, device, iters)
                row["eager_tokens_per_s"] = batch / t
                if device.type == "cuda":
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        step()
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    t = timed(graph.replay, device, iters)
                    row["graph_tokens_per_s"] = batch / t
                    del graph
                else:
                    row["graph_tokens_per_s"] = None     # no CUDA graphs on the CPU
            best = max(v for v in (row["eager_tokens_per_s"], row["graph_tokens_per_s"]) if v is not None)
            row["share_of_floor"] = best / row["floor_tokens_per_s"]
            res["decode"].append(row)
            del cache
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res["elapsed_s"] = time.time() - t_start
    res["all_checks_ok"] = all(c["ok"] for c in res["checks"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['device']}: torch {res['torch']}, triton {res['triton']}, copy bandwidth "
          f"{res['device_bandwidth_GBps']:.0f} GB/s, {res['elapsed_s']:.0f} s")
    for c in res["checks"]:
        print(f"  {'ok ' if c['ok'] else 'BAD'} {c['model']:<5} {c['check']:<40} "
              + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
                         if k not in ("model", "check", "ok")))
    for g_ in res["gemv"]:
        print(f"  gemv  {g_['model']:<5} {g_['shape']:<28} {g_['us']:9.1f} us {g_['GBps']:8.1f} GB/s "
              f"{100 * g_['share_of_device']:5.1f} % of the copy bandwidth")
    for m in res["moe"]:
        print(f"  moe   {m['shape']:<28} {m['us']:9.1f} us {m['GBps']:8.1f} GB/s "
              f"{100 * m['share_of_device']:5.1f} % of the copy bandwidth ({m['experts_touched']} experts read)")
    print(f"  {'model':<6}{'batch':>6}{'eager tok/s':>13}{'graph tok/s':>13}{'floor tok/s':>13}{'share':>8}")
    for r in res["decode"]:
        graph = f"{r['graph_tokens_per_s']:13.1f}" if r["graph_tokens_per_s"] is not None else f"{'-':>13}"
        print(f"  {r['model']:<6}{r['batch']:>6}{r['eager_tokens_per_s']:13.1f}{graph}{r['floor_tokens_per_s']:13.1f}"
              f"{100 * r['share_of_floor']:7.1f}%")
    for s in res["skipped"]:
        print("  skipped:", s)
    return 0 if res["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
