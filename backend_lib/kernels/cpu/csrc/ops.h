// Declarations of the CPU kernels (defined in the other .cpp files): the one list that ops.cpp registers
// and decode_layers.cpp calls.
#pragma once

#include "common.h"

namespace qk {
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
at::Tensor decode_layers(const at::Tensor& x, at::TensorList layers, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& final_norm, int64_t H, int64_t KVH, double eps, double scale,
                         const c10::optional<at::Tensor>& aux, at::IntArrayRef aux_layers);
at::Tensor decode_layers_profile(bool enable);
// memory.cpp: a zeroed CPU tensor for a large buffer streamed every step (packed weights, KV pools), on huge pages
at::Tensor stream_zeros(at::IntArrayRef sizes, at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& table, const at::Tensor& lut, at::IntArrayRef dims);
}  // namespace qk
