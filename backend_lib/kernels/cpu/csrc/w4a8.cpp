// W4A8: the int4 head on int8 activations (`lm_head_quant: int4a8`), y = x W^T with W[n, k] = (q[n, k] - 8) *
// scale[n, g] (the int4 head's symmetric codes, g = k / group) and x quantized per row as the A8W8 linears do.
//
// Arithmetic of every output element, whatever the ISA path, tile shape or batch (kernels/reference/w4a8.py is
// the same in torch ops):
//   s_x = max|x| / 127 (1 for a zero row), xq = clamp(round_half_even(x / s_x), -128, 127)      (int8, per row)
//   isum_g = sum_{k in g} xq[k] (q[n, k] - 8)                                                  (exact int32)
//   acc = 0; for g = 0 .. G-1 in order: acc = acc + float(isum_g) * scale[n, g]   (fp32: a product, then a sum)
//   y = acc * s_x, rounded to x's dtype once.
// float(isum_g) is exact (|isum_g| <= 128 * 8 * group < 2^24 for groups up to 16384 columns), so rows are
// bit-identical alone or batched and every path gives the same bits. This is llama.cpp's Q4_0 x Q8_0 dot
// product in kind (integer sums per block, one float scale per block), where the W4A16 head turns every code into
// an fp32 FMA: on two AVX2 Zen 3 cores that loop reads ~10 GB/s of codes, compute-bound, and the 151,936 x 2,048
// head is half of the W4A16 MoE's step (docs/performance.md).
//
// Weight: w4a16_pack's layout (int32 [NP, K8, 64]: word (p, o, i) holds output 64p + i's codes at columns 8o ..
// 8o + 7, column 8o + j at bits 4j) and scales fp32 [NP, G, 64]; the zero point is 8 (the Python side checks).
// AVX2 (also the AVX-512 builds, in ymm): a word's low nibbles w & 0x0F0F0F0F are its columns 0, 2, 4, 6 as unsigned
// bytes and (w >> 4) & 0x0F0F0F0F its columns 1, 3, 5, 7, so with the row's quantized bytes of those columns
// broadcast as two dwords, vpmaddubsw (codes <= 15 times |xq| <= 128: a pair <= 3,840, no saturation) + vpaddw
// (<= 7,680) + vpmaddwd by ones give the octet's 8 products per output in its int32 lane: 9 vector instructions
// per 64 weights, where the W4A16 tile spends ~48 on fp32 (with VNNI, AVX-512 or AVX-VNNI, two vpdpbusd do the
// three's work: 5 per 64). The group's exact sum of xq q minus 8 x its sum of xq
// is isum_g. The rows' dwords are laid out once per call (W8Args::xd) and broadcast from memory in the loop: built
// from the bytes in the loop (four rows a quarter panel at batch 16) the scalar work held the 30B-A3B head at 66 ms
// a batch-16 step, 45 ms after. Batch 1 takes a whole panel a pass (its 256 bytes an octet one stream): on the
// 2-core AVX2 VM the head reads 24.4 GB/s of codes in the W4A16 MoE's step (bench.step_profile --region), 17.9 ms
// -> 6.8 ms against the W4A16 head. Scalar path: the same integers and the same fp32 epilogue.
#include <torch/library.h>
#include <algorithm>
#include <vector>
#include "common.h"
#include "parts.h"

