// The Qwen3-MoE router's top-k (layers/moe.py's route(): softmax in fp32, torch.topk, the renormalization, the cast
// to the logits' dtype), bit for bit, for the region (decode_layers.cpp), the op path and the tests (moe_route).
#pragma once

#include <tuple>

#include "common.h"

namespace qk {
// (ids int64 [T, k], weights [T, k] in the logits' dtype) of router logits [T, E] (float32 or bfloat16).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob);
// The same into ids [Tn, k] and weights [Tn, k] without an ATen op (scratch: E + k floats), or false where this path
// does not apply (route.cpp: a capability or k whose bits it does not reproduce; then route() computes them).
template <typename T>
bool route_rows(const T* logits, int64_t Tn, int64_t E, int64_t k, bool norm_topk_prob, int64_t* ids, T* weights,
                float* scratch);
}  // namespace qk
