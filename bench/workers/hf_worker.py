"""transformers `generate`, the baseline (see common.py for the protocol).

    python -m bench.workers.hf_worker --checkpoint DIR
"""
from __future__ import annotations

from bench.workers.common import arg_parser, serve


def main() -> None:
    args = arg_parser(__doc__).parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()

    def run(batch_prompts, max_tokens):
        x = torch.tensor(batch_prompts)
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0)

    serve(run)


if __name__ == "__main__":
    main()