namespace qk {
namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kOct = 8;

// A prepared row (parts::w4a8_prepare_row), one contiguous block of w4a8_row_bytes(K, G) bytes: its dwords
// xd [K8, 2] (per octet the bytes of its columns 0, 2, 4, 6 and of 1, 3, 5, 7), its group sums xsum [G] (int32),
// its quantized values xq [K8 * 8] (int8, zero padded). M rows are M such blocks one after another; the row's
// scale is kept by the caller (sx).
struct W8Args {
  const int8_t* xq;      // row m's quantized values at xq + m * rs
  const int32_t* xd;     // row m's dwords at xd + m * rs / 4
  const int32_t* xsum;   // row m's group sums at xsum + m * rs / 4
  const float* sx;       // [M] row scales
  const int32_t* w;      // [NP, K8, 64]
  const float* scales;   // [NP, G, 64]
  int64_t K8, G, ogroup;  // ogroup: octets per group (the vector path), 0 where an octet straddles a group
  int64_t group;         // columns per group
  int64_t rs;            // bytes from one row's block to the next
  int64_t xds() const { return rs / 4; }   // the same, in dwords
};

inline int64_t row_bytes(int64_t K8, int64_t G) { return 16 * K8 + 4 * G; }
inline W8Args rows_args(const char* rows, const float* sx, const int32_t* w, const float* scales, int64_t K,
                        int64_t G) {
  const int64_t K8 = (K + kOct - 1) / kOct, group = K / G;
  return W8Args{reinterpret_cast<const int8_t*>(rows + 8 * K8 + 4 * G), reinterpret_cast<const int32_t*>(rows),
                reinterpret_cast<const int32_t*>(rows + 8 * K8), sx, w, scales, K8, G,
                (K % kOct == 0 && group % kOct == 0) ? group / kOct : 0, group, row_bytes(K8, G)};
}

template <typename T>
void panel_scalar(const W8Args& a, int64_t M, int64_t p, T* y, int64_t N) {
  const int32_t* wp = a.w + p * a.K8 * kPanel;
  for (int64_t i = 0; i < kPanel && p * kPanel + i < N; ++i) {
    const float* sp = a.scales + p * a.G * kPanel + i;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = a.xq + m * a.rs;
      float acc = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        int32_t isum = 0;
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
          const int32_t q = static_cast<int32_t>((static_cast<uint32_t>(wp[(k / kOct) * kPanel + i]) >> (4 * (k % kOct))) & 0xFu);
          isum += static_cast<int32_t>(xr[k]) * (q - 8);
        }
        const float t = static_cast<float>(isum) * sp[g * kPanel];
        acc = acc + t;
      }
      y[m * N + p * kPanel + i] = from_f<T>(acc * a.sx[m]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// VNNI (AVX-512 VNNI + VL, or AVX-VNNI): vpdpbusd adds the four u8 x s8 products of each dword to its int32 lane
// without saturation, so one instruction does vpmaddubsw + vpmaddwd's work on the same integers: 5 vector
// instructions per 64 weights instead of 9, the same isum_g and the same bits. The 151,936 x 2,048 head on a 2-core
// AVX-512 Zen 4 VM, 2 threads, alternated with the vpmaddubsw loop: 4.6-5.1 -> 4.2-4.6 ms at batch 1, 25.7 -> 21.0-21.6
// ms at batch 16.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QK_W4A8_VNNI 1
inline __m256i qk_dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
#define QK_W4A8_VNNI 1
inline __m256i qk_dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
#define QK_W4A8_VNNI 0
#endif

#if QK_W4A8_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QK_W4A8_ZMM 1
// acc += the four u8 x s8 products of each dword, the s8 dword broadcast from memory ({1to16}: no broadcast
// instruction, no register). In asm: GCC 12 compiled the _mm256_dpbusd_epi32 tile below with a register copy per
// accumulator update and four accumulators stored to the stack every octet; "+v" keeps each accumulator in its
// register, and the instruction is the intrinsic's.
inline __m512i dpbusd_bcst(__m512i acc, __m512i u8, const int32_t* s8) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*s8));
  return acc;
}

