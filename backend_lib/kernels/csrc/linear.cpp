// Batch-invariant float linear y = x W^T for the CPU, on weights packed at load.
//
// W is packed into tiles of 4 output rows, [N/4][K/CH][4][CH] with CH elements = 64 bytes, so each
// tile streams sequentially. Every output is one dot product over K accumulated in a fixed order (16
// fp32 lanes, then a fixed horizontal tree) whatever M is and whichever rows share the call, so a
// token's result never depends on its batch. Up to 4 x-rows reuse each loaded weight vector.
#include "common.h"

namespace qk {
namespace {

constexpr int64_t kTileRows = 4;
constexpr int64_t kChunkBytes = 64;

#if defined(__AVX512F__)
inline __m512 bf16x16_to_f32(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_x16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_x16(const c10::BFloat16* p, __mmask16 m) {
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

// fp32 W tiles: chunk c holds 16 floats of each of the 4 rows.
template <int MB, typename XT>
inline void tile_f32w(const XT* x, int64_t ldx, int64_t K, const float* wt, int64_t KC, float* out) {
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < KC; ++c) {
    const float* p = wt + c * 64;
    const __m512 w0 = _mm512_load_ps(p), w1 = _mm512_load_ps(p + 16), w2 = _mm512_load_ps(p + 32),
                 w3 = _mm512_load_ps(p + 48);
    const int64_t k = c * 16, rem = K - k;
    const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = load_x16(x + i * ldx + k, m);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// bf16 W tiles: chunk c holds 32 bf16 of each of the 4 rows; fp32 x uses FMA on both halves.
template <int MB>
inline void tile_bf16w_f32x(const float* x, int64_t ldx, int64_t K, const c10::BFloat16* wt, int64_t KC,
                            float* out) {
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < KC; ++c) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(wt) + c * 128;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512 w[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        w[j] = bf16x16_to_f32(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + j * 32 + h * 16)));
      const int64_t k = c * 32 + h * 16, rem = K - k;
      const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if defined(__AVX512BF16__)
// bf16 x and bf16 W on the AVX512-BF16 dot-product instruction (pairs accumulated in fp32).
template <int MB>
inline void tile_bf16dp(const c10::BFloat16* x, int64_t ldx, int64_t K, const c10::BFloat16* wt, int64_t KC,
                        float* out) {
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < KC; ++c) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(wt) + c * 128;
    const __m512i w0 = _mm512_load_si512(p), w1 = _mm512_load_si512(p + 32), w2 = _mm512_load_si512(p + 64),
                  w3 = _mm512_load_si512(p + 96);
    const int64_t k = c * 32, rem = K - k;
    const __mmask32 m = rem >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << rem) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * ldx + k);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, (__m512bh)w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, (__m512bh)w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, (__m512bh)w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xv, (__m512bh)w3);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif
#endif  // __AVX512F__

// Portable tile: 16 partial sums per output in lane order, reduced pairwise (a fixed order).
template <int MB, typename XT, typename WT>
inline void tile_scalar(const XT* x, int64_t ldx, int64_t K, const WT* wt, int64_t KC, float* out) {
  constexpr int64_t CH = kChunkBytes / sizeof(WT);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) {
      float part[16] = {0};
      for (int64_t c = 0; c < KC; ++c)
        for (int64_t l = 0; l < CH; ++l) {
          const int64_t k = c * CH + l;
          if (k < K) part[k & 15] += to_f(x[i * ldx + k]) * to_f(wt[(c * 4 + j) * CH + l]);
        }
      for (int s = 8; s > 0; s >>= 1)
        for (int l = 0; l < s; ++l) part[l] += part[l + s];
      out[i * 4 + j] = part[0];
    }
}

template <int MB, typename XT, typename WT>
inline void tile(const XT* x, int64_t ldx, int64_t K, const WT* wt, int64_t KC, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<WT, float>) {
    tile_f32w<MB>(x, ldx, K, wt, KC, out);
    return;
  } else if constexpr (std::is_same_v<XT, float>) {
    tile_bf16w_f32x<MB>(x, ldx, K, wt, KC, out);
    return;
  }
#if defined(__AVX512BF16__)
  else {
    tile_bf16dp<MB>(x, ldx, K, wt, KC, out);
    return;
  }
#endif
#endif
  tile_scalar<MB>(x, ldx, K, wt, KC, out);
}

