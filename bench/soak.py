"""A soak: mixed traffic at a bounded rate against one server started as scripts/serve.sh starts it, with the memory
(RSS) and open file descriptors of every process sampled over time and every response accounted for.

    python -m bench.soak [--minutes 30] [--rate 4] [--concurrency 16] [--size tiny] [--sample-s 10]
                         [--warmup-minutes M] [--rss-bound-pct 10] [--rss-bound-mib 32] [--fd-bound 16] [--out FILE]

It starts what it measures: tritonserver over model_repository/ as it is (every model), with the environment
serve.sh exports (the demo checkpoints of `--size`, built into demo_checkpoints/ if missing) and
`--exit-on-error=false`, and the OpenAI front with serve.sh's arguments; for the LoRA traffic qwen3_tq also takes
run-time adapters (`QWEN3_TQ_ALLOW_RUNTIME_LORA`, `QWEN3_TQ_LORA_ROOTS`: 6 random adapters written here, more than
its `max_loras` of 4, so loads evict). The traffic, `--rate` requests a second at most and `--concurrency` at
once, drawn in a fixed mix: greedy streams read to their end (completion and chat; each prompt's text must equal
its first answer's), streams dropped after their first chunk, prompt scoring (`prompt_logprobs`, `echo` with
`logprobs`), n = 2 choices, requests through a run-time LoRA adapter (and its load), hostile bodies (malformed or
oversized JSON, unknown fields, values out of range, deep nesting: each must be a 400), embeddings and rerank.
Each request's outcome is counted by kind: answered as expected, or unexpected (another status, a broken stream,
a greedy text that changed); every request sent has exactly one outcome.

Every `--sample-s` seconds, the RSS and the open file descriptors of every process of the server (the
`tritonserver` command, the server binary, each model's Python stub) and of the front. The report compares, per
process, the median over the first third after the warm-up (`--warmup-minutes`, a sixth of the run by default)
with the median over the last third: growth beyond `--rss-bound-pct` % and `--rss-bound-mib` MiB (both) or
`--fd-bound` descriptors fails the soak, as does any unexpected outcome or a KV page left in use. The report is
Markdown, to paste into docs/reliability.md. Not a CI test: tests/test_bench.py runs it for ~20 s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Once upon a time", "def fib(n):", "Hello, world!", "In 1492, Columbus"]
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ADAPTERS = 6
# kind -> weight in the mix
MIX = {"stream": 6, "chat": 3, "drop": 4, "score": 2, "echo": 1, "n2": 1, "lora": 2, "hostile": 4, "embed": 2,
       "rerank": 1}


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----- the server, as serve.sh starts it ------------------------------------------------------------------
def demo_checkpoints(size: str) -> dict[str, str]:
    """serve.sh's exports: the demo checkpoints of `size` (built if missing)."""
    import subprocess

    out = {}
    for var, name, extra in (("QWEN3_A8W8_CHECKPOINT", f"qwen3-{size}-a8w8", ["--format", "a8w8"]),
                             ("QWEN3_TQ_CHECKPOINT", f"qwen3-{size}-bf16", ["--format", "bf16"]),
                             ("QWEN3_EMBED_CHECKPOINT", f"qwen3-embedding-{size}-bf16", ["--task", "embed"])):
        path = ROOT / "demo_checkpoints" / name
        if not (path / "config.json").is_file():
            log(f"building {path}")
            subprocess.run([sys.executable, "-m", "backend_lib.tools.make_demo_checkpoint", str(path), "--size", size,
                            *extra, "--overwrite"], cwd=ROOT, check=True)
        out[var] = str(path)
    out["QWEN3_RERANK_CHECKPOINT"] = out["QWEN3_TOKENIZER_CHECKPOINT"] = out["QWEN3_TQ_CHECKPOINT"]
    return out


def write_adapters(root: Path, checkpoint: str) -> list[str]:
    from backend_lib.checkpoint import ModelConfig
    from bench.lora import write_adapter

    mc = ModelConfig.from_dir(checkpoint)
    return [write_adapter(root / f"soak{i}", mc, 4, seed=i).name for i in range(ADAPTERS)]


