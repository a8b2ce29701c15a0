// W4A16: int4 weight-only linear, y = x W^T with W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k / group.
//
// Packed weight: int32 [N/8, K]; word (b, k) holds the 4-bit codes of outputs 8b..8b+7 at input column k, output
// 8b+i at bits 4i, so one broadcast word becomes 8 output lanes with one variable shift and a mask (the nibbles
// are unpacked in registers, never in memory). Scales and zeros: fp32 [N/8, G, 8] (zeros are exact integers).
//
// Arithmetic of every output element, whatever the ISA path, tile shape or batch: the weight is dequantized as
// (float(q) - zero) * scale (two fp32 roundings, bit-equal to the reference's dequantized weight), then
// acc = fma(x[k], w[k], acc) for k = 0, 1, ..., K-1 in order, from acc = 0, in fp32; the result is rounded to the
// activation dtype once. Rows are therefore bit-identical alone or batched, and the AVX-512, AVX2 and scalar
// paths give the same bits (an fma rounds once on every path).
#include <torch/library.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "common.h"

namespace qk {
namespace {

constexpr int64_t kChunkBlocks = 8;   // output blocks of 8 per work item handed to a thread (64 outputs)

struct W4Args {
  const float* x;       // fp32 activations [M, K], columns already in the weight's order
  const int32_t* w;     // [N/8, K]
  const float* scales;  // [N/8, G, 8]
  const float* zeros;   // [N/8, G, 8]
  int64_t K, G, group;
};

// Scalar path (no AVX2): the same per-element arithmetic.
template <typename T>
void tile_scalar(const W4Args& a, int64_t m0, int64_t rows, int64_t b, T* y, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = a.x + (m0 + r) * a.K;
    for (int lane = 0; lane < 8; ++lane) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        const float s = a.scales[(b * a.G + g) * 8 + lane], z = a.zeros[(b * a.G + g) * 8 + lane];
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
          const float q = static_cast<float>((static_cast<uint32_t>(a.w[b * a.K + k]) >> (4 * lane)) & 0xFu);
          acc = std::fma(xr[k], (q - z) * s, acc);
        }
      }
      y[(m0 + r) * N + b * 8 + lane] = from_f<T>(acc);
    }
  }
}

#if defined(__AVX512F__)
// Two runs of 8 floats as one 16-lane vector (AVX512F only: insertf32x8 would need AVX512DQ).
inline __m512 join8x2(const float* lo, const float* hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(lo))),
                                             _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}

