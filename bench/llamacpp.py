"""llama.cpp as a bench system: built from the pinned llama-cpp-python sdist, the demo checkpoint converted by
its own converter, measured with its own tools (llama-bench, llama-batched-bench).

    python -m bench.run --setup-llamacpp        # once (~15 min of both cores): build, convert, quantize
    python -m bench.llamacpp setup              # the same, without the bench run

Layout (under .bench-venv/llamacpp/): src/ the sdist, extracted (llama.cpp is vendored in vendor/llama.cpp);
build/ its CMake + Ninja build (GGML_NATIVE=ON, the targets in TARGETS); convert-venv/ numpy 2.2 for the
converter (this project's venv pins numpy<2; torch, transformers and safetensors come from this venv through
a .pth line placed after the side venv's own packages); models/<checkpoint>-{bf16,q8_0}.gguf.

The converter reads bf16 weights: the A8W8 comparison converts the bf16 demo checkpoint (the same shapes and
vocabulary) and quantizes it to Q8_0 with llama-quantize, as a llama.cpp user would; BF16 is kept for the
bf16 comparison. Decode / prefill figures come from llama-batched-bench (the same prompt length, new tokens
and batch as the engine's groups; decode is its S_TG, prefill its S_PP) and llama-bench (tg / pp, the
figures llama.cpp users quote), every tool with the same thread count as the engine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".bench-venv" / "llamacpp"
SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
CMAKE_FLAGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF")
CONVERTER_NUMPY = "numpy>=2.2,<2.3"


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", flush=True)


def source_dir(home: Path = HOME) -> Path | None:
    """The vendored llama.cpp of the extracted sdist, as a real path (CMake must not see a symlink)."""
    for cand in sorted((home / "src").glob("llama_cpp_python-*/vendor/llama.cpp")):
        if (cand / "CMakeLists.txt").is_file():
            return cand.resolve()
    return None


def binary(name: str, home: Path = HOME) -> Path:
    return home / "build" / "bin" / name


def configure_command(src: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS]


def build_command(build: Path, jobs: int | None = None) -> list[str]:
    return ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 1)]


def _run(cmd: list[str], nice: bool = False, **kw) -> None:
    log(" ".join(cmd))
    subprocess.run((["nice", "-n", "19"] if nice else []) + cmd, check=True, **kw)


def build(home: Path = HOME) -> Path:
    """Downloads and extracts the sdist (pip download, source only), configures and builds the TARGETS."""
    home.mkdir(parents=True, exist_ok=True)
    if source_dir(home) is None:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
              str(home / "src")])
        for tgz in (home / "src").glob("llama_cpp_python-*.tar.gz"):
            with tarfile.open(tgz) as tf:
                tf.extractall(home / "src", filter="data")
    src = source_dir(home)
    if src is None:
        raise SystemExit(f"llama.cpp: no vendor/llama.cpp in the {SDIST} sdist under {home / 'src'}")
    if all(binary(t, home).is_file() for t in TARGETS):
        return src
    _run(configure_command(src, home / "build"), nice=True)
    _run(build_command(home / "build"), nice=True)
    return src


def converter_python(home: Path = HOME) -> Path:
    """A side venv with numpy 2.2 for convert_hf_to_gguf.py; the rest from this project's venv (.pth)."""
    venv = home / "convert-venv"
    py = venv / "bin" / "python"
    if not py.is_file():
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(py), "-m", "pip", "install", "-q", CONVERTER_NUMPY, "sentencepiece", "protobuf"])
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        ours = next(p for p in sys.path if p.endswith("site-packages"))
        Path(site, "zz_project_site.pth").write_text(ours + "\n")   # after the side venv's own packages
    return py


# GGUF file tag -> llama-quantize's (options, type). llama-quantize writes output.weight (the head) in Q6_K for Q4_0
# by default; q4_0-q8head keeps it in Q8_0 (--output-tensor-type), the bytes of the engine's int8 head, and
# q4_0-q4head in Q4_0, the bytes of its int4 head (4.5 bits a weight both), so a W4A16 engine with that head reads
# what the GGUF reads (the MoE group reports the default file and the bytes-matched one).
QUANTS = {"q8_0": ((), "Q8_0"), "q4_0": ((), "Q4_0"), "q4_0-q8head": (("--output-tensor-type", "q8_0"), "Q4_0"),
          "q4_0-q4head": (("--output-tensor-type", "q4_0"), "Q4_0")}


def gguf_paths(checkpoint: Path, home: Path = HOME, quants=("q8_0",)) -> dict[str, Path]:
    stem = checkpoint.name.removesuffix("-bf16")
    return {"bf16": home / "models" / f"{stem}-bf16.gguf",
            **{q: home / "models" / f"{stem}-{q}.gguf" for q in quants}}


def is_moe(checkpoint: Path) -> bool:
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") == "qwen3_moe"


