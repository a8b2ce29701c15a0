// Declarations of the CPU kernels (defined in the other .cpp files): the one list that ops.cpp registers
// and decode_layers.cpp calls.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <memory>
#include <mutex>

#include "common.h"

namespace qk {
// decode_layers' tensors held once (torch.classes.qwen3_cpu.LayerPack, built by models/qwen3_layer_loop.py per KV
// cache): the layers' list, the K and V caches and the final norm. Handed to decode_layers as one object a step
// instead of ~650 tensors: torch.ops converts a Tensor[] argument tensor by tensor (~0.25 ms warm, ~0.45 ms after a
// step's weight stream has evicted the tensors' headers from the caches, measured on the 2-core Zen 4 VM), and the
// region's pointers and checks over the layers (its prologue, ~0.15 ms) are built at the first step and kept here.
struct LayerPack : torch::CustomClassHolder {
  std::vector<at::Tensor> layers, k_caches, v_caches;
  at::Tensor final_norm;
  // decode_layers.cpp's region plan of the layers (a Step<T> without the step's inputs) and what it was built for
  std::mutex mu;
  std::shared_ptr<const void> plan;
  std::array<double, 8> plan_key{};
  LayerPack(std::vector<at::Tensor> l, std::vector<at::Tensor> k, std::vector<at::Tensor> v, at::Tensor norm)
      : layers(std::move(l)), k_caches(std::move(k)), v_caches(std::move(v)), final_norm(std::move(norm)) {}
};

at::Tensor float_pack(const at::Tensor& w);
at::Tensor float_packed_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t K);
std::tuple<at::Tensor, int64_t> greedy_head_picks(const at::Tensor& x, const at::Tensor& packed8,
                                                  const at::Tensor& w_scale, const at::Tensor& colsum,
                                                  const at::Tensor& c, const at::Tensor& d, double wmax,
                                                  const at::Tensor& packed, int64_t N, double coef, double margin,
                                                  int64_t limit);
at::Tensor float_linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& ids);
std::tuple<at::Tensor, at::Tensor> greedy_screen(const at::Tensor& a, const at::Tensor& c, const at::Tensor& d,
                                                 const at::Tensor& terms, double coef, int64_t limit);
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        c10::optional<at::ScalarType> out_dtype);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                 double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& qkv, const at::Tensor& q_w,
                                                            const at::Tensor& k_w, const at::Tensor& positions,
                                                            const at::Tensor& cos_sin, int64_t H, int64_t KVH,
                                                            double eps);
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
void tq_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_codes, at::Tensor& k_scales,
              at::Tensor& v_codes, at::Tensor& v_scales, const at::Tensor& slot_mapping, const at::Tensor& R,
              const at::Tensor& cents, const at::Tensor& bounds);
at::Tensor tq_paged_attention(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scales,
                              const at::Tensor& v_codes, const at::Tensor& v_scales, const at::Tensor& block_tables,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& R,
                              const at::Tensor& cents, double scale);
at::Tensor a8w8_pack(const at::Tensor& w_q);
at::Tensor a8w8_colsum(const at::Tensor& w_q);
at::Tensor a8w8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& colsum);
at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, const at::Tensor& perm, int64_t N, double lut_zero);
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N);
at::Tensor decode_layers(const at::Tensor& x, const c10::intrusive_ptr<LayerPack>& pack,
                         const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         int64_t H, int64_t KVH, double eps, double scale, const c10::optional<at::Tensor>& aux,
                         at::IntArrayRef aux_layers);
at::Tensor decode_layers_profile(bool enable);
// argmax.cpp: (ids [B], the rows holding a NaN or an infinity) of logits [B, V]: each row's first index of its maximum
std::tuple<std::vector<int64_t>, std::vector<int64_t>> argmax_rows(const at::Tensor& logits);
// memory.cpp: a zeroed CPU tensor for a large buffer streamed every step (packed weights, KV pools), on huge pages
at::Tensor stream_zeros(at::IntArrayRef sizes, at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob);
std::string moe_route_path(int64_t top_k, bool norm_topk_prob);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& table, const at::Tensor& lut, at::IntArrayRef dims);
}  // namespace qk
