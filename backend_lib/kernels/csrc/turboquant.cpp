// TurboQuant 4-bit KV cache on the CPU: encode rows into their pages, and paged attention computed
// in the rotated space straight from the nibble codes (nothing is dequantized into a buffer of the
// context). Rows are processed one at a time in a fixed order, so results are batch invariant.
//
// Layout per layer: codes uint8 [pages, kv_heads, page_size, d/2] with byte c = idx[c] | idx[c+d/2] << 4,
// scales fp32 [pages, kv_heads, page_size] = ||x|| / ||centroids[idx]||.
#include "attention_common.h"
#include <vector>

namespace qk {
namespace {

constexpr int kMaxD = kMaxHeadDim;
constexpr int kMaxG = kMaxGroup;

// y[j] = sum_i x[i] * R[i][j] (row vector times R), accumulated over i in order.
inline void rotate_row(const float* x, const float* R, int64_t D, float* y) {
  for (int64_t j = 0; j < D; ++j) y[j] = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float xi = x[i];
    const float* r = R + i * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) y[j] += xi * r[j];
  }
}

// o[i] = sum_j y[j] * R[i][j] (row vector times R^T).
inline void unrotate_row(const float* y, const float* R, int64_t D, float* o) {
  for (int64_t i = 0; i < D; ++i) {
    const float* r = R + i * D;
    float part[16] = {0};
    for (int64_t j = 0; j < D; ++j) part[j & 15] += y[j] * r[j];
    for (int s = 8; s > 0; s >>= 1)
      for (int l = 0; l < s; ++l) part[l] += part[l + s];
    o[i] = part[0];
  }
}

template <typename T>
void encode_row(const T* x, const float* R, const float* cents, const float* bounds, int64_t D, uint8_t* codes,
                float* scale) {
  float xf[kMaxD], y[kMaxD];
  float part[16] = {0};
  for (int64_t i = 0; i < D; ++i) {
    xf[i] = to_f(x[i]);
    part[i & 15] += xf[i] * xf[i];
  }
  for (int s = 8; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) part[l] += part[l + s];
  const float n = std::sqrt(part[0] + 1e-6f);
  for (int64_t i = 0; i < D; ++i) xf[i] /= n;
  rotate_row(xf, R, D, y);
  uint8_t idx[kMaxD];
  float cn = 0.f;
  for (int64_t j = 0; j < D; ++j) {
    int k = 0;
    for (int b = 0; b < 15; ++b) k += (bounds[b] < y[j]);
    idx[j] = static_cast<uint8_t>(k);
    cn += cents[k] * cents[k];
  }
  const int64_t h = D / 2;
  for (int64_t c = 0; c < h; ++c) codes[c] = static_cast<uint8_t>(idx[c] | (idx[c + h] << 4));
  *scale = n / std::sqrt(cn);
}

// Centroid values of one packed row, in dimension order.
inline void unpack_row(const uint8_t* codes, const float* cents, int64_t D, float* out) {
  const int64_t h = D / 2;
#if defined(__AVX512F__)
  if (h % 16 == 0) {
    const __m512 table = _mm512_loadu_ps(cents);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t c = 0; c < h; c += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, low));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low));
      _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(lo, table));
      _mm512_storeu_ps(out + h + c, _mm512_permutexvar_ps(hi, table));
    }
    return;
  }
#endif
  for (int64_t c = 0; c < h; ++c) {
    out[c] = cents[codes[c] & 0xF];
    out[c + h] = cents[codes[c] >> 4];
  }
}

template <typename QT>
void tq_attend_row(const QT* q, int64_t q_stride, const uint8_t* kc, const float* ks, const uint8_t* vc,
                   const float* vs, const int32_t* block_table, int64_t kv_head, int64_t n_keys, int64_t KVH,
                   int64_t S, int64_t D, int G, const float* R, const float* cents, float sm_scale, QT* out) {
  alignas(64) float qf[kMaxD], qr[kMaxG][kMaxD], acc[kMaxG][kMaxD], row[kMaxD];
  float mx[kMaxG], den[kMaxG];
  static thread_local std::vector<float> sbuf;
  sbuf.resize(static_cast<size_t>(kMaxG) * S);
  float* scores = sbuf.data();
  for (int h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) qf[d] = to_f(q[h * q_stride + d]);
    rotate_row(qf, R, D, qr[h]);
    for (int64_t d = 0; d < D; ++d) acc[h][d] = 0.f;
    mx[h] = -INFINITY;
    den[h] = 0.f;
  }
  const int64_t hd = D / 2;
  const int64_t n_pages = (n_keys + S - 1) / S;
  float pv[kMaxG];
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t page = block_table[p];
    const int64_t nk = std::min(S, n_keys - p * S);
    const int64_t base = (page * KVH + kv_head) * S;
    for (int64_t j = 0; j < nk; ++j) {
      unpack_row(kc + (base + j) * hd, cents, D, row);
      score_row(qr, G, row, D, ks[base + j] * sm_scale, scores + j, S);
    }
    softmax_block(scores, S, nk, G, mx, den, acc, D);
    for (int64_t j = 0; j < nk; ++j) {
      unpack_row(vc + (base + j) * hd, cents, D, row);
      const float vsj = vs[base + j];
      for (int h = 0; h < G; ++h) pv[h] = scores[h * S + j] * vsj;
      accumulate_row(acc, G, pv, 1, row, D);
    }
  }
  for (int h = 0; h < G; ++h) {
    const float inv = 1.0f / den[h];
    for (int64_t d = 0; d < D; ++d) acc[h][d] *= inv;
    unrotate_row(acc[h], R, D, row);
    for (int64_t d = 0; d < D; ++d) out[h * q_stride + d] = from_f<QT>(row[d]);
  }
}