def convert(bf16_checkpoint: Path, home: Path = HOME, quants=("q8_0",), keep_bf16: bool = True) -> dict[str, Path]:
    """The bf16 checkpoint as BF16 GGUF (llama.cpp's converter: Qwen3ForCausalLM -> qwen3, Qwen3MoeForCausalLM ->
    qwen3moe, whose per-expert tensors it stacks into ffn_{gate,up,down}_exps) and each of `quants` (llama-quantize
    from the BF16 file, as a llama.cpp user makes them). keep_bf16 False: the BF16 file (the size of the bf16
    checkpoint) is removed once the quantized ones exist (the MoE bench's shapes are GBs)."""
    src = source_dir(home)
    out = gguf_paths(bf16_checkpoint, home, quants)
    out["bf16"].parent.mkdir(parents=True, exist_ok=True)
    missing = [q for q in quants if not out[q].is_file()]
    if not out["bf16"].is_file() and (missing or keep_bf16):
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        _run([str(converter_python(home)), str(src / "convert_hf_to_gguf.py"), str(bf16_checkpoint), "--outtype",
              "bf16", "--outfile", str(out["bf16"])], env=env, nice=is_moe(bf16_checkpoint))
    for q in missing:
        options, qtype = QUANTS[q]
        _run([str(binary("llama-quantize", home)), *options, str(out["bf16"]), str(out[q]), qtype])
    if not keep_bf16 and out["bf16"].is_file():
        out["bf16"].unlink()
    if not keep_bf16:
        out.pop("bf16")
    return out


def setup(bf16_checkpoint: Path, home: Path = HOME) -> dict[str, Path]:
    build(home)
    return convert(bf16_checkpoint, home)


def installed(bf16_checkpoint: Path, home: Path = HOME, quants=("q8_0",), need_bf16: bool = True) -> dict[str, Path] | None:
    paths = gguf_paths(bf16_checkpoint, home, quants)
    if not need_bf16:
        paths.pop("bf16")
    ok = all(binary(t, home).is_file() for t in TARGETS) and all(p.is_file() for p in paths.values())
    return paths if ok else None


# ----- measurements --------------------------------------------------------------------------------------
def batched_bench_command(model: Path, threads: int, prompt_len: int, new_tokens: int, batches: list[int],
                          home: Path = HOME) -> list[str]:
    """llama-batched-bench: for every batch B, B sequences of prompt_len tokens then new_tokens each (one
    context of B x (prompt + new) cells, no shared prompt), JSON lines out."""
    ctx = max(batches) * (prompt_len + new_tokens) + 16
    return [str(binary("llama-batched-bench", home)), "-m", str(model), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
            "-npl", ",".join(str(b) for b in batches), "--output-format", "jsonl"]


def parse_batched_bench(text: str) -> list[dict]:
    """The jsonl lines of llama-batched-bench: {batch, prompt_len, new_tokens, prefill_tokens_per_s,
    decode_tokens_per_s, prefill_s, decode_s}."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        r = json.loads(line)
        rows.append({"batch": r["pl"], "prompt_len": r["pp"], "new_tokens": r["tg"], "prefill_s": r["t_pp"],
                     "decode_s": r["t_tg"], "prefill_tokens_per_s": r["speed_pp"],
                     "decode_tokens_per_s": r["speed_tg"]})
    return rows


def llama_bench_command(model: Path, threads: int, prompt_len: int, new_tokens: int, repetitions: int = 1,
                        home: Path = HOME) -> list[str]:
    """llama-bench: pp<prompt_len> and tg<new_tokens> (batch 1), JSON out."""
    return [str(binary("llama-bench", home)), "-m", str(model), "-t", str(threads), "-p", str(prompt_len), "-n",
            str(new_tokens), "-r", str(repetitions), "-o", "json"]


def parse_llama_bench(text: str) -> dict[str, float]:
    """{'pp128': tokens/s, 'tg128': tokens/s} from llama-bench's JSON array."""
    start = text.find("[")
    out = {}
    for r in json.loads(text[start:]):
        key = f"tg{r['n_gen']}" if r.get("n_gen") else f"pp{r['n_prompt']}"
        out[key] = float(r["avg_ts"])
    return out


class LlamaCppSystem:
    """A bench "system" (the Worker call protocol of bench/run.py) running llama.cpp's own tools per call."""

    def __init__(self, model: Path, threads: int, log_path: Path, home: Path = HOME):
        self.model, self.threads, self.home, self.log_path = model, threads, home, log_path

    def _out(self, cmd: list[str]) -> str:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        with open(self.log_path, "a") as f:
            f.write(" ".join(cmd) + "\n" + proc.stderr[-4000:] + "\n" + proc.stdout + "\n")
        if proc.returncode:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode} (see {self.log_path})")
        return proc.stdout + "\n" + proc.stderr

    def call(self, op: str, **kw) -> dict:
        if op == "batched":
            return {"rows": parse_batched_bench(self._out(batched_bench_command(
                self.model, self.threads, kw["prompt_len"], kw["new_tokens"], kw["batches"], self.home)))}
        if op == "llama_bench":
            return parse_llama_bench(self._out(llama_bench_command(self.model, self.threads, kw["prompt_len"],
                                                                   kw["new_tokens"], home=self.home)))
        raise ValueError(f"llama.cpp system: no op {op!r}")

    def close(self) -> None:
        pass


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["setup", "build", "convert"])
    ap.add_argument("--checkpoint", default=str(ROOT / "demo_checkpoints" / "qwen3-0.6b-bf16"))
    ap.add_argument("--quants", default=None,
                    help="comma list of q8_0, q4_0 (default: q8_0; a MoE checkpoint: q8_0,q4_0, the BF16 GGUF removed)")
    args = ap.parse_args(argv)
    if args.what in ("setup", "build"):
        build()
    if args.what in ("setup", "convert"):
        ckpt = Path(args.checkpoint)
        moe = is_moe(ckpt)
        quants = tuple(args.quants.split(",")) if args.quants else (("q8_0", "q4_0") if moe else ("q8_0",))
        bad = [q for q in quants if q not in QUANTS]
        if bad:
            raise SystemExit(f"--quants: {bad[0]!r} is not one of {', '.join(QUANTS)}")
        log(f"models: {convert(ckpt, quants=quants, keep_bf16=not moe)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
