// The kernels' pieces at pointer level, with no parallel region and no allocation of their own: the ops of
// ops.h are built from them (each op = its pieces over all rows / panels / items on the intra-op threads), and
// decode_layers.cpp calls them inside its one parallel region per step, handing the rows, panels and work items
// to its threads itself. Whichever thread computes a row, panel or item, it runs the same code in the same
// order as the op does, so the results are bit-identical to the ops'.
#pragma once

#include "common.h"

namespace qk {
namespace parts {

// ---- A8W8 (a8w8.cpp) ----
// The quantized activation row's element size (uint8 with the VNNI +128 offset, int16 otherwise) and the
// packed weight's panel height: a8w8_pack's layout [NP, KG, kPanel, kGroup].
int64_t a8w8_act_bytes();
int64_t a8w8_panel();
int64_t a8w8_group();
// s_t and q_t of one row: x [K] -> q [Kp] (a8w8_act_bytes each, zero padded), returns the row's scale.
template <typename T>
float a8w8_quantize_row(const T* x, int64_t K, int64_t Kp, void* q);
// Output panels [p0, p1) for the M quantized rows xu [M, Kp] (scales [M]): y [M, N] (row stride ldy).
template <typename T>
void a8w8_panels(const void* xu, const float* scales, int64_t M, int64_t Kp, const int8_t* packed, int64_t KG,
                 const float* w_scale, const int32_t* colsum, int64_t N, int64_t p0, int64_t p1, T* y, int64_t ldy);

// ---- float linear (linear.cpp) ----
// Whether float_linear widens bf16 activations to fp32 before its panels (the AVX2 build; exact either way).
bool float_linear_widens_bf16();
// Output panels [p0, p1) of y [M, N] (row stride N) = x [M, Kp] times a float_pack'ed weight, as float_linear.
template <typename XT, typename WT, typename OT>
void float_panels(const XT* x, int64_t Kp, const WT* packed, OT* y, int64_t M, int64_t N, int64_t p0, int64_t p1);

// ---- W4A16 (w4a16.cpp) ----
// Whether the batch-1 table lookup is exact for the fp32 row x [K] (w4a16_linear's check).
bool w4a16_lut_row(const float* x, int64_t K);
// Output panels [p0, p1) of y [M, N] (row stride N) for the fp32 rows x [M, K] (columns in the weight's order),
// as w4a16_linear; lut_zero >= 0 only for M = 1 with an exact row and weight.
template <typename T>
void w4a16_panel_range(const float* x, int64_t M, int64_t K, const int32_t* packed, const float* scales,
                       const float* zeros, int64_t G, int64_t p0, int64_t p1, T* y, int64_t N, float lut_zero);

// ---- W4A8: int4 codes (zero point 8) on int8 activations (w4a8.cpp) ----
// Bytes of one prepared row of K features and G groups (w4a8_prepare_row): a block of its own per row.
int64_t w4a8_row_bytes(int64_t K, int64_t G);
// Row x [K] quantized per row as w4a8_linear does, into its block at dst (4-byte aligned); returns its scale.
template <typename T>
float w4a8_prepare_row(const T* x, int64_t K, int64_t G, char* dst);
// Output panels [p0, p1) of y [M, N] (row stride N) for M prepared rows (blocks one after another at rows, scales
// sx [M]), as w4a8_linear.
template <typename T>
void w4a8_panel_range(const char* rows, const float* sx, int64_t M, int64_t K, const int32_t* packed,
                      const float* scales, int64_t G, int64_t p0, int64_t p1, T* y, int64_t N);

// ---- norms, RoPE, SwiGLU (norm.cpp) ----
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps);
// h = x + r (the new residual), out = RMSNorm(h) * w.
template <typename T>
void add_rms_norm_row(const T* x, const T* r, const T* w, T* out, T* h, int64_t D, float eps);
// One head of qk_norm_rope: RMSNorm(row) * w, then rotate-half RoPE with cos / sin = cosv, cosv + D / 2.
template <typename T>
void qk_norm_rope_head(const T* row, const T* w, const float* cosv, int64_t D, float eps, T* dst);
// out [I] = silu(x[0:I]) * x[I:2I]
template <typename T>
void silu_mul_row(const T* x, int64_t I, T* out);

// ---- dense paged attention (attention.cpp) ----
struct AttnArgs {
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int64_t max_pages, H, KVH, D, S, KW;
  float scale;
};
// The most rows of one work item (query positions times H / KVH); paged_attention's items hold
// max(1, attention_item_rows() / (H / KVH)) query positions each (the last of a sequence fewer).
int64_t attention_item_rows();
// Rows [t0, t0 + nq) of sequence seq (query positions of one sequence, nq * H / KVH <= 32 rows) for KV head
// kv_head: q [T, H, D] -> out [T, H, D], as paged_attention computes that work item.
template <typename T>
void dense_attention_item(const AttnArgs& a, int32_t seq, int32_t kv_head, int32_t t0, int32_t nq, const T* q,
                          const T* k_cache, const T* v_cache, T* out);
// One key / value row of KV head g into the caches at slot (page * S + offset), as write_kv.
template <typename T>
void write_kv_row(const T* k, const T* v, T* k_cache, T* v_cache, int64_t slot, int64_t g, int64_t KVH, int64_t D,
                  int64_t S, int64_t KW);

}  // namespace parts
}  // namespace qk
