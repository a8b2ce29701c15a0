// W4A16: int4 weight-only linear, y = x W^T with W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k / group.
//
// Arithmetic of every output element, whatever the ISA path, tile shape or batch: the weight is dequantized as
// (float(q) - zero) * scale (zero an exact integer, |zero| <= 2^20, which w4a16_prepare checks: the subtraction
// is exact, the product rounds once in fp32,
// bit-equal to the reference's dequantized weight), then acc = fma(x[k], w[k], acc) for k = 0, 1, ..., K-1 in
// order, from acc = 0, in fp32; the result is rounded to the activation dtype once. Rows are therefore
// bit-identical alone or batched, and the AVX-512, AVX2 and scalar paths give the same bits (an fma rounds once
// on every path).
//
// Packed weight (w4a16_pack), one layout for every ISA path (a weight packed by one build runs in another):
// int32 [NP, K8, 64]: NP = ceil(N / 64) panels of 64 outputs, K8 = ceil(K / 8) octets of input columns; word
// (p, o, i) holds the codes of output 64p + i at columns 8o .. 8o + 7, column 8o + j at bits 4j (padding: 0).
// Scales and zeros: fp32 [NP, G, 64] (padding outputs: 0 and 0, never stored).
//
// Why this order: batch-1 decode is one pass over the weights, so the loop must retire 8 bytes of codes (16
// weights) in about a cycle to keep up with a core's DRAM bandwidth (A8W8 streams 33-42 GB/s here). A panel is one
// sequential stream, and for one octet its 64 outputs are 256 contiguous bytes: one 64-byte load is 16 output
// lanes x 8 columns, already in the lanes the accumulators need. Column j of the octet is brought down by one
// vpsrld (4j) and made a float by one vpternlogd, (v & 0xF) | 0x4B000000 = 2^23 + q (q in the low mantissa
// bits of 2^23), so (2^23 + q) - (2^23 + zero) = q - zero exactly and the weight is one vsubps and one vmulps
// away: ~4.9 vector instructions per 16 weights, 2 of them (vmulps, vfmadd) on the FMA pipes, where the
// previous [N/8, K] layout (one word per column and 8 outputs) spent a scalar load, two broadcasts and an
// insert per 16 weights on the shuffle pipes besides. Each broadcast x[k] is shared by every accumulator of the
// tile: 8 zmm (2 panels) for one row, enough chains to cover the FMA latency; 4 zmm x up to 4 rows otherwise.
// Batch 1 with one zero point for the whole weight (symmetric checkpoints) drops the multiply: tile_lut.
#include <torch/library.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "common.h"
#include "ops.h"
#include "parts.h"

