// Paged causal attention over a dense (fp32 / bf16) KV cache, for prefill chunks and decode alike.
//
// One work item is (query row, KV head): the G query heads of the GQA group read each cached
// key and value row once. Keys are visited page by page in position order with an online
// softmax, so a query at position p gets bit-identical results whether it arrives in a prefill
// chunk, a whole prompt or a decode step, and whatever else shares the batch.
#include "common.h"
#include <vector>

namespace qk {
namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 1024;

template <typename QT, typename CT>
void attend_row(const QT* q, const CT* k_cache, const CT* v_cache, const int32_t* block_table, int64_t kv_head,
                int64_t n_keys, int64_t KVH, int64_t S, int64_t D, int G, float scale, QT* out,
                int64_t q_head_stride) {
  float qv[kMaxGroup][kMaxHeadDim];
  float acc[kMaxGroup][kMaxHeadDim];
  float mx[kMaxGroup], den[kMaxGroup];
  static thread_local std::vector<float> scores_buf;
  scores_buf.resize(static_cast<size_t>(kMaxGroup) * S);
  float* scores = scores_buf.data();
  for (int h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      qv[h][d] = to_f(q[h * q_head_stride + d]);
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
    for (int64_t j = 0; j < nk; ++j) {
      const CT* krow = kp + j * D;
      for (int h = 0; h < G; ++h) {
        float part[16] = {0};
        for (int64_t d = 0; d < D; ++d) part[d & 15] += qv[h][d] * to_f(krow[d]);
        for (int s = 8; s > 0; s >>= 1)
          for (int l = 0; l < s; ++l) part[l] += part[l + s];
        scores[h * S + j] = part[0] * scale;
      }
    }
    for (int h = 0; h < G; ++h) {
      float bm = mx[h];
      for (int64_t j = 0; j < nk; ++j) bm = std::max(bm, scores[h * S + j]);
      const float alpha = std::exp(mx[h] - bm);
      den[h] *= alpha;
      for (int64_t d = 0; d < D; ++d) acc[h][d] *= alpha;
      for (int64_t j = 0; j < nk; ++j) {
        const float e = std::exp(scores[h * S + j] - bm);
        scores[h * S + j] = e;
        den[h] += e;
      }
      mx[h] = bm;
    }
    for (int64_t j = 0; j < nk; ++j) {
      const CT* vrow = vp + j * D;
      for (int h = 0; h < G; ++h) {
        const float pj = scores[h * S + j];
        for (int64_t d = 0; d < D; ++d) acc[h][d] += pj * to_f(vrow[d]);
      }
    }
  }
  for (int h = 0; h < G; ++h) {
    const float inv = 1.0f / den[h];
    for (int64_t d = 0; d < D; ++d) out[h * q_head_stride + d] = from_f<QT>(acc[h][d] * inv);
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
                             static_cast<float>(scale), op + off, D);
        }
      });
    });
  });
  return out;
}

}  // namespace qk