// Batch > 1 with AVX-512 VNNI: R rows x one zmm of 16 outputs (quarter c of panel p). A quarter's 64 bytes of an
// octet are unpacked once (and, shift, and) for all R rows (up to 16), and each row adds them in with two vpdpbusd
// whose activation dword is a broadcast memory operand: 2 instructions per row per 128 weights where the ymm tile
// spends 4 vpdpbusd and 4 broadcasts, unpacking every 4 rows. The same integers (isum_g) and the same fp32
// epilogue, so the same bits. The 151,936 x 2,048 head at 16 rows, 2 threads, the 2-core AVX-512 Zen 4 VM,
// alternated with the ymm tile (whose loop, as GCC 12 compiled it, also copied accumulators and stored four to the
// stack every octet): 20.7-25.0 -> 14.1-14.6 ms; the 4-layer 30B-A3B W4A16 step at batch 16 (bench.ab_builds
// --configs 2x16) 97.9 -> 88.5 ms.
template <int R, typename T>
void tile_zmm(const W8Args& a, int64_t m0, int64_t p, int c, T* y, int64_t N) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int32_t* wp = a.w + p * a.K8 * kPanel + c * 16;
  const float* sp = a.scales + p * a.G * kPanel + c * 16;
  const int32_t* xd = a.xd + m0 * a.xds();
  const int64_t xstride = a.xds();
  alignas(64) float facc[R][16] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t o = g * a.ogroup; o < (g + 1) * a.ogroup; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (o + 16) * kPanel), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(wp + o * kPanel);
      const __m512i ce = _mm512_and_si512(w, nib);                          // columns 0, 2, 4, 6
      const __m512i co = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);   // columns 1, 3, 5, 7
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = xd + r * xstride + o * 2;
        acc[r] = dpbusd_bcst(dpbusd_bcst(acc[r], ce, xr), co, xr + 1);
      }
    }
    const __m512 sc = _mm512_loadu_ps(sp + g * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(8 * a.xsum[(m0 + r) * a.xds() + g]);
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], corr)), sc);
      _mm512_store_ps(facc[r], _mm512_add_ps(_mm512_load_ps(facc[r]), t));
    }
  }
  const int64_t n = p * kPanel + c * 16;
  if (n >= N) return;
  for (int r = 0; r < R; ++r)
    store16_upto(y + (m0 + r) * N + n, _mm512_mul_ps(_mm512_load_ps(facc[r]), _mm512_set1_ps(a.sx[m0 + r])), N - n);
}
#else
#define QK_W4A8_ZMM 0
#endif

// R rows x NV ymm of 8 outputs, from ymm column c0 of panel p. acc: the group's int32 sums; facc: the fp32 sums
// over groups (touched once a group, kept in memory to leave the registers to the integer loop).
template <int R, int NV, typename T>
void tile_avx2(const W8Args& a, int64_t m0, int64_t p, int c0, T* y, int64_t N) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* wp = a.w + p * a.K8 * kPanel + c0 * 8;
  const float* sp = a.scales + p * a.G * kPanel + c0 * 8;
  alignas(32) float facc[R][NV][8] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
    for (int64_t o = g * a.ogroup; o < (g + 1) * a.ogroup; ++o) {
      for (int l = 0; l < NV * 32; l += 64)   // this tile's bytes of the octet, 16 octets (4 KiB of the panel) ahead
        _mm_prefetch(reinterpret_cast<const char*>(wp + (o + 16) * kPanel) + l, _MM_HINT_T0);
      const int32_t* xo8 = a.xd + m0 * a.xds() + o * 2;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + o * kPanel + v * 8));
        const __m256i ce = _mm256_and_si256(w, nib);                          // columns 0, 2, 4, 6
        const __m256i co = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);   // columns 1, 3, 5, 7
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {   // the row's two dwords broadcast from memory (a load each, no register held)
          const __m256i xe = _mm256_set1_epi32(xo8[r * a.xds()]), xo = _mm256_set1_epi32(xo8[r * a.xds() + 1]);
#if QK_W4A8_VNNI
          acc[r][v] = qk_dpbusd(qk_dpbusd(acc[r][v], ce, xe), co, xo);
#else
          const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(ce, xe), _mm256_maddubs_epi16(co, xo));
          acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(s16, ones));