// R rows x NB16 vectors of 16 outputs (two 8-output blocks per vector).
template <int R, int NB16, typename T>
void tile_avx512(const W4Args& a, int64_t m0, int64_t b0, T* y, int64_t N) {
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i mask = _mm512_set1_epi32(0xF);
  __m512 acc[R][NB16];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NB16; ++t) acc[r][t] = _mm512_setzero_ps();
  const int32_t* wrow[2 * NB16];
  for (int t = 0; t < 2 * NB16; ++t) wrow[t] = a.w + (b0 + t) * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 s[NB16], z[NB16];
    for (int t = 0; t < NB16; ++t) {
      const int64_t lo = ((b0 + 2 * t) * a.G + g) * 8, hi = ((b0 + 2 * t + 1) * a.G + g) * 8;
      s[t] = join8x2(a.scales + lo, a.scales + hi);
      z[t] = join8x2(a.zeros + lo, a.zeros + hi);
    }
    for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
      __m512 w[NB16];
      for (int t = 0; t < NB16; ++t) {
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(wrow[2 * t][k])),
                                       _mm256_set1_epi32(wrow[2 * t + 1][k]), 1);
        v = _mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask);
        w[t] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v), z[t]), s[t]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(a.x[(m0 + r) * a.K + k]);
        for (int t = 0; t < NB16; ++t) acc[r][t] = _mm512_fmadd_ps(xv, w[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NB16; ++t) store16x(y + (m0 + r) * N + (b0 + 2 * t) * 8, acc[r][t]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// R rows x NB blocks of 8 outputs.
template <int R, int NB, typename T>
void tile_avx2(const W4Args& a, int64_t m0, int64_t b0, T* y, int64_t N) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NB; ++t) acc[r][t] = _mm256_setzero_ps();
  const int32_t* wrow[NB];
  for (int t = 0; t < NB; ++t) wrow[t] = a.w + (b0 + t) * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 s[NB], z[NB];
    for (int t = 0; t < NB; ++t) {
      s[t] = _mm256_loadu_ps(a.scales + ((b0 + t) * a.G + g) * 8);
      z[t] = _mm256_loadu_ps(a.zeros + ((b0 + t) * a.G + g) * 8);
    }
    for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
      __m256 w[NB];
      for (int t = 0; t < NB; ++t) {
        const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wrow[t][k]), shifts), mask);
        w[t] = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(v), z[t]), s[t]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(a.x + (m0 + r) * a.K + k);
        for (int t = 0; t < NB; ++t) acc[r][t] = _mm256_fmadd_ps(xv, w[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NB; ++t) store8x(y + (m0 + r) * N + (b0 + t) * 8, acc[r][t]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kDequantRows = 4;   // from this many rows a chunk's weights are dequantized once into a buffer
constexpr int64_t kKBlock = 128;      // input columns dequantized at a time (the buffer: 128 x 64 fp32, 32 KiB)

// Many rows: the chunk's 64 outputs are dequantized once per block of input columns into `wbuf` (the same two
// roundings as in registers) and every row's accumulators are carried in `acc` across the blocks (an fp32 store
// and load change no bit), so each output is still the one fma chain over k in order.
template <typename T>
void chunk_many_rows(const W4Args& a, int64_t M, int64_t b0, T* y, int64_t N) {
  constexpr int64_t W = kChunkBlocks * 8;
  thread_local std::vector<float> wbuf, acc;
  wbuf.resize(kKBlock * W);
  acc.assign(M * W, 0.f);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  for (int64_t k0 = 0; k0 < a.K; k0 += kKBlock) {
    const int64_t kn = std::min(kKBlock, a.K - k0);
    for (int64_t t = 0; t < kChunkBlocks; ++t) {
      const int32_t* wrow = a.w + (b0 + t) * a.K;
      for (int64_t k = k0; k < k0 + kn;) {          // runs of columns within one group
        const int64_t g = k / a.group, end = std::min(k0 + kn, (g + 1) * a.group);
        const __m256 z = _mm256_loadu_ps(a.zeros + ((b0 + t) * a.G + g) * 8);
        const __m256 sc = _mm256_loadu_ps(a.scales + ((b0 + t) * a.G + g) * 8);
        for (; k < end; ++k) {
          const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wrow[k]), shifts), mask);
          _mm256_storeu_ps(wbuf.data() + (k - k0) * W + t * 8, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(v), z), sc));
        }
      }
    }
    int64_t m = 0;
#if defined(__AVX512F__)
    auto rows = [&](auto r_const, int64_t m0) {
      constexpr int R = decltype(r_const)::value;
      __m512 c[R][4];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) c[r][v] = _mm512_loadu_ps(acc.data() + (m0 + r) * W + v * 16);
      for (int64_t k = 0; k < kn; ++k) {
        const float* wk = wbuf.data() + k * W;
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                     w3 = _mm512_loadu_ps(wk + 48);
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(a.x[(m0 + r) * a.K + k0 + k]);
          c[r][0] = _mm512_fmadd_ps(xv, w0, c[r][0]);
          c[r][1] = _mm512_fmadd_ps(xv, w1, c[r][1]);
          c[r][2] = _mm512_fmadd_ps(xv, w2, c[r][2]);
          c[r][3] = _mm512_fmadd_ps(xv, w3, c[r][3]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc.data() + (m0 + r) * W + v * 16, c[r][v]);
    };
#else
    auto rows = [&](auto r_const, int64_t m0) {
      constexpr int R = decltype(r_const)::value;
      for (int64_t v0 = 0; v0 < W; v0 += 16) {
        __m256 c[R][2];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < 2; ++v) c[r][v] = _mm256_loadu_ps(acc.data() + (m0 + r) * W + v0 + v * 8);
        for (int64_t k = 0; k < kn; ++k) {
          const float* wk = wbuf.data() + k * W + v0;
          const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
          for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_broadcast_ss(a.x + (m0 + r) * a.K + k0 + k);
            c[r][0] = _mm256_fmadd_ps(xv, w0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(xv, w1, c[r][1]);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < 2; ++v) _mm256_storeu_ps(acc.data() + (m0 + r) * W + v0 + v * 8, c[r][v]);
      }
    };
#endif
    for (; m + 4 <= M; m += 4) rows(std::integral_constant<int, 4>{}, m);
    for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, m);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < W; ++j) y[m * N + b0 * 8 + j] = from_f<T>(acc[m * W + j]);
}
#endif