namespace qk {
namespace {

constexpr int64_t kPanel = 64;   // outputs per panel
constexpr int64_t kOct = 8;      // input columns per packed word
constexpr int64_t kPrefetch = 16;  // octets ahead that the AVX-512 tiles prefetch (prefetch_octet)

struct W4Args {
  const float* x;       // fp32 activations [M, K], columns already in the weight's order
  const int32_t* w;     // [NP, K8, 64]
  const float* scales;  // [NP, G, 64]
  const float* zeros;   // [NP, G, 64]
  int64_t K, K8, G, group;
};

// Scalar path (no AVX2, or shapes the vector tiles do not cover): the same per-element arithmetic.
template <typename T>
void panel_scalar(const W4Args& a, int64_t M, int64_t p, T* y, int64_t N) {
  const int32_t* wp = a.w + p * a.K8 * kPanel;
  for (int64_t i = 0; i < kPanel && p * kPanel + i < N; ++i) {
    const float* sp = a.scales + p * a.G * kPanel + i;
    const float* zp = a.zeros + p * a.G * kPanel + i;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = a.x + m * a.K;
      float acc = 0.f;
      for (int64_t k = 0; k < a.K; ++k) {
        const int64_t g = k / a.group;
        const float q = static_cast<float>((static_cast<uint32_t>(wp[(k / kOct) * kPanel + i]) >> (4 * (k % kOct))) & 0xFu);
        acc = std::fma(xr[k], (q - zp[g * kPanel]) * sp[g * kPanel], acc);
      }
      y[m * N + p * kPanel + i] = from_f<T>(acc);
    }
  }
}

#if defined(__AVX512F__)
// The panels' 256-byte octet `o` (a tile's streams) into L1 ahead of use. The hardware prefetcher alone left the
// batch-1 loop waiting on DRAM: one 4096 x 4096 weight streamed at ~21 GB/s without, ~39 GB/s with 16 octets
// (4 KiB per stream) ahead, one thread here. A prefetch past the end of the weight is harmless (no fault).
template <int P>
inline void prefetch_octet(const int32_t* wp, int64_t pstride, int64_t o) {
  for (int q = 0; q < P; ++q)
    for (int l = 0; l < 4; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(wp + q * pstride + o * kPanel + l * 16), _MM_HINT_T0);
}

// R rows x P panels (4 zmm of 16 outputs each).
template <int R, int P, typename T>
void tile_avx512(const W4Args& a, int64_t m0, int64_t p0, T* y, int64_t N) {
  constexpr int V = 4 * P;
  const __m512i nib = _mm512_set1_epi32(0xF), magic = _mm512_set1_epi32(0x4B000000);
  const __m512 magicf = _mm512_set1_ps(8388608.f);   // 2^23
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int32_t* wp = a.w + p0 * a.K8 * kPanel;
  const int64_t pstride = a.K8 * kPanel, sstride = a.G * kPanel, ogroup = a.group / kOct;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 zm[V], sc[V];
    for (int v = 0; v < V; ++v) {
      const int64_t off = (v / 4) * sstride + g * kPanel + (v % 4) * 16;
      zm[v] = _mm512_add_ps(_mm512_loadu_ps(a.zeros + p0 * sstride + off), magicf);   // 2^23 + zero, exact
      sc[v] = _mm512_loadu_ps(a.scales + p0 * sstride + off);
    }
    for (int64_t o = g * ogroup; o < (g + 1) * ogroup; ++o) {
      const float* xo = a.x + m0 * a.K + o * kOct;
      prefetch_octet<P>(wp, pstride, o + kPrefetch);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512 xb[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) xb[r] = _mm512_set1_ps(xo[r * a.K + j]);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
          __m512i q = _mm512_loadu_si512(wp + (v / 4) * pstride + o * kPanel + (v % 4) * 16);
          if (j) q = _mm512_srli_epi32(q, 4 * j);
          const __m512 f = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(q, nib, magic, 0xEA));   // (q & nib) | magic
          const __m512 w = _mm512_mul_ps(_mm512_sub_ps(f, zm[v]), sc[v]);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][v] = _mm512_fmadd_ps(xb[r], w, acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t n = (p0 + v / 4) * kPanel + (v % 4) * 16;
      if (n < N) store16_upto(y + (m0 + r) * N + n, acc[r][v], N - n);
    }
}

// Batch 1 when every zero point of the weight is one integer z0 (symmetric checkpoints: 8) and the products are
// exact (w4a16_prepare checks the scales, w4a16_linear the row): the per-output multiply leaves the loop. The
// 16 values x[k] * (c - z0), c = 0..15, are one zmm shared by every output (a 16-entry table), vpermps looks up
// each lane's code (it reads only the low 4 bits of an index lane: the nibble shifted down, no mask) and
// acc = fma(x[k] * (q - z0), scale, acc). That is the contract's fma(x[k], (q - z0) * scale, acc) bit for bit:
// when the scale and x[k] each have at most 20 significant bits (bf16 / fp16 values do: low 4 mantissa bits
// zero) and are normal or zero, both (q - z0) * scale and x[k] * (q - z0) (|q - z0| <= 16) are exact, so both
// fmas round acc + x[k] (q - z0) scale once, the same real number. ~3 instructions per 16 weights, one on the
// FMA pipes (vpsrlvd: the immediate-count vpsrld zmm issues on fewer pipes on this core and bound the loop).
template <int P, typename T>
void tile_lut(const W4Args& a, int64_t p0, float z0, T* y, int64_t N) {
  constexpr int V = 4 * P;
  const __m512 dvec = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_ps(z0));   // c - z0, exact
  __m512 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  const int32_t* wp = a.w + p0 * a.K8 * kPanel;
  const int64_t pstride = a.K8 * kPanel, sstride = a.G * kPanel, ogroup = a.group / kOct;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 sc[V];
    for (int v = 0; v < V; ++v) sc[v] = _mm512_loadu_ps(a.scales + (p0 + v / 4) * sstride + g * kPanel + (v % 4) * 16);
    for (int64_t o = g * ogroup; o < (g + 1) * ogroup; ++o) {
      const float* xo = a.x + o * kOct;
      prefetch_octet<P>(wp, pstride, o + kPrefetch);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512 t = _mm512_mul_ps(_mm512_set1_ps(xo[j]), dvec);   // x[k] * (c - z0), exact
        const __m512i sh = _mm512_set1_epi32(4 * j);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
          __m512i q = _mm512_loadu_si512(wp + (v / 4) * pstride + o * kPanel + (v % 4) * 16);
          if (j) q = _mm512_srlv_epi32(q, sh);
          acc[v] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, t), sc[v], acc[v]);
        }
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t n = (p0 + v / 4) * kPanel + (v % 4) * 16;
    if (n < N) store16_upto(y + n, acc[v], N - n);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// R rows x NV ymm of 8 outputs, from ymm column c0 of panel p. As the AVX-512 tile: a code becomes a float by