class Stack:
    """tritonserver + the front, started as serve.sh starts them."""

    def __init__(self, work: Path, size: str):
        from harness.openai_front import Front
        from harness.triton_server import TritonServer

        env = demo_checkpoints(size)
        self.adapter_root = work / "adapters"
        self.adapters = write_adapters(self.adapter_root, env["QWEN3_TQ_CHECKPOINT"])
        env |= {"QWEN3_TQ_ALLOW_RUNTIME_LORA": "true", "QWEN3_TQ_LORA_ROOTS": str(self.adapter_root)}
        log("starting tritonserver (model_repository/, every model)")
        self.triton = TritonServer(ROOT / "model_repository", work / "tritonserver.log", env=env,
                                   extra_args=["--exit-on-error=false"]).start(timeout=900)
        self.front = Front(self.triton.grpc_url, work / "front.log", "--host", "127.0.0.1", "--triton-metrics-url",
                           f"http://127.0.0.1:{self.triton.metrics_port}/metrics", "--log-level", "warning", env=env)
        self.url = self.front.url

    def processes(self) -> dict[str, int]:
        """name -> pid of every process of the stack."""
        out = {"front": self.front.proc.pid, "tritonserver (command)": self.triton.proc.pid}
        children = _children()
        for pid in children.get(self.triton.proc.pid, []):
            out["tritonserver (server)"] = pid
        for pid, instance in self.triton.stub_instances().items():
            model, _, inst = instance.rpartition("_0_")
            out[f"stub {model or instance}" + (f" #{inst}" if inst not in ("", "0") else "")] = pid
        return out

    def pages_used(self) -> float:
        return sum(self.triton.metric("vllm:kv_cache_pages_used", m) for m in ("qwen3_a8w8", "qwen3_tq"))

    def stop(self) -> None:
        self.front.stop()
        self.triton.stop()


def _children() -> dict[int, list[int]]:
    kids = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(entry.name))
    return kids