// All M rows for output blocks [b0, b1). The tile shapes only choose which elements are computed together.
template <typename T>
void w4a16_blocks(const W4Args& a, int64_t M, int64_t b0, int64_t b1, T* y, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if (M >= kDequantRows && b1 - b0 == kChunkBlocks) return chunk_many_rows(a, M, b0, y, N);
#endif
#if defined(__AVX512F__)
  if (b1 - b0 == kChunkBlocks) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int64_t b = b0; b < b1; b += 2) tile_avx512<4, 1>(a, m, b, y, N);
    for (; m < M; ++m) tile_avx512<1, 4>(a, m, b0, y, N);
    return;
  }
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2)
    for (int64_t m = 0; m < M; ++m) tile_avx512<1, 1>(a, m, b, y, N);
  if (b < b1) tile_scalar(a, 0, M, b, y, N);
  return;
#elif defined(__AVX2__) && defined(__FMA__)
  if (b1 - b0 == kChunkBlocks) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3)
      for (int64_t b = b0; b < b1; b += 2) tile_avx2<3, 2>(a, m, b, y, N);
    for (; m < M; ++m) tile_avx2<1, 8>(a, m, b0, y, N);
    return;
  }
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t m = 0; m < M; ++m) tile_avx2<1, 1>(a, m, b, y, N);
  return;
#endif
  for (int64_t b = b0; b < b1; ++b) tile_scalar(a, 0, M, b, y, N);
}

}  // namespace

// codes uint8 [N, K] (0..15) -> int32 [N/8, K], output 8b+i of column k at bits 4i of word (b, k).
at::Tensor w4a16_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "w4a16_pack: codes must be uint8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N % 8 == 0, "w4a16_pack: N must be a multiple of 8, got ", N);
  const at::Tensor c = codes.contiguous();
  at::Tensor out = at::empty({N / 8, K}, c.options().dtype(at::kInt));
  const uint8_t* src = c.data_ptr<uint8_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  at::parallel_for(0, N / 8, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k = 0; k < K; ++k) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(src[(b * 8 + i) * K + k] & 0xF) << (4 * i);
        dst[b * K + k] = static_cast<int32_t>(word);
      }
  });
  return out;
}

at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, const at::Tensor& perm) {
  check_float_dtype(x, "w4a16_linear: x");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kInt && packed.is_contiguous(),
              "w4a16_linear: packed must be contiguous int32 [N/8, K]");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zeros.sizes() == scales.sizes() && zeros.scalar_type() == at::kFloat && zeros.is_contiguous(),
              "w4a16_linear: scales and zeros must be contiguous fp32 [N/8, G, 8]");
  const int64_t NB = packed.size(0), K = packed.size(1), N = NB * 8, G = scales.size(1);
  TORCH_CHECK(scales.size(0) == NB && scales.size(2) == 8 && G > 0 && K % G == 0, "w4a16_linear: bad scale shape");
  TORCH_CHECK(x.size(-1) == K, "w4a16_linear: x has ", x.size(-1), " features, the weight ", K);
  const bool permuted = perm.numel() > 0;
  TORCH_CHECK(!permuted || (perm.numel() == K && perm.scalar_type() == at::kLong && perm.is_contiguous()),
              "w4a16_linear: perm must be contiguous int64 [K] or empty");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  // The activations in fp32, gathered into the weight's column order (desc_act checkpoints).
  at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
  float* xfp = xf.data_ptr<float>();
  const int64_t* pp = permuted ? perm.data_ptr<int64_t>() : nullptr;
  QK_DISPATCH_FLOAT(x.scalar_type(), "w4a16_linear", [&] {
    const scalar_t* xp = x2.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = 0; k < K; ++k) xfp[m * K + k] = to_f<scalar_t>(xp[m * K + (pp ? pp[k] : k)]);
    });
    const W4Args a{xfp, packed.data_ptr<int32_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, G, K / G};
    scalar_t* yp = y.data_ptr<scalar_t>();
    parallel_chunks(NB, kChunkBlocks, [&](int64_t b0, int64_t b1) { w4a16_blocks(a, M, b0, b1, yp, N); });
  });
  return y.reshape(out_shape);
}

}  // namespace qk

// The operator namespace: qwen3_cpu in the kernel set; a test builds this file alone under other names with
// narrower instruction sets (-mno-avx512f, -mno-avx2) to compare the ISA paths bit for bit on one machine.
#ifndef QK_W4A16_LIB
#define QK_W4A16_LIB qwen3_cpu
#endif
#define QK_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
QK_FRAGMENT(QK_W4A16_LIB, m) {
  m.def("w4a16_pack(Tensor codes) -> Tensor", &qk::w4a16_pack);
  m.def("w4a16_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor perm) -> Tensor",
        &qk::w4a16_linear);
}