#endif
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i corr = _mm256_set1_epi32(8 * a.xsum[(m0 + r) * a.xds() + g]);
      for (int v = 0; v < NV; ++v) {
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][v], corr)),
                                       _mm256_loadu_ps(sp + g * kPanel + v * 8));
        _mm256_store_ps(facc[r][v], _mm256_add_ps(_mm256_load_ps(facc[r][v]), t));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_set1_ps(a.sx[m0 + r]);
    for (int v = 0; v < NV; ++v) {
      const int64_t n = p * kPanel + (c0 + v) * 8;
      if (n < N) store8_upto(y + (m0 + r) * N + n, _mm256_mul_ps(_mm256_load_ps(facc[r][v]), s), N - n);
    }
  }
}
#endif

template <typename T>
void w4a8_panels(const W8Args& a, int64_t M, int64_t p0, int64_t p1, T* y, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if (a.ogroup > 0) {
    for (int64_t p = p0; p < p1; ++p) {
      if (M == 1) {   // the whole panel a pass: its 256 bytes an octet are one stream
        tile_avx2<1, 8>(a, 0, p, 0, y, N);
        continue;
      }
#if QK_W4A8_ZMM
      for (int c = 0; c < 4; ++c) {   // a quarter panel a pass, up to 16 rows sharing its unpacked codes
        int64_t m = 0;
        for (; m + 16 <= M; m += 16) tile_zmm<16>(a, m, p, c, y, N);
        for (; m + 8 <= M; m += 8) tile_zmm<8>(a, m, p, c, y, N);
        switch (M - m) {
          case 7: tile_zmm<7>(a, m, p, c, y, N); break;
          case 6: tile_zmm<6>(a, m, p, c, y, N); break;
          case 5: tile_zmm<5>(a, m, p, c, y, N); break;
          case 4: tile_zmm<4>(a, m, p, c, y, N); break;
          case 3: tile_zmm<3>(a, m, p, c, y, N); break;
          case 2: tile_zmm<2>(a, m, p, c, y, N); break;
          case 1: tile_zmm<1>(a, m, p, c, y, N); break;
          default: break;
        }
      }
      continue;
#endif
      for (int c0 = 0; c0 < 8; c0 += 2) {   // a quarter panel a pass, up to four rows sharing its codes
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) tile_avx2<4, 2>(a, m, p, c0, y, N);
        switch (M - m) {
          case 3: tile_avx2<3, 2>(a, m, p, c0, y, N); break;
          case 2: tile_avx2<2, 2>(a, m, p, c0, y, N); break;
          case 1: tile_avx2<1, 2>(a, m, p, c0, y, N); break;
          default: break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t p = p0; p < p1; ++p) panel_scalar(a, M, p, y, N);
}

// The reference's per-row quantization (kernels/reference/ops.py quantize_per_token): fp32 division, round half
// to even, clamped; a zero row has scale 1.
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_f(x[k])));
  const float scale = amax > 0.f ? amax / 127.0f : 1.0f;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(to_f(x[k]) / scale);
    v = std::min(127.f, std::max(-128.f, v));
    q[k] = static_cast<int8_t>(static_cast<int>(v));
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = 0;
  return scale;
}

// Row x [K] into its prepared block (W8Args: the dwords, the group sums, the quantized values) at dst; returns the
// row's scale.
template <typename T>
float prepare_row(const T* x, int64_t K, int64_t G, char* dst) {
  const int64_t K8 = (K + kOct - 1) / kOct, group = K / G;
  auto* xd = reinterpret_cast<int32_t*>(dst);
  auto* xsum = reinterpret_cast<int32_t*>(dst + 8 * K8);
  auto* q = reinterpret_cast<int8_t*>(dst + 8 * K8 + 4 * G);
  const float sx = quantize_row(x, K, K8 * kOct, q);
  for (int64_t o = 0; o < K8; ++o)
    for (int h = 0; h < 2; ++h) {
      uint32_t d = 0;
      for (int j = 0; j < 4; ++j) d |= static_cast<uint32_t>(static_cast<uint8_t>(q[o * kOct + 2 * j + h])) << (8 * j);
      xd[o * 2 + h] = static_cast<int32_t>(d);
    }
  for (int64_t g = 0; g < G; ++g) {
    int32_t s = 0;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) s += q[k];
    xsum[g] = s;
  }
  return sx;
}

}  // namespace

