// A8W8 linear for the CPU: dynamic per-token int8 activations x int8 per-channel weights.
//
//   s_t = max|x_t| / 127, q_t = round_half_even(x_t / s_t), acc = q W^T (exact int32), y = acc * s_t * w_scale
//
// Weights are packed at load into tiles of 4 output rows: [N/4][K/64][4][64] bytes, so a tile is one
// sequential stream (four interleaved row streams halve the bandwidth the prefetchers reach here).
// An AVX512-VNNI micro-kernel (vpdpbusd: unsigned x signed bytes) computes up to 4 x-rows against a
// tile; activations are offset by +128 and 128 * sum(w_n) is subtracted again. Integer accumulation is
// exact, so every row is bit-identical whatever the batch: batch invariant, and equal to the reference.
#include "common.h"

namespace qk {
namespace {

constexpr int64_t kTileRows = 4;
constexpr int64_t kChunk = 64;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <typename T>
inline float quantize_row(const T* x, int64_t K, int64_t Kp, uint8_t* q_unsigned) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_f(x[k])));
  const float scale = amax > 0.f ? amax / 127.0f : 1.0f;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(to_f(x[k]) / scale);   // round half to even, as torch.round
    v = std::min(127.f, std::max(-128.f, v));
    q_unsigned[k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
  }
  for (int64_t k = K; k < Kp; ++k) q_unsigned[k] = 0;   // padding meets zero weights
  return scale;
}

#if defined(__AVX512VNNI__)
template <int MB>
inline void tile_kernel(const uint8_t* xu, int64_t ldx, const int8_t* wt, int64_t KC, int32_t* out) {
  __m512i acc[MB][4];
  #pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t c = 0; c < KC; ++c) {
    const int8_t* p = wt + c * 256;
    const __m512i w0 = _mm512_load_si512(p), w1 = _mm512_load_si512(p + 64);
    const __m512i w2 = _mm512_load_si512(p + 128), w3 = _mm512_load_si512(p + 192);
    #pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(xu + i * ldx + c * 64);
      acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xv, w1);
      acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], xv, w2);
      acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], xv, w3);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = _mm512_reduce_add_epi32(acc[i][j]);
}
#else
template <int MB>
inline void tile_kernel(const uint8_t* xu, int64_t ldx, const int8_t* wt, int64_t KC, int32_t* out) {
  #pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
      int32_t s = 0;
      for (int64_t c = 0; c < KC; ++c)
        for (int l = 0; l < 64; ++l) s += static_cast<int32_t>(xu[i * ldx + c * 64 + l]) * wt[c * 256 + j * 64 + l];
      out[i * 4 + j] = s;
    }
}
#endif

inline void tile_rows(int mb, const uint8_t* xu, int64_t ldx, const int8_t* wt, int64_t KC, int32_t* out) {
  switch (mb) {
    case 4: tile_kernel<4>(xu, ldx, wt, KC, out); break;
    case 3: tile_kernel<3>(xu, ldx, wt, KC, out); break;
    case 2: tile_kernel<2>(xu, ldx, wt, KC, out); break;
    default: tile_kernel<1>(xu, ldx, wt, KC, out); break;
  }
}

}  // namespace

// w_q int8 [N, K] -> packed int8 [ceil(N/4), ceil(K/64), 4, 64] (zero padded).
at::Tensor a8w8_pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kChar && w_in.dim() == 2, "w_q must be int8 [N, K]");
  auto w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NT = (N + kTileRows - 1) / kTileRows, KC = (K + kChunk - 1) / kChunk;
  auto packed = at::zeros({NT, KC, kTileRows, kChunk}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, NT, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < N; ++r)
        for (int64_t c = 0; c < KC; ++c) {
          const int64_t k0 = c * kChunk, n = std::min(kChunk, K - k0);
          std::memcpy(dst + ((t * KC + c) * kTileRows + r) * kChunk, src + (t * kTileRows + r) * K + k0, n);
        }
  });
  return packed;
}

at::Tensor a8w8_colsum(const at::Tensor& w_q) {
  TORCH_CHECK(w_q.scalar_type() == at::kChar && w_q.dim() == 2, "w_q must be int8 [N, K]");
  return w_q.sum(1, /*keepdim=*/false, at::kInt).contiguous();
}

// x [..., K] float -> y [..., N] (x's dtype). packed from a8w8_pack; w_scale fp32 [N]; colsum int32 [N].
at::Tensor a8w8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& colsum) {
  check_float_dtype(x_in, "x");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous(),
              "packed weight expected from a8w8_pack");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && colsum.scalar_type() == at::kInt, "w_scale fp32, colsum int32");
  const int64_t K = x_in.size(-1), N = w_scale.size(0);
  const int64_t NT = packed.size(0), KC = packed.size(1), Kp = KC * kChunk;
  TORCH_CHECK(Kp >= K && Kp - K < kChunk && NT == (N + kTileRows - 1) / kTileRows, "x / packed weight mismatch");
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(sizes);
  auto xu = at::empty({M, Kp}, x.options().dtype(at::kByte));
  auto scales = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* xup = xu.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const float* wsp = w_scale.data_ptr<float>();
  const int32_t* csp = colsum.data_ptr<int32_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  QK_DISPATCH_FLOAT(x.scalar_type(), "a8w8_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) sp[m] = quantize_row(xp + m * K, K, Kp, xup + m * Kp);
    });
    at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      int32_t acc[16];
      for (int64_t t = t0; t < t1; ++t) {
        const int8_t* wt = wp + t * KC * kTileRows * kChunk;
        const int64_t n0 = t * kTileRows;
        const int nb = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int mb = static_cast<int>(std::min<int64_t>(4, M - m0));
          tile_rows(mb, xup + m0 * Kp, Kp, wt, KC, acc);
          for (int i = 0; i < mb; ++i) {
            const float s = sp[m0 + i];
            scalar_t* yrow = yp + (m0 + i) * N + n0;
            for (int j = 0; j < nb; ++j)   // (acc * s_t) * w_scale[n], the reference's order
              yrow[j] = from_f<scalar_t>((static_cast<float>(acc[i * 4 + j] - 128 * csp[n0 + j]) * s) * wsp[n0 + j]);
          }
        }
      }
    });
  });
  return y.reshape(sizes);
}

}  // namespace qk
