// Batch-invariant float linear y = x W^T for the CPU.
//
// Every output element is one dot product over K accumulated in a fixed order (16 fp32 lanes,
// then a fixed horizontal tree), whatever M is and whichever rows share the call: a token's
// result never depends on the batch it is in. Register blocking (up to 4 rows x 4 outputs)
// reuses each loaded weight vector across the rows of the batch.
#include "common.h"

namespace qk {
namespace {

constexpr int kMB = 4;  // rows of x per micro-tile
constexpr int kNB = 4;  // rows of W per micro-tile

#if defined(__AVX512F__)
inline __m512 load_bf16x16_as_f32(const uint16_t* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_f32x16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_x16(const float* p, __mmask16 m) { return load_f32x16(p, m); }
inline __m512 load_x16(const c10::BFloat16* p, __mmask16 m) {
  return load_bf16x16_as_f32(reinterpret_cast<const uint16_t*>(p), m);
}
inline __m512 load_w16(const float* p, __mmask16 m) { return load_f32x16(p, m); }
inline __m512 load_w16(const c10::BFloat16* p, __mmask16 m) {
  return load_bf16x16_as_f32(reinterpret_cast<const uint16_t*>(p), m);
}

// Generic fp32-FMA micro-tile: x and W converted to fp32 on load.
template <int MB, int NB, typename XT, typename WT>
inline void tile_fma(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* out) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = (K - k >= 16) ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_w16(w + j * ldw + k, m);
    for (int i = 0; i < MB; ++i) {
      __m512 xv = load_x16(x + i * ldx + k, m);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if defined(__AVX512BF16__)
// bf16 x bf16 micro-tile on the AVX512-BF16 dot-product instruction (pairs accumulated in fp32).
template <int MB, int NB>
inline void tile_bf16dp(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, int64_t K,
                        float* out) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t rem = K - k;
    const __mmask32 m = rem >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << rem) - 1);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * ldw + k);
    for (int i = 0; i < MB; ++i) {
      __m512i xv = _mm512_maskz_loadu_epi16(m, x + i * ldx + k);
      for (int j = 0; j < NB; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif
#endif  // __AVX512F__

// Portable micro-tile (no AVX-512): 16 partial sums per output, reduced pairwise, so that the
// order matches no particular batch shape and stays fixed.
template <int MB, int NB, typename XT, typename WT>
inline void tile_scalar(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* out) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float part[16] = {0};
      for (int64_t k = 0; k < K; ++k) part[k & 15] += to_f(x[i * ldx + k]) * to_f(w[j * ldw + k]);
      for (int s = 8; s > 0; s >>= 1)
        for (int l = 0; l < s; ++l) part[l] += part[l + s];
      out[i * NB + j] = part[0];
    }
}

template <int MB, int NB, typename XT, typename WT>
inline void tile(const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* out) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<XT, c10::BFloat16> && std::is_same_v<WT, c10::BFloat16>) {
    tile_bf16dp<MB, NB>(x, ldx, w, ldw, K, out);
    return;
  }
#endif
  tile_fma<MB, NB>(x, ldx, w, ldw, K, out);
#else
  tile_scalar<MB, NB>(x, ldx, w, ldw, K, out);
#endif
}

template <int NB, typename XT, typename WT>
inline void tile_rows(int mb, const XT* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* out) {
  switch (mb) {
    case 4: tile<4, NB>(x, ldx, w, ldw, K, out); break;
    case 3: tile<3, NB>(x, ldx, w, ldw, K, out); break;
    case 2: tile<2, NB>(x, ldx, w, ldw, K, out); break;
    default: tile<1, NB>(x, ldx, w, ldw, K, out); break;
  }
}

template <typename XT, typename WT, typename OT>
void linear_impl(const XT* x, const WT* w, OT* y, int64_t M, int64_t N, int64_t K) {
  // Parallel over blocks of output columns; each thread streams its slice of W once per
  // group of rows, so decode (small M) reads the weights exactly once.
  constexpr int64_t kColsPerTask = 64;
  const int64_t n_tasks = (N + kColsPerTask - 1) / kColsPerTask;
  at::parallel_for(0, n_tasks, 1, [&](int64_t t0, int64_t t1) {
    float tmp[kMB * kNB];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n_lo = t * kColsPerTask, n_hi = std::min(N, n_lo + kColsPerTask);
      for (int64_t n0 = n_lo; n0 < n_hi; n0 += kNB) {
        const int nb = static_cast<int>(std::min<int64_t>(kNB, n_hi - n0));
        for (int64_t m0 = 0; m0 < M; m0 += kMB) {
          const int mb = static_cast<int>(std::min<int64_t>(kMB, M - m0));
          const XT* xp = x + m0 * K;
          const WT* wp = w + n0 * K;
          if (nb == 4) {
            tile_rows<4>(mb, xp, K, wp, K, K, tmp);
          } else {
            for (int j = 0; j < nb; ++j) tile_rows<1>(mb, xp, K, wp + j * K, K, K, tmp + j * kMB);
            // re-layout [j][i] -> [i][4]
            float t2[kMB * kNB];
            for (int j = 0; j < nb; ++j)
              for (int i = 0; i < mb; ++i) t2[i * kNB + j] = tmp[j * kMB + i];
            std::memcpy(tmp, t2, sizeof(t2));
          }
          for (int i = 0; i < mb; ++i)
            for (int j = 0; j < nb; ++j) y[(m0 + i) * N + n0 + j] = from_f<OT>(tmp[i * kNB + j]);
        }
      }
    }
  });
}

}  // namespace

at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& w_in, c10::optional<at::ScalarType> out_dtype) {
  check_float_dtype(x_in, "x");
  check_float_dtype(w_in, "w");
  TORCH_CHECK(w_in.dim() == 2, "w must be [N, K]");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(w_in.size(1) == K, "x and w disagree on K: ", K, " vs ", w_in.size(1));
  auto x = x_in.reshape({-1, K}).contiguous();
  auto w = w_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto odt = out_dtype.value_or(x.scalar_type());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options().dtype(odt));
  if (M == 0) return y.reshape(sizes);
  QK_DISPATCH_FLOAT(x.scalar_type(), "float_linear", [&] {
    using XT = scalar_t;
    QK_DISPATCH_FLOAT(w.scalar_type(), "float_linear", [&] {
      using WT = scalar_t;
      QK_DISPATCH_FLOAT(odt, "float_linear", [&] {
        linear_impl<XT, WT, scalar_t>(x.data_ptr<XT>(), w.data_ptr<WT>(), y.data_ptr<scalar_t>(), M, N, K);
      });
    });
  });
  return y.reshape(sizes);
}

}  // namespace qk
