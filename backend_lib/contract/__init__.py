"""The request contract, torch-free: what a request may ask and how it is refused, shared by the engine, the
Triton models and the OpenAI front (which imports no torch).

- `errors`: `RequestError`, every layer's "error naming the field" (a 400 / INVALID_ARG).
- `finish`: `FinishReason`, the finish reasons on the wire.
- `fields`: the numeric ranges of the sampling fields (`RANGES`), the server's limits, the neutral vLLM keys,
  logit_bias, min_tokens against max_tokens, LoRA adapter names.
- `choices`: n (`MAX_N`) and the seed of each of n choices.
- `structured`: the structured-output constraint (`StructuredSpec`).
- `json_input`: the one parser of the JSON texts a client sends (`loads`).
"""