// x [..., K] float -> y [..., N] in x's dtype; packed / scales from w4a16_pack and the CPU set's blocked scales.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  check_float_dtype(x, "w4a8_linear: x");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.size(2) == kPanel,
              "w4a8_linear: packed must be contiguous int32 [N/64, K/8, 64] from w4a16_pack");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(2) == kPanel,
              "w4a8_linear: scales must be contiguous fp32 [N/64, G, 64]");
  const int64_t NP = packed.size(0), K8 = packed.size(1), K = x.size(-1), G = scales.size(1);
  TORCH_CHECK(NP == (N + kPanel - 1) / kPanel && scales.size(0) == NP,
              "w4a8_linear: packed / scale shapes do not match ", N, " outputs");
  TORCH_CHECK(K8 == (K + kOct - 1) / kOct, "w4a8_linear: x has ", K, " features, the weight ", K8 * kOct);
  TORCH_CHECK(G > 0 && K % G == 0 && K / G <= 16384, "w4a8_linear: ", G, " groups of ", K, " features");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  const int64_t rb = row_bytes(K8, G);
  std::vector<int32_t> rows(M * rb / 4);   // the prepared rows (int32 words: aligned for the dwords)
  std::vector<float> sx(M);
  char* rp = reinterpret_cast<char*>(rows.data());
  QK_DISPATCH_FLOAT(x.scalar_type(), "w4a8_linear", [&] {
    const scalar_t* xp = x2.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m) sx[m] = prepare_row(xp + m * K, K, G, rp + m * rb);
    const W8Args a = rows_args(rp, sx.data(), packed.data_ptr<int32_t>(), scales.data_ptr<float>(), K, G);
    scalar_t* yp = y.data_ptr<scalar_t>();
    parallel_chunks(NP, 2, [&](int64_t p0, int64_t p1) { w4a8_panels(a, M, p0, p1, yp, N); });
  });
  return y.reshape(out_shape);
}

namespace parts {

// The MoE op's and the decode region's entry to the same code (the op above calls the pieces directly: a test
// builds this file alone with another instruction set, and its op must not reach these exported symbols).
int64_t w4a8_row_bytes(int64_t K, int64_t G) { return row_bytes((K + kOct - 1) / kOct, G); }

template <typename T>
float w4a8_prepare_row(const T* x, int64_t K, int64_t G, char* dst) {
  return prepare_row(x, K, G, dst);
}

template <typename T>
void w4a8_panel_range(const char* rows, const float* sx, int64_t M, int64_t K, const int32_t* packed,
                      const float* scales, int64_t G, int64_t p0, int64_t p1, T* y, int64_t N) {
  w4a8_panels(rows_args(rows, sx, packed, scales, K, G), M, p0, p1, y, N);
}

#define QK_W4A8_PARTS(T)                                                                                       \
  template float w4a8_prepare_row<T>(const T*, int64_t, int64_t, char*);                                       \
  template void w4a8_panel_range<T>(const char*, const float*, int64_t, int64_t, const int32_t*, const float*, \
                                    int64_t, int64_t, int64_t, T*, int64_t);
QK_W4A8_PARTS(float)
QK_W4A8_PARTS(c10::BFloat16)
#undef QK_W4A8_PARTS

}  // namespace parts
}  // namespace qk

// The operator namespace: qwen3_cpu in the kernel set; a test builds this file alone under another name with a
// narrower instruction set (the scalar path) to compare the paths bit for bit on one machine.
#ifndef QK_W4A8_LIB
#define QK_W4A8_LIB qwen3_cpu
#endif
#define QK_W4A8_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
QK_W4A8_FRAGMENT(QK_W4A8_LIB, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scales, int n) -> Tensor", &qk::w4a8_linear);
}