void check_codebook(const at::Tensor& R, const at::Tensor& cents, int64_t D) {
  TORCH_CHECK(R.scalar_type() == at::kFloat && R.is_contiguous() && R.size(0) == D && R.size(1) == D,
              "rotation must be a contiguous fp32 [d, d] matrix");
  TORCH_CHECK(cents.scalar_type() == at::kFloat && cents.numel() == 16, "centroids must be 16 fp32 values");
  TORCH_CHECK(D % 2 == 0 && D <= kMaxD, "head_dim must be even and <= ", kMaxD);
}

}  // namespace

void tq_write(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_codes, at::Tensor& k_scales,
              at::Tensor& v_codes, at::Tensor& v_scales, const at::Tensor& slot_mapping_in, const at::Tensor& R,
              const at::Tensor& cents_in, const at::Tensor& bounds_in) {
  check_float_dtype(k_in, "k");
  TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type(), "k and v dtypes differ");
  auto k = k_in.contiguous();
  auto v = v_in.contiguous();
  auto slots = slot_mapping_in.to(at::kLong).contiguous();
  auto cents = cents_in.contiguous();
  auto bounds = bounds_in.contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  check_codebook(R, cents, D);
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && k_codes.is_contiguous() && k_codes.size(3) == D / 2,
              "codes must be contiguous uint8 [pages, kv_heads, page_size, d/2]");
  const int64_t S = k_codes.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  QK_DISPATCH_FLOAT(k.scalar_type(), "tq_write", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, T * KVH, 8, [&](int64_t i0, int64_t i1) {
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t t = it / KVH, g = it % KVH;
        const int64_t slot = sp[t];
        const int64_t dst = ((slot / S) * KVH + g) * S + slot % S;
        encode_row(kp + it * D, R.data_ptr<float>(), cents.data_ptr<float>(), bounds.data_ptr<float>(), D,
                   k_codes.data_ptr<uint8_t>() + dst * (D / 2), k_scales.data_ptr<float>() + dst);
        encode_row(vp + it * D, R.data_ptr<float>(), cents.data_ptr<float>(), bounds.data_ptr<float>(), D,
                   v_codes.data_ptr<uint8_t>() + dst * (D / 2), v_scales.data_ptr<float>() + dst);
      }
    });
  });
}

at::Tensor tq_paged_attention(const at::Tensor& q_in, const at::Tensor& k_codes, const at::Tensor& k_scales,
                              const at::Tensor& v_codes, const at::Tensor& v_scales, const at::Tensor& block_tables_in,
                              const at::Tensor& query_start_loc_in, const at::Tensor& seq_lens_in, const at::Tensor& R,
                              const at::Tensor& cents_in, double scale) {
  check_float_dtype(q_in, "q");
  auto q = q_in.contiguous();
  auto bt = block_tables_in.to(at::kInt).contiguous();
  auto qsl = query_start_loc_in.to(at::kInt).contiguous();
  auto lens = seq_lens_in.to(at::kInt).contiguous();
  auto cents = cents_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_codes.size(1), S = k_codes.size(2);
  check_codebook(R, cents, D);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxG, "unsupported GQA group size");
  const int G = static_cast<int>(H / KVH);
  auto out = at::empty_like(q);
  if (T == 0) return out;
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();
  const int64_t B = lens.size(0), max_pages = bt.size(1);
  std::vector<int32_t> seq_of_row(T);
  for (int64_t b = 0; b < B; ++b)
    for (int32_t t = qs[b]; t < qs[b + 1]; ++t) seq_of_row[t] = static_cast<int32_t>(b);
  QK_DISPATCH_FLOAT(q.scalar_type(), "tq_paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T * KVH, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t t = item / KVH, g = item % KVH;
        const int64_t b = seq_of_row[t];
        const int64_t pos = ls[b] - (qs[b + 1] - qs[b]) + (t - qs[b]);
        const int64_t off = (t * H + g * G) * D;
        tq_attend_row<scalar_t>(qp + off, D, k_codes.data_ptr<uint8_t>(), k_scales.data_ptr<float>(),
                                v_codes.data_ptr<uint8_t>(), v_scales.data_ptr<float>(), bt.data_ptr<int32_t>() + b * max_pages,
                                g, pos + 1, KVH, S, D, G, R.data_ptr<float>(), cents.data_ptr<float>(),
                                static_cast<float>(scale), op + off);
      }
    });
  });
  return out;
}

}  // namespace qk
