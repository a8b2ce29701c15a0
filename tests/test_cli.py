"""The generate and score command-line tools, as a user runs them."""
from __future__ import annotations

import json
import math
import subprocess
import sys

from helpers import ROOT


def run(*args):
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_generate_json_matches_engine(bf16_ckpt, bf16_engine):
    out = run("backend_lib.generate", "--checkpoint", str(bf16_ckpt), "--prompt", "介绍一下北京故宫",
              "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--dtype", "float32", "--page-size", "16",
              "--json")
    res = json.loads(out.strip().splitlines()[-1])
    ids = bf16_engine.tokenizer.encode("介绍一下北京故宫")
    expected = bf16_engine.generate([ids], bf16_engine.make_params(
        {"temperature": 0, "max_tokens": 12, "ignore_eos": True}))[0]
    assert res["output_ids"] == expected["output_ids"] and res["text"] == expected["text"]
    assert res["finish_reason"] == "length" and res["prompt_ids"] == ids


def test_generate_streams_text(a8w8_ckpt):
    out = run("backend_lib.generate", "--checkpoint", str(a8w8_ckpt), "--prompt-ids", "9707,11,1879,0",
              "--max-tokens", "6", "--temperature", "0", "--ignore-eos")
    assert out.strip()


def test_generate_rejects_bad_request(bf16_ckpt):
    proc = subprocess.run([sys.executable, "-m", "backend_lib.generate", "--checkpoint", str(bf16_ckpt), "--prompt",
                           "hi", "--top-p", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "top_p" in proc.stderr



def test_score_json(bf16_ckpt, bf16_engine):
    out = run("backend_lib.score", "--checkpoint", str(bf16_ckpt), "--ids", "9707,11,1879,0,2585", "--dtype",
              "float32", "--page-size", "16", "--json")
    res = json.loads(out.strip().splitlines()[-1])
    assert res["logprobs"][0] is None and len(res["logprobs"]) == 5
    assert res["logprobs"][1:] == bf16_engine.score([9707, 11, 1879, 0, 2585])[1:]
    assert math.isclose(res["perplexity"], math.exp(-sum(res["logprobs"][1:]) / 4))