// (q & 0xF) | 0x4B000000 = 2^23 + q, minus (2^23 + zero) (hoisted per group, exact) is q - zero exactly, times the
// scale (one rounding): the contract's (float(q) - zero) * scale without a conversion or a reload of the group's
// zeros and scales per column (on the 2-core AVX2 VM the loop with vcvtdq2ps and both reloads read 6.5 GB/s of codes
// at 2 threads). The tile's lines of the panel are prefetched kPrefetch octets ahead (the hardware prefetcher alone
// left the AVX-512 loop waiting on DRAM).
template <int R, int NV, typename T>
void tile_avx2(const W4Args& a, int64_t m0, int64_t p, int c0, T* y, int64_t N) {
  const __m256i nib = _mm256_set1_epi32(0xF), magic = _mm256_set1_epi32(0x4B000000);
  const __m256 magicf = _mm256_set1_ps(8388608.f);   // 2^23
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const int32_t* wp = a.w + p * a.K8 * kPanel + c0 * 8;
  const float* zp = a.zeros + p * a.G * kPanel + c0 * 8;
  const float* sp = a.scales + p * a.G * kPanel + c0 * 8;
  const int64_t ogroup = a.group / kOct;
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 zm[NV], sc[NV];
    for (int v = 0; v < NV; ++v) {
      zm[v] = _mm256_add_ps(_mm256_loadu_ps(zp + g * kPanel + v * 8), magicf);   // 2^23 + zero, exact
      sc[v] = _mm256_loadu_ps(sp + g * kPanel + v * 8);
    }
    for (int64_t o = g * ogroup; o < (g + 1) * ogroup; ++o) {
      const float* xo = a.x + m0 * a.K + o * kOct;
      for (int l = 0; l < NV * 32; l += 64)   // this tile's NV x 32 bytes of the octet, kPrefetch octets ahead
        _mm_prefetch(reinterpret_cast<const char*>(wp + (o + kPrefetch) * kPanel) + l, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256 xb[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(xo + r * a.K + j);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + o * kPanel + v * 8));
          if (j) q = _mm256_srli_epi32(q, 4 * j);
          const __m256 f = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(q, nib), magic));
          const __m256 w = _mm256_mul_ps(_mm256_sub_ps(f, zm[v]), sc[v]);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xb[r], w, acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      const int64_t n = p * kPanel + (c0 + v) * 8;
      if (n < N) store8_upto(y + (m0 + r) * N + n, acc[r][v], N - n);
    }
}