def sample(pid: int) -> tuple[float, int] | None:
    """(RSS MiB, open fds) of a process, None once it is gone."""
    try:
        rss = next(int(line.split()[1]) / 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


# ----- the traffic ----------------------------------------------------------------------------------------
class Traffic:
    def __init__(self, url: str, adapters: list[str], seed: int = 0):
        self.url, self.adapters = url, adapters
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.sent: Counter = Counter()
        self.outcomes: Counter = Counter()       # (kind, "ok" | "unexpected")
        self.unexpected: list[str] = []
        self.reference: dict[tuple, str] = {}     # (kind, prompt) -> the first greedy text
        self.mismatches = 0
        self.loaded: set[str] = set()

    def _post(self, path: str, body, stream: bool = False, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(f"{self.url}{path}", data=data, headers={"content-type": "application/json"},
                             stream=stream, timeout=300, **kw)

    def _check_greedy(self, key: tuple, text: str) -> bool:
        with self.lock:
            ref = self.reference.setdefault(key, text)
        if ref != text:
            with self.lock:
                self.mismatches += 1
            return False
        return True

    def _stream_text(self, r) -> tuple[str, str | None]:
        text, finish = "", None
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
        return text, finish

    def one(self, kind: str, i: int) -> str | None:
        """Runs one request of `kind`; None when it went as expected, else what happened."""
        prompt = PROMPTS[i % len(PROMPTS)]
        greedy = {"temperature": 0, "ignore_eos": True}
        if kind == "stream":
            model = ("qwen3_a8w8", "qwen3_tq")[i % 2]
            with self._post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 32, "stream": True,
                                                **greedy}, stream=True) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                text, finish = self._stream_text(r)
            if finish != "length":
                return f"finish_reason {finish}"
            return None if self._check_greedy((kind, model, prompt), text) else "greedy text changed"
        if kind == "chat":
            with self._post("/v1/chat/completions", {"model": "qwen3_a8w8", "messages": MESSAGES, "max_tokens": 24,
                                                     "stream": True, **greedy, **NO_THINK}, stream=True) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                text, finish = self._stream_text(r)
            return None if self._check_greedy((kind,), text) else "greedy text changed"
        if kind == "drop":
            with self._post("/v1/completions", {"model": "qwen3_a8w8", "prompt": f"{prompt} {i}", "max_tokens": 500,
                                                "stream": True, **greedy}, stream=True) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        break
            return None   # closed mid-stream
        if kind in ("score", "echo"):
            extra = {"prompt_logprobs": 5} if kind == "score" else {"echo": True, "logprobs": 3}
            r = self._post("/v1/completions", {"model": "qwen3_tq", "prompt": prompt * 20, "max_tokens": 2,
                                               **greedy, **extra})
            if r.status_code != 200:
                return f"status {r.status_code}"
            c = r.json()["choices"][0]
            ok = c.get("prompt_logprobs") if kind == "score" else (c.get("logprobs") or {}).get("token_logprobs")
            return None if ok else "no scores"
        if kind == "n2":
            r = self._post("/v1/completions", {"model": "qwen3_a8w8", "prompt": prompt, "max_tokens": 16, "n": 2,
                                               "temperature": 1.0, "seed": i})
            return None if r.status_code == 200 and len(r.json()["choices"]) == 2 else f"status {r.status_code}"
        if kind == "lora":
            name = self.adapters[i % len(self.adapters)]
            if name not in self.loaded:
                r = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": name,
                                                         "base_model_name": "qwen3_tq"})
                if r.status_code == 200:
                    with self.lock:
                        self.loaded.add(name)
                elif not (r.status_code == 400 and "lora_name" in r.text):   # a concurrent load of the name
                    return f"load: status {r.status_code} {r.text[:120]}"
            r = self._post("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 8, **greedy})
            if r.status_code == 400 and "lora_name" in r.text and name not in self.loaded:
                return None   # its load lost to a concurrent one that has not finished
            if r.status_code != 200:
                return f"status {r.status_code} {r.text[:120]}"
            return None if self._check_greedy((kind, name, prompt), r.json()["choices"][0]["text"]) else \
                "greedy text changed"
        if kind == "hostile":
            bodies = [b"{not json", json.dumps({"model": "qwen3_a8w8", "prompt": "x", "max_tokens": -1}),
                      json.dumps({"model": "qwen3_a8w8", "prompt": "x", "no_such_field": 1}),
                      json.dumps({"model": "qwen3_a8w8", "prompt": "x", "temperature": 1e400}),
                      "[" * 100_000 + "]" * 100_000, json.dumps({"model": "qwen3_a8w8", "prompt": "x" * 2_000_000}),
                      json.dumps({"model": "qwen3_a8w8", "prompt": "x", "n": 10**6}),
                      json.dumps({"model": "qwen3_a8w8", "prompt": "x", "logit_bias": {"9707": 1, "09707": 2}})]
            r = self._post("/v1/completions", bodies[i % len(bodies)])
            return None if r.status_code == 400 else f"status {r.status_code} for hostile body {i % len(bodies)}"
        if kind == "embed":
            r = self._post("/v1/embeddings", {"model": "qwen3_embed", "input": [prompt, prompt * 3]})
            return None if r.status_code == 200 and len(r.json()["data"]) == 2 else f"status {r.status_code}"
        if kind == "rerank":
            r = self._post("/v1/rerank", {"model": "qwen3_rerank", "query": prompt, "documents": PROMPTS})
            return None if r.status_code == 200 else f"status {r.status_code} {r.text[:120]}"
        raise ValueError(kind)

    def run_one(self, kind: str, i: int) -> None:
        with self.lock:
            self.sent[kind] += 1
        try:
            what = self.one(kind, i)
        except Exception as exc:   # a broken connection, a timeout: unexpected
            what = f"{type(exc).__name__}: {exc}"[:200]
        with self.lock:
            self.outcomes[(kind, "ok" if what is None else "unexpected")] += 1
            if what is not None:
                self.unexpected.append(f"{kind}: {what}")


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    stack = Stack(work, args.size)
    traffic = Traffic(stack.url, stack.adapters, args.seed)
    samples: dict[str, list[tuple[float, float, int]]] = defaultdict(list)   # name -> (t, rss, fds)
    duration = args.minutes * 60
    warmup = (args.warmup_minutes * 60) if args.warmup_minutes is not None else duration / 6
    stop = threading.Event()

    def sampler():
        t0 = time.time()
        while not stop.is_set():
            for name, pid in stack.processes().items():
                s = sample(pid)
                if s is not None:
                    samples[name].append((time.time() - t0, *s))
            stop.wait(args.sample_s)

    kinds = [k for k, w in MIX.items() for _ in range(w)]
    rng = random.Random(args.seed)
    threading.Thread(target=sampler, daemon=True).start()
    log(f"{args.minutes:g} min of traffic at {args.rate:g} requests/s at most, {args.concurrency} at once")
    t0 = time.time()
    slots = threading.Semaphore(args.concurrency)
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            i = 0
            while time.time() - t0 < duration:
                slots.acquire()
                kind = rng.choice(kinds)
                pool.submit(lambda k=kind, n=i: (traffic.run_one(k, n), slots.release()))
                i += 1
                time.sleep(max(0.0, t0 + i / args.rate - time.time()))
        elapsed = time.time() - t0
        time.sleep(1.0)
        stack.triton.wait_until(lambda: stack.pages_used() == 0, 30)
        pages = stack.pages_used()
        alive = stack.triton.proc.poll() is None and stack.front.proc.poll() is None
    finally:
        stop.set()
        stack.stop()
    return report(args, traffic, samples, elapsed, warmup, pages, alive)


def _median(values):
    return statistics.median(values) if values else float("nan")


def report(args, traffic: Traffic, samples, elapsed: float, warmup: float, pages: float, alive: bool) -> dict:
    rows, failures = [], []
    for name in sorted(samples):
        pts = [p for p in samples[name] if p[0] >= warmup]
        if len(pts) < 3:
            continue
        third = max(1, len(pts) // 3)
        first, last = pts[:third], pts[-third:]
        rss0, rss1 = _median([p[1] for p in first]), _median([p[1] for p in last])
        fd0, fd1 = _median([p[2] for p in first]), _median([p[2] for p in last])
        grow, fgrow = rss1 - rss0, fd1 - fd0
        bad = (grow > args.rss_bound_mib and grow > rss0 * args.rss_bound_pct / 100) or fgrow > args.fd_bound
        if bad:
            failures.append(f"{name}: RSS {rss0:.1f} -> {rss1:.1f} MiB, fds {fd0:.0f} -> {fd1:.0f}")
        rows.append((name, rss0, rss1, grow, fd0, fd1, bad))
    sent = sum(traffic.sent.values())
    accounted = sum(traffic.outcomes.values())
    unexpected = sum(v for (k, o), v in traffic.outcomes.items() if o == "unexpected")
    if accounted != sent:
        failures.append(f"{sent - accounted} requests without an outcome")
    if unexpected:
        failures.append(f"{unexpected} unexpected outcomes")
    if pages:
        failures.append(f"{pages:.0f} KV pages still in use after the traffic")
    if not alive:
        failures.append("a process of the stack exited")
    lines = [f"Soak (`python -m bench.soak --minutes {args.minutes:g} --rate {args.rate:g} --concurrency "
             f"{args.concurrency} --size {args.size}`, {time.strftime('%Y-%m-%d %H:%M')} UTC): {elapsed / 60:.1f} min, "
             f"{sent} requests ({', '.join(f'{k} {traffic.sent[k]}' for k in MIX if traffic.sent[k])}), "
             f"{accounted} accounted for, {unexpected} unexpected, {traffic.mismatches} greedy mismatches, "
             f"KV pages in use after it {pages:.0f}; RSS and open fds sampled every {args.sample_s:g} s, medians of "
             f"the first and the last third after a {warmup / 60:.1f}-min warm-up (bound: growth over "
             f"{args.rss_bound_pct:g} % and {args.rss_bound_mib:g} MiB, or over {args.fd_bound} fds):", "",
             "| process | RSS after warm-up (MiB) | RSS at the end (MiB) | growth (MiB) | fds after warm-up | fds at the end |",
             "|---|---|---|---|---|---|"]
    for name, rss0, rss1, grow, fd0, fd1, bad in rows:
        lines.append(f"| {name}{' **over the bound**' if bad else ''} | {rss0:.1f} | {rss1:.1f} | {grow:+.1f} | "
                     f"{fd0:.0f} | {fd1:.0f} |")
    lines += ["", "Result: " + ("within every bound" if not failures else "; ".join(failures))]
    if traffic.unexpected:
        lines.append("Unexpected (first 10): " + "; ".join(traffic.unexpected[:10]))
    text = "\n".join(lines)
    print(text, flush=True)
    return {"ok": not failures, "failures": failures, "sent": dict(traffic.sent), "unexpected": traffic.unexpected,
            "report": text, "processes": {r[0]: {"rss0": r[1], "rss1": r[2], "fd0": r[4], "fd1": r[5]} for r in rows}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests a second at most")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--size", default=os.environ.get("DEMO_SIZE", "tiny"), help="demo checkpoint size (serve.sh's)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=None)
    ap.add_argument("--rss-bound-pct", type=float, default=10.0)
    ap.add_argument("--rss-bound-mib", type=float, default=32.0)
    ap.add_argument("--fd-bound", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the result as JSON here too")
    args = ap.parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
