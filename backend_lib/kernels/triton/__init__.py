"""OpenAI Triton kernel set for CUDA GPUs (issue 21): not written yet; `device: cuda` runs the reference set."""