// Batch 1 when every zero point is one integer z0 in [0, 16] and every scale has at most 20 significant bits, normal
// in [2^-100, 2^100] (w4a16_prepare's lut_zero, the AVX-512 lookup's condition): column j of an octet is taken in
// place, q 2^4j = w & (0xF << 4j) (no shift; j = 7 shifted down), made a float by vcvtdq2ps (exact: at most 4
// significant bits), and the weight is one fma, q 2^4j * (s 2^-4j) - z0 s: s 2^-4j and z0 s are exact (a power of
// two; <= 4 x 20 bits), so it rounds (q - z0) s once, the contract's (float(q) - zero) * scale bit for bit, and
// acc = fma(x[k], w, acc) follows as in tile_avx2. 4 vector instructions per 8 weights (and, convert, two fmas; the
// mask and s 2^-4j memory operands) where tile_avx2 spends 6 (shift, and, or, subtract, multiply, fma).
template <int NV, typename T>
void tile_avx2_exact(const W4Args& a, int64_t p, int c0, float z0, T* y, int64_t N) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  const int32_t* wp = a.w + p * a.K8 * kPanel + c0 * 8;
  const float* sp = a.scales + p * a.G * kPanel + c0 * 8;
  const int64_t ogroup = a.group / kOct;
  const __m256 vz = _mm256_set1_ps(z0), sign = _mm256_set1_ps(-0.f);
  alignas(32) int32_t masks[7][8];
  for (int j = 0; j < 7; ++j)
    for (int l = 0; l < 8; ++l) masks[j][l] = 0xF << (4 * j);
  alignas(32) float sj[8][NV][8];   // s 2^-4j (j = 7: s, the column shifted down)
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 nzs[NV];
    for (int v = 0; v < NV; ++v) {
      const __m256 sc = _mm256_loadu_ps(sp + g * kPanel + v * 8);
      nzs[v] = _mm256_xor_ps(_mm256_mul_ps(vz, sc), sign);   // -(z0 s), exact
      for (int j = 0; j < 7; ++j) _mm256_store_ps(sj[j][v], _mm256_mul_ps(sc, _mm256_set1_ps(1.f / static_cast<float>(1 << (4 * j)))));
      _mm256_store_ps(sj[7][v], sc);
    }
    for (int64_t o = g * ogroup; o < (g + 1) * ogroup; ++o) {
      const float* xo = a.x + o * kOct;
      for (int l = 0; l < NV * 32; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wp + (o + kPrefetch) * kPanel) + l, _MM_HINT_T0);
      __m256i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + o * kPanel + v * 8));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 xb = _mm256_broadcast_ss(xo + j);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          const __m256i q = j < 7 ? _mm256_and_si256(w[v], _mm256_load_si256(reinterpret_cast<const __m256i*>(masks[j < 7 ? j : 0])))
                                  : _mm256_srli_epi32(w[v], 28);
          const __m256 wt = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_load_ps(sj[j][v]), nzs[v]);
          acc[v] = _mm256_fmadd_ps(xb, wt, acc[v]);
        }
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = p * kPanel + (c0 + v) * 8;
    if (n < N) store8_upto(y + n, acc[v], N - n);
  }
}
#endif

// All M rows for panels [p0, p1). The tile shapes only choose which elements are computed together.
template <typename T>
void w4a16_panels(const W4Args& a, int64_t M, int64_t p0, int64_t p1, T* y, int64_t N, float lut_zero) {
  const bool vec_shape = a.K % kOct == 0 && a.group % kOct == 0;   // an octet never straddles a group
  if (!vec_shape) {
    for (int64_t p = p0; p < p1; ++p) panel_scalar(a, M, p, y, N);
    return;
  }
#if defined(__AVX512F__)
  if (M == 1 && lut_zero >= 0.f) {
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2) tile_lut<2>(a, p, lut_zero, y, N);
    if (p < p1) tile_lut<1>(a, p, lut_zero, y, N);
    return;
  }
  if (M == 1) {
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2) tile_avx512<1, 2>(a, 0, p, y, N);
    if (p < p1) tile_avx512<1, 1>(a, 0, p, y, N);
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_avx512<4, 1>(a, m, p, y, N);
    switch (M - m) {
      case 3: tile_avx512<3, 1>(a, m, p, y, N); break;
      case 2: tile_avx512<2, 1>(a, m, p, y, N); break;
      case 1: tile_avx512<1, 1>(a, m, p, y, N); break;
      default: break;
    }
  }
  return;
#elif defined(__AVX2__) && defined(__FMA__)
  // 16 ymm: one row takes half a panel a pass (4 accumulators, 4 zeros, 4 scales), up to three rows a quarter (the
  // dequantized weight shared by their fmas); a panel's 64 KB or so stay in L2 between its passes
  for (int64_t p = p0; p < p1; ++p) {
    if (M == 1 && lut_zero >= 0.f) {
      tile_avx2_exact<4>(a, p, 0, lut_zero, y, N);
      tile_avx2_exact<4>(a, p, 4, lut_zero, y, N);
      continue;
    }
    if (M == 1) {
      tile_avx2<1, 4>(a, 0, p, 0, y, N);
      tile_avx2<1, 4>(a, 0, p, 4, y, N);
      continue;
    }
    for (int c0 = 0; c0 < 8; c0 += 2) {
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) tile_avx2<3, 2>(a, m, p, c0, y, N);
      if (M - m == 2) tile_avx2<2, 2>(a, m, p, c0, y, N);
      else if (M - m == 1) tile_avx2<1, 2>(a, m, p, c0, y, N);
    }
  }
  return;
#endif
  for (int64_t p = p0; p < p1; ++p) panel_scalar(a, M, p, y, N);
}

}  // namespace

namespace parts {

bool w4a16_lut_row(const float* x, int64_t K) {
  uint32_t bad = 0;
  for (int64_t k = 0; k < K; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, 4);
    const uint32_t e = (u >> 23) & 0xFFu;
    bad |= (u & 0xFu) | static_cast<uint32_t>((u & 0x7FFFFFFFu) != 0 && (e < 27 || e > 227));
  }
  return bad == 0;
}

