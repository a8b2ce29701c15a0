// Paged causal attention over a dense (fp32 / bf16) KV cache, for prefill chunks and decode alike.
//
// One work item is (query row, KV head): the G query heads of the GQA group read each cached key
// and value row once. Keys are visited page by page in position order with an online softmax, so
// a query at position p gets bit-identical results whether it arrives in a prefill chunk, a whole
// prompt or a decode step, and whatever else shares the batch.
#include "attention_common.h"
#include <vector>

namespace qk {
namespace {

template <typename QT, typename CT>
void attend_row(const QT* q, const CT* k_cache, const CT* v_cache, const int32_t* block_table, int64_t kv_head,
                int64_t n_keys, int64_t KVH, int64_t S, int64_t D, int G, float scale, QT* out) {
  alignas(64) float qv[kMaxGroup][kMaxHeadDim];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  float mx[kMaxGroup], den[kMaxGroup];
  static thread_local std::vector<float> scores_buf;
  scores_buf.resize(static_cast<size_t>(kMaxGroup) * S);
  float* scores = scores_buf.data();
  for (int h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      qv[h][d] = to_f(q[h * D + d]);
      acc[h][d] = 0.f;
    }
    mx[h] = -INFINITY;
    den[h] = 0.f;
  }
  const int64_t n_pages = (n_keys + S - 1) / S;
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t page = block_table[p];
    const int64_t nk = std::min(S, n_keys - p * S);
    const CT* kp = k_cache + (page * KVH + kv_head) * S * D;
    const CT* vp = v_cache + (page * KVH + kv_head) * S * D;
    for (int64_t j = 0; j < nk; ++j) score_row(qv, G, kp + j * D, D, scale, scores + j, S);
    softmax_block(scores, S, nk, G, mx, den, acc, D);
    for (int64_t j = 0; j < nk; ++j) accumulate_row(acc, G, scores + j, S, vp + j * D, D);
  }
  for (int h = 0; h < G; ++h) {
    const float inv = 1.0f / den[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = from_f<QT>(acc[h][d] * inv);
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& query_start_loc_in,
                           const at::Tensor& seq_lens_in, double scale) {
  check_float_dtype(q_in, "q");
  check_float_dtype(k_cache, "k_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4, "q must be [T, H, D] and caches [P, KVH, S, D]");
  auto q = q_in.contiguous();
  auto bt = block_tables_in.to(at::kInt).contiguous();
  auto qsl = query_start_loc_in.to(at::kInt).contiguous();
  auto lens = seq_lens_in.to(at::kInt).contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim mismatch between q and cache");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  const int G = static_cast<int>(H / KVH);
  TORCH_CHECK(G <= kMaxGroup && D <= kMaxHeadDim && S <= kMaxPage, "attention: unsupported shape");
  const int64_t B = lens.size(0);
  auto out = at::empty_like(q);
  if (T == 0) return out;
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();
  std::vector<int32_t> seq_of_row(T);
  for (int64_t b = 0; b < B; ++b)
    for (int32_t t = qs[b]; t < qs[b + 1]; ++t) seq_of_row[t] = static_cast<int32_t>(b);
  const int64_t max_pages = bt.size(1);
  QK_DISPATCH_FLOAT(q.scalar_type(), "paged_attention", [&] {
    using QT = scalar_t;
    QK_DISPATCH_FLOAT(k_cache.scalar_type(), "paged_attention", [&] {
      using CT = scalar_t;
      const QT* qp = q.data_ptr<QT>();
      QT* op = out.data_ptr<QT>();
      const CT* kc = k_cache.data_ptr<CT>();
      const CT* vc = v_cache.data_ptr<CT>();
      const int32_t* btp = bt.data_ptr<int32_t>();
      at::parallel_for(0, T * KVH, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t item = i0; item < i1; ++item) {
          const int64_t t = item / KVH, g = item % KVH;
          const int64_t b = seq_of_row[t];
          const int64_t n_q = qs[b + 1] - qs[b];
          const int64_t pos = ls[b] - n_q + (t - qs[b]);
          const int64_t off = (t * H + g * G) * D;
          attend_row<QT, CT>(qp + off, kc, vc, btp + b * max_pages, g, pos + 1, KVH, S, D, G,
                             static_cast<float>(scale), op + off);
        }
      });
    });
  });
  return out;
}

// Scatter new K/V rows [T, KVH, D] into the paged caches at slot_mapping (page * S + offset).
void write_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto k = k_in.to(k_cache.scalar_type()).contiguous();
  auto v = v_in.to(v_cache.scalar_type()).contiguous();
  auto slots = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), S = k_cache.size(2);
  const int64_t es = k.element_size(), row = D * es;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t page = sp[t] / S, off = sp[t] % S;
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t dst = ((page * KVH + g) * S + off) * row;
      std::memcpy(kd + dst, ks + (t * KVH + g) * row, row);
      std::memcpy(vd + dst, vs + (t * KVH + g) * row, row);
    }
  }
}

}  // namespace qk