template <typename XT, typename WT>
inline void tile_rows(int mb, const XT* x, int64_t ldx, int64_t K, const WT* wt, int64_t KC, float* out) {
  switch (mb) {
    case 4: tile<4>(x, ldx, K, wt, KC, out); break;
    case 3: tile<3>(x, ldx, K, wt, KC, out); break;
    case 2: tile<2>(x, ldx, K, wt, KC, out); break;
    default: tile<1>(x, ldx, K, wt, KC, out); break;
  }
}

template <typename XT, typename WT, typename OT>
void linear_impl(const XT* x, const WT* wp, OT* y, int64_t M, int64_t N, int64_t K, int64_t NT, int64_t KC) {
  constexpr int64_t CH = kChunkBytes / sizeof(WT);
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    float acc[16];
    for (int64_t t = t0; t < t1; ++t) {
      const WT* wt = wp + t * KC * kTileRows * CH;
      const int64_t n0 = t * kTileRows;
      const int nb = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mb = static_cast<int>(std::min<int64_t>(4, M - m0));
        tile_rows(mb, x + m0 * K, K, K, wt, KC, acc);
        for (int i = 0; i < mb; ++i)
          for (int j = 0; j < nb; ++j) y[(m0 + i) * N + n0 + j] = from_f<OT>(acc[i * 4 + j]);
      }
    }
  });
}

}  // namespace

// w [N, K] float -> packed [ceil(N/4), ceil(K/CH), 4, CH] (CH elements = 64 bytes), zero padded.
at::Tensor float_pack(const at::Tensor& w_in) {
  check_float_dtype(w_in, "w");
  TORCH_CHECK(w_in.dim() == 2, "w must be [N, K]");
  auto w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), es = w.element_size(), CH = kChunkBytes / es;
  const int64_t NT = (N + kTileRows - 1) / kTileRows, KC = (K + CH - 1) / CH;
  auto packed = at::zeros({NT, KC, kTileRows, CH}, w.options());
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, NT, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < N; ++r)
        for (int64_t c = 0; c < KC; ++c) {
          const int64_t k0 = c * CH, n = std::min(CH, K - k0);
          std::memcpy(dst + ((t * KC + c) * kTileRows + r) * kChunkBytes, src + ((t * kTileRows + r) * K + k0) * es,
                      n * es);
        }
  });
  return packed;
}

// Rows `ids` of the original [N, K] matrix, read from its packed form (a tied embedding).
at::Tensor float_packed_rows(const at::Tensor& packed, const at::Tensor& ids_in, int64_t K) {
  const int64_t NT = packed.size(0), KC = packed.size(1), CH = packed.size(3);
  auto ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel();
  auto out = at::empty({T, K}, packed.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t es = packed.element_size();
  const char* src = static_cast<const char*>(packed.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < T; ++i) {
    const int64_t n = ip[i], t = n / kTileRows, r = n % kTileRows;
    TORCH_CHECK(n >= 0 && t < NT, "row id ", n, " out of range");
    for (int64_t c = 0; c < KC; ++c) {
      const int64_t k0 = c * CH, len = std::min(CH, K - k0);
      std::memcpy(dst + (i * K + k0) * es, src + ((t * KC + c) * kTileRows + r) * kChunkBytes, len * es);
    }
  }
  return out;
}

at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                        c10::optional<at::ScalarType> out_dtype) {
  check_float_dtype(x_in, "x");
  check_float_dtype(packed, "packed");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous(), "packed weight expected from float_pack");
  const int64_t K = x_in.size(-1), NT = packed.size(0), KC = packed.size(1), CH = packed.size(3);
  TORCH_CHECK(KC * CH >= K && KC * CH - K < CH && NT == (N + kTileRows - 1) / kTileRows, "x / packed weight mismatch");
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto odt = out_dtype.value_or(x.scalar_type());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options().dtype(odt));
  if (M == 0) return y.reshape(sizes);
  QK_DISPATCH_FLOAT(x.scalar_type(), "float_linear", [&] {
    using XT = scalar_t;
    QK_DISPATCH_FLOAT(packed.scalar_type(), "float_linear", [&] {
      using WT = scalar_t;
      QK_DISPATCH_FLOAT(odt, "float_linear", [&] {
        linear_impl<XT, WT, scalar_t>(x.data_ptr<XT>(), packed.data_ptr<WT>(), y.data_ptr<scalar_t>(), M, N, K, NT,
                                      KC);
      });
    });
  });
  return y.reshape(sizes);
}

}  // namespace qk