template <typename T>
void w4a16_panel_range(const float* x, int64_t M, int64_t K, const int32_t* w, const float* scales,
                       const float* zeros, int64_t G, int64_t p0, int64_t p1, T* y, int64_t N, float lut_zero) {
  const W4Args a{x, w, scales, zeros, K, (K + kOct - 1) / kOct, G, K / G};
  w4a16_panels(a, M, p0, p1, y, N, lut_zero);
}
template void w4a16_panel_range<float>(const float*, int64_t, int64_t, const int32_t*, const float*, const float*,
                                       int64_t, int64_t, int64_t, float*, int64_t, float);
template void w4a16_panel_range<c10::BFloat16>(const float*, int64_t, int64_t, const int32_t*, const float*,
                                               const float*, int64_t, int64_t, int64_t, c10::BFloat16*, int64_t, float);

}  // namespace parts

// codes uint8 [N, K] (0..15) -> int32 [ceil(N/64), ceil(K/8), 64]: output 64p + i, column 8o + j at bits 4j of
// word (p, o, i); padding codes are 0.
at::Tensor w4a16_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "w4a16_pack: codes must be uint8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t NP = (N + kPanel - 1) / kPanel, K8 = (K + kOct - 1) / kOct;
  const at::Tensor c = codes.contiguous();
  at::Tensor out = stream_zeros({NP, K8, kPanel}, at::kInt);   // huge pages (memory.cpp)
  const uint8_t* src = c.data_ptr<uint8_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < kPanel && p * kPanel + i < N; ++i) {
        const uint8_t* row = src + (p * kPanel + i) * K;
        for (int64_t o = 0; o < K8; ++o) {
          uint32_t word = 0;
          for (int64_t j = 0; j < kOct && o * kOct + j < K; ++j)
            word |= static_cast<uint32_t>(row[o * kOct + j] & 0xF) << (4 * j);
          dst[(p * K8 + o) * kPanel + i] = static_cast<int32_t>(word);
        }
      }
  });
  return out;
}

at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, const at::Tensor& perm, int64_t N, double lut_zero) {
  check_float_dtype(x, "w4a16_linear: x");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.size(2) == kPanel,
              "w4a16_linear: packed must be contiguous int32 [N/64, K/8, 64] from w4a16_pack");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zeros.sizes() == scales.sizes() && zeros.scalar_type() == at::kFloat && zeros.is_contiguous(),
              "w4a16_linear: scales and zeros must be contiguous fp32 [N/64, G, 64]");
  const int64_t NP = packed.size(0), K8 = packed.size(1), K = x.size(-1), G = scales.size(1);
  TORCH_CHECK(NP == (N + kPanel - 1) / kPanel && scales.size(0) == NP && scales.size(2) == kPanel,
              "w4a16_linear: packed / scale shapes do not match ", N, " outputs");
  TORCH_CHECK(K8 == (K + kOct - 1) / kOct, "w4a16_linear: x has ", K, " features, the weight ", K8 * kOct);
  TORCH_CHECK(G > 0 && K % G == 0, "w4a16_linear: ", G, " groups do not divide ", K, " features");
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
  // lut_zero >= 0: w4a16_prepare found one zero point z0 and exact-product scales (tile_lut); the row must be
  // exact too: every x[k] zero, or normal in [2^-100, 2^100] with its low 4 mantissa bits zero.
  bool lut = lut_zero >= 0 && M == 1;
  QK_DISPATCH_FLOAT(x.scalar_type(), "w4a16_linear", [&] {
    const scalar_t* xp = x2.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        if (pp)
          for (int64_t k = 0; k < K; ++k) xfp[m * K + k] = to_f<scalar_t>(xp[m * K + pp[k]]);
        else
          for (int64_t k = 0; k < K; ++k) xfp[m * K + k] = to_f<scalar_t>(xp[m * K + k]);
      }
    });
    if (lut) lut = parts::w4a16_lut_row(xfp, K);
    const W4Args a{xfp, packed.data_ptr<int32_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, K8, G, K / G};
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Batch 1 takes panels in pairs (one tile of 8 accumulators); a chunk is a work item of parallel_chunks.
    const float z0 = lut ? static_cast<float>(lut_zero) : -1.f;
    parallel_chunks(NP, 2, [&](int64_t p0, int64_t p1) { w4a16_panels(a, M, p0, p1, yp, N, z0); });
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
  m.def("w4a16_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor perm, int n, float lut_zero) "
        "-> Tensor",
        &qk::w4a16_linear);
}
