// Building blocks of the paged attention kernels (dense and TurboQuant): scores of a GQA group
// against one row, weighted accumulation of one row, and the online-softmax update of a page block.
#pragma once

#include "vec.h"

namespace qk {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 1024;

// Scores of G query heads against one key row, times `scale`.
template <typename CT>
inline void score_row(const float (*qv)[kMaxHeadDim], int G, const CT* krow, int64_t D, float scale, float* out,
                      int64_t stride) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 kv[kMaxHeadDim / 16];
    const int64_t C = D / 16;
    for (int64_t c = 0; c < C; ++c) kv[c] = load16x(krow + c * 16);
    for (int h = 0; h < G; ++h) {
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qv[h]), kv[0]);
      for (int64_t c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qv[h] + c * 16), kv[c], s);
      out[h * stride] = _mm512_reduce_add_ps(s) * scale;
    }
    return;
  }
#endif
  for (int h = 0; h < G; ++h) {
    float part[16] = {0};
    for (int64_t d = 0; d < D; ++d) part[d & 15] += qv[h][d] * to_f(krow[d]);
    for (int s = 8; s > 0; s >>= 1)
      for (int l = 0; l < s; ++l) part[l] += part[l + s];
    out[h * stride] = part[0] * scale;
  }
}

// acc[h] += p[h] * vrow for the G heads.
template <typename CT>
inline void accumulate_row(float (*acc)[kMaxHeadDim], int G, const float* p, int64_t stride, const CT* vrow,
                           int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m512 v = load16x(vrow + c * 16);
      for (int h = 0; h < G; ++h)
        _mm512_storeu_ps(acc[h] + c * 16,
                         _mm512_fmadd_ps(_mm512_set1_ps(p[h * stride]), v, _mm512_loadu_ps(acc[h] + c * 16)));
    }
    return;
  }
#endif
  for (int h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) acc[h][d] += p[h * stride] * to_f(vrow[d]);
}

// One block of scores [G][n] (already in `scores`, row stride S): online-softmax update.
inline void softmax_block(float* scores, int64_t S, int64_t n, int G, float* mx, float* den,
                          float (*acc)[kMaxHeadDim], int64_t D) {
  for (int h = 0; h < G; ++h) {
    float* s = scores + h * S;
    float bm = mx[h];
    for (int64_t j = 0; j < n; ++j) bm = std::max(bm, s[j]);
    const float alpha = std::exp(mx[h] - bm);
    for (int64_t j = 0; j < n; ++j) s[j] -= bm;
    exp_inplace(s, n);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += s[j];
    den[h] = den[h] * alpha + sum;
    for (int64_t d = 0; d < D; ++d) acc[h][d] *= alpha;
    mx[h] = bm;
  }
}

}  // namespace qk
