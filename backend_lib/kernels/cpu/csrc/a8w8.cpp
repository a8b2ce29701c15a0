// A8W8 linear for the CPU: dynamic per-token int8 activations x int8 per-channel weights.
//
//   s_t = max|x_t| / 127, q_t = round_half_even(x_t / s_t), acc = q W^T (exact int32), y = acc * s_t * w_scale
//
// Integer accumulation is exact: every row is bit-identical whatever the batch (batch invariant) and
// equal to the reference. The packed layout depends on the instruction set of this build (a8w8_pack
// runs in the same build as a8w8_linear):
//
// AVX512-VNNI: panels of 64 output rows; for every group of 4 k-values, 64 rows x 4 bytes (four zmm
// of 16 rows each), so a panel is one sequential stream and each vpdpbusd updates 16 outputs with no
// horizontal reduction. An x row contributes its 4 bytes by broadcast; up to 6 rows share every weight
// load. vpdpbusd multiplies unsigned by signed bytes, so activations are offset by +128 and
// 128 * sum(w_n) is subtracted again.
//
// AVX-VNNI without AVX-512 (Alder Lake+ / Zen 5 client hosts, the avx2vnni build): the same scheme on ymm:
// panels of 16 output rows; for every group of 4 k-values, 16 rows x 4 bytes (two ymm of 8 rows: one cache line
// per group), the 256-bit vpdpbusd (u8 x s8, four products summed into each int32 lane, no saturation) with the
// same +128 offset and colsum correction.
//
// Otherwise (AVX2 without VNNI, and the portable fallback): the AVX-VNNI layout (16-row panels of 4-byte groups, one
// cache line per group) with signed int8 activations (no offset). vpmaddubsw multiplies unsigned by signed bytes and
// adds the pairs into int16 with saturation, so each product takes its sign from the activation: |w| (vpabsb, in
// [0, 128] as an unsigned byte, -128 included) times sign(w) * q (vpsignb, |q| <= 127), then vpmaddwd by ones adds the
// two int16 pair sums of a group into its int32 lane. No pair can saturate: |q w| <= 127 * 128 = 16,256, a pair
// <= 32,512 < 32,767. |q| <= 127 holds for every finite row (s_t = max|x_t| / 127 maps the largest |x| to 127);
// q = -128 comes only from a non-finite row (its outputs are non-finite whatever the sums). Per 32 weight bytes: 5
// vector instructions (vpabsb with the load folded, vpsignb, vpmaddubsw, vpmaddwd, vpaddd; the |w| shared by every
// x row of the tile), where the vpmaddwd path this replaced needed two vpmovsxbw, two vpmaddwd and two vpaddd: on
// the 2-core AVX2 VM (AMD EPYC, huge pages, one thread, a standalone loop over 224 MB of 4 MB matrices) 11.8-12.4
// GB/s against 9.4-10.1, the plain read of the same bytes 12.1-12.7.
//
// Exactness: every path sums products of integers into int32 with no saturating step (vpmaddubsw: int16 pair sums
// <= 32,512, then vpmaddwd by ones; vpdpbusd: (q + 128) in [0, 255] times w in [-128, 127], under 2^15 each), so for any
// K below 2^16 no sum can leave int32, and the order of the sums (one or two chains per output vector, any
// unrolling) never changes a result: the int32 sum (minus 128 * sum(w_n) on the VNNI paths), and the fp32
// epilogue after it, are the same bits on every path, in every batch.
//
// Batch 1 (the decode GEMVs): one x row gives a weight load one vpdpbusd, so the VNNI ymm tile runs two chains of
// sums per output vector (odd and even groups, added at the end: exact) and the accumulation latency does not bound
// the loop. The AVX2 batch-1 tile prefetches its stream 1 KiB ahead, every line (on the 2-core AVX2 VM, huge pages,
// the standalone loop above, alternated: 19.4-19.8 against 17.6-17.7 GB/s at one thread, 30.3-30.8 against
// 27.8-29.1 at two; 4 KiB ahead was slower, 16.2-16.3; one line in two, tried earlier, slower too; the op itself
// over the 0.6B demo's shapes x 8 layers, one thread: 18.1-18.6 GB/s against 14.7-15.8 without, 17.4 at 2 KiB). The VNNI ymm
// tile does not (on the shared AVX-512 host it was within the neighbours' noise; no AVX-VNNI host measured since).
#include "ops.h"
#include "parts.h"
#include "vec.h"


namespace qk {
namespace {

#if defined(__AVX512VNNI__)
#define QK_A8W8_ZMM 1       // 64-row panels, vpdpbusd on zmm
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define QK_A8W8_VNNI256 1   // 16-row panels of 4-byte groups, vpdpbusd on ymm (AVX-VNNI)
#elif defined(__AVX2__) && defined(__FMA__)
#define QK_A8W8_AVX2 1      // 16-row panels of 4-byte groups, vpmaddubsw on |w| and sign(w) * q
#endif

#if defined(QK_A8W8_ZMM)
constexpr int64_t kPanel = 64;   // output rows per panel (4 zmm x 16 int32 lanes)
constexpr int64_t kGroup = 4;    // k-values per weight group (one vpdpbusd lane)
constexpr int32_t kOffset = 128; // activations stored as q + 128 (unsigned bytes)
using qx_t = uint8_t;
#elif defined(QK_A8W8_VNNI256)
constexpr int64_t kPanel = 16;   // output rows per panel (2 ymm x 8 int32 lanes)
constexpr int64_t kGroup = 4;    // k-values per weight group (one vpdpbusd lane)
constexpr int32_t kOffset = 128; // activations stored as q + 128 (unsigned bytes)
using qx_t = uint8_t;
#else
constexpr int64_t kPanel = 16;   // output rows per panel (2 ymm x 8 int32 lanes)
constexpr int64_t kGroup = 4;    // k-values per weight group (one int32 lane: vpmaddubsw, then vpmaddwd by ones)
constexpr int32_t kOffset = 0;   // activations stored as signed int8
using qx_t = int8_t;
#endif
constexpr int kMaxRows = 6;      // x rows per register tile (6 x 4 zmm or 6 x 2 ymm accumulators)

// The vector width of the quantization loop and its store of 16 / 8 rounded lanes in [-128, 127] as qx_t: it
// follows the activation layout (VNNI: uint8 q + 128, on 16 lanes; AVX-VNNI: the same on 8; AVX2: int8 q, on 8).
#if defined(QK_A8W8_ZMM)
#define QK_A8W8_QLANES 1
using QV = F32x16;
inline void store_q(qx_t* q, __m512 v) {
  const __m512i iv = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(iv));
}
#elif defined(QK_A8W8_VNNI256)
#define QK_A8W8_QLANES 1
using QV = F32x8;
inline void store_q(qx_t* q, __m256 v) {
  const __m256i iv = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(128));   // in [0, 255]
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));   // exact
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(w, w));                         // exact
}
#elif defined(QK_A8W8_AVX2)
#define QK_A8W8_QLANES 1
using QV = F32x8;
inline void store_q(qx_t* q, __m256 v) {
  const __m256i iv = _mm256_cvtps_epi32(v);   // in [-128, 127]: the signed packs below are exact
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
}
#endif

template <typename T>
inline float quantize_row(const T* x, int64_t K, int64_t Kp, qx_t* q) {
  float amax = 0.f;
  int64_t k = 0;
  if constexpr (VN::kLanes > 1) {   // max |x| on this build's widest lanes
    using V = VN;
    V::reg vmax = V::zero();
    for (; k + V::kLanes <= K; k += V::kLanes) vmax = V::max(vmax, V::abs(V::loadx(x + k)));
    amax = V::reduce_max(vmax);
  }
  for (int64_t r = k; r < K; ++r) amax = std::max(amax, std::fabs(to_f(x[r])));
  const float scale = amax > 0.f ? amax / 127.0f : 1.0f;
  k = 0;
#if defined(QK_A8W8_QLANES)
  {
    using V = QV;
    const V::reg vs = V::set1(scale);
    const V::reg lo = V::set1(-128.f), hi = V::set1(127.f);
    for (; k + V::kLanes <= K; k += V::kLanes)
      store_q(q + k, V::min(V::max(V::round_nearest(V::div(V::loadx(x + k), vs)), lo), hi));
  }
#endif
  for (; k < K; ++k) {
    float v = std::nearbyint(to_f(x[k]) / scale);   // round half to even, as torch.round
    v = std::min(127.f, std::max(-128.f, v));
    q[k] = static_cast<qx_t>(static_cast<int>(v) + kOffset);
  }
  for (; k < Kp; ++k) q[k] = 0;   // padding meets zero weights
  return scale;
}

#if defined(QK_A8W8_AVX2)
// The AVX2 register tile: MB x rows (signed q, a 4-byte group broadcast) against a 16-row panel ([KG][16][4]); |w| of
// each weight vector computed once and shared by the MB rows; one x row keeps a second set of sums for the odd
// groups (added at the end: exact).
constexpr int64_t kPrefetch = 1024;   // bytes ahead of the batch-1 weight stream
template <int MB>
inline void panel_tile_avx2(const int8_t* xu, int64_t ldx, const int8_t* panel, int64_t KG, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto w = [&](int64_t g, int j) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + g * 64 + j * 32)); };
  auto group = [&](int i, int64_t g) {
    int32_t xv;
    std::memcpy(&xv, xu + i * ldx + g * 4, 4);
    return _mm256_set1_epi32(xv);
  };
  // sum of the group's 4 products per int32 lane: |w| * (sign(w) * q), pairs in int16 (no saturation, see above)
  auto dot = [&](__m256i acc, __m256i wabs, __m256i wv, __m256i xb) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xb, wv)), ones));
  };
  __m256i acc[MB][2];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  int64_t g = 0;
  if constexpr (MB == 1) {
    __m256i odd0 = _mm256_setzero_si256(), odd1 = _mm256_setzero_si256();
    for (; g + 2 <= KG; g += 2) {
      // the stream 1 KiB ahead, both lines of the two groups (see the note at the top)
      _mm_prefetch(reinterpret_cast<const char*>(panel + g * 64 + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel + g * 64 + 64 + kPrefetch), _MM_HINT_T0);
      const __m256i x0 = group(0, g), x1 = group(0, g + 1);
      const __m256i w0 = w(g, 0), w1 = w(g, 1), w2 = w(g + 1, 0), w3 = w(g + 1, 1);
      acc[0][0] = dot(acc[0][0], _mm256_abs_epi8(w0), w0, x0);
      acc[0][1] = dot(acc[0][1], _mm256_abs_epi8(w1), w1, x0);
      odd0 = dot(odd0, _mm256_abs_epi8(w2), w2, x1);
      odd1 = dot(odd1, _mm256_abs_epi8(w3), w3, x1);
    }
    acc[0][0] = _mm256_add_epi32(acc[0][0], odd0);
    acc[0][1] = _mm256_add_epi32(acc[0][1], odd1);
  }
  for (; g < KG; ++g) {
    const __m256i w0 = w(g, 0), w1 = w(g, 1);
    const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256i xb = group(i, g);
      acc[i][0] = dot(acc[i][0], a0, w0, xb);
      acc[i][1] = dot(acc[i][1], a1, w1, xb);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kPanel), acc[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kPanel + 8), acc[i][1]);
  }
}
#endif

#if defined(QK_A8W8_VNNI256)
// The AVX-VNNI register tile: MB x rows (q + 128 bytes, a 4-byte group broadcast) against a 16-row panel
// ([KG][16][4]: one cache line per group); one x row keeps a second set of sums for the odd groups (added at the
// end: exact).
template <int MB>
inline void panel_tile_vnni256(const uint8_t* xu, int64_t ldx, const int8_t* panel, int64_t KG, int32_t* out) {
  auto w = [&](int64_t g, int j) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + g * 64 + j * 32)); };
  auto group = [&](int i, int64_t g) {
    int32_t xv;
    std::memcpy(&xv, xu + i * ldx + g * 4, 4);
    return _mm256_set1_epi32(xv);
  };
  __m256i acc[MB][2];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  int64_t g = 0;
  if constexpr (MB == 1) {
    __m256i odd0 = _mm256_setzero_si256(), odd1 = _mm256_setzero_si256();
    for (; g + 2 <= KG; g += 2) {
      const __m256i x0 = group(0, g), x1 = group(0, g + 1);
      acc[0][0] = _mm256_dpbusd_avx_epi32(acc[0][0], x0, w(g, 0));
      acc[0][1] = _mm256_dpbusd_avx_epi32(acc[0][1], x0, w(g, 1));
      odd0 = _mm256_dpbusd_avx_epi32(odd0, x1, w(g + 1, 0));
      odd1 = _mm256_dpbusd_avx_epi32(odd1, x1, w(g + 1, 1));
    }
    acc[0][0] = _mm256_add_epi32(acc[0][0], odd0);
    acc[0][1] = _mm256_add_epi32(acc[0][1], odd1);
  }
  for (; g < KG; ++g) {
    const __m256i w0 = w(g, 0), w1 = w(g, 1);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256i xb = group(i, g);
      acc[i][0] = _mm256_dpbusd_avx_epi32(acc[i][0], xb, w0);
      acc[i][1] = _mm256_dpbusd_avx_epi32(acc[i][1], xb, w1);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kPanel), acc[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kPanel + 8), acc[i][1]);
  }
}
#endif

// acc[i][j] (16 / 8 output rows each) = sum over k-groups of broadcast(x_i[group g]) . panel[g][j].
template <int MB>
inline void panel_kernel(const qx_t* xu, int64_t ldx, const int8_t* panel, int64_t KG, int32_t* out) {
#if defined(QK_A8W8_ZMM)
  __m512i acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < KG; ++g) {
    const int8_t* p = panel + g * 256;
    const __m512i w0 = _mm512_load_si512(p), w1 = _mm512_load_si512(p + 64), w2 = _mm512_load_si512(p + 128),
                  w3 = _mm512_load_si512(p + 192);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      int32_t xv;
      std::memcpy(&xv, xu + i * ldx + g * 4, 4);
      const __m512i xb = _mm512_set1_epi32(xv);
      acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xb, w0);
      acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xb, w1);
      acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], xb, w2);
      acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], xb, w3);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(out + i * kPanel + j * 16, acc[i][j]);
#elif defined(QK_A8W8_VNNI256)
  panel_tile_vnni256<MB>(xu, ldx, panel, KG, out);
#elif defined(QK_A8W8_AVX2)
  panel_tile_avx2<MB>(xu, ldx, panel, KG, out);
#else
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kPanel; ++r) {
      int32_t s = 0;
      for (int64_t g = 0; g < KG; ++g)
        for (int kk = 0; kk < kGroup; ++kk)
          s += static_cast<int32_t>(xu[i * ldx + g * kGroup + kk]) * panel[(g * kPanel + r) * kGroup + kk];
      out[i * kPanel + r] = s;
    }
#endif
}


inline void panel_rows(int mb, const qx_t* xu, int64_t ldx, const int8_t* panel, int64_t KG, int32_t* out) {
  switch (mb) {
    case 6: panel_kernel<6>(xu, ldx, panel, KG, out); break;
    case 5: panel_kernel<5>(xu, ldx, panel, KG, out); break;
    case 4: panel_kernel<4>(xu, ldx, panel, KG, out); break;
    case 3: panel_kernel<3>(xu, ldx, panel, KG, out); break;
    case 2: panel_kernel<2>(xu, ldx, panel, KG, out); break;
    default: panel_kernel<1>(xu, ldx, panel, KG, out); break;
  }
}

}  // namespace

// w_q int8 [N, K] -> packed int8 [ceil(N/kPanel), ceil(K/kGroup), kPanel, kGroup] (zero padded).
at::Tensor a8w8_pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kChar && w_in.dim() == 2, "w_q must be int8 [N, K]");
  auto w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NP = (N + kPanel - 1) / kPanel, KG = (K + kGroup - 1) / kGroup;
  auto packed = stream_zeros({NP, KG, kPanel, kGroup}, at::kChar);   // huge pages (memory.cpp)
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < kPanel && p * kPanel + r < N; ++r) {
        const int8_t* row = src + (p * kPanel + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * KG + k / kGroup) * kPanel + r) * kGroup + k % kGroup] = row[k];
      }
  });
  return packed;
}

at::Tensor a8w8_colsum(const at::Tensor& w_q) {
  TORCH_CHECK(w_q.scalar_type() == at::kChar && w_q.dim() == 2, "w_q must be int8 [N, K]");
  return w_q.sum(1, /*keepdim=*/false, at::kInt).contiguous();
}

namespace parts {

int64_t a8w8_act_bytes() { return sizeof(qx_t); }
int64_t a8w8_panel() { return kPanel; }
int64_t a8w8_group() { return kGroup; }

template <typename T>
float a8w8_quantize_row(const T* x, int64_t K, int64_t Kp, void* q) {
  return quantize_row(x, K, Kp, static_cast<qx_t*>(q));
}

template <typename T>
void a8w8_panels(const void* xu_in, const float* sp, int64_t M, int64_t Kp, const int8_t* wp, int64_t KG,
                 const float* wsp, const int32_t* csp, int64_t N, int64_t p0, int64_t p1, T* yp, int64_t ldy) {
  const qx_t* xup = static_cast<const qx_t*>(xu_in);
  const int64_t panel_bytes = KG * kPanel * kGroup;
  alignas(64) int32_t acc[kMaxRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wp + p * panel_bytes;
    const int64_t n0 = p * kPanel;
    const int64_t nb = std::min<int64_t>(kPanel, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      panel_rows(mb, xup + m0 * Kp, Kp, panel, KG, acc);
      for (int i = 0; i < mb; ++i) {
        const float s = sp[m0 + i];
        T* yrow = yp + (m0 + i) * ldy + n0;
        const int32_t* a = acc + i * kPanel;
        int64_t j = 0;
#if defined(QK_A8W8_AVX2) || defined(QK_A8W8_VNNI256)
        const __m256 vs = _mm256_set1_ps(s);   // the scalar loop's integer correction and two products, lane by lane
        for (; j + 8 <= nb; j += 8) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j));
          if constexpr (kOffset != 0)   // a - 128 * sum(w_n): the exact int32 sum of q w
            v = _mm256_sub_epi32(v, _mm256_mullo_epi32(_mm256_set1_epi32(kOffset),
                                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(csp + n0 + j))));
          store8x(yrow + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), vs), _mm256_loadu_ps(wsp + n0 + j)));
        }
#endif
        for (; j < nb; ++j)   // (acc * s_t) * w_scale[n], the reference's order
          yrow[j] = from_f<T>((static_cast<float>(a[j] - kOffset * csp[n0 + j]) * s) * wsp[n0 + j]);
      }
    }
  }
}

#define QK_A8W8_PARTS(T)                                                                                       \
  template float a8w8_quantize_row<T>(const T*, int64_t, int64_t, void*);                                     \
  template void a8w8_panels<T>(const void*, const float*, int64_t, int64_t, const int8_t*, int64_t, const float*, \
                               const int32_t*, int64_t, int64_t, int64_t, T*, int64_t);
QK_A8W8_PARTS(float)
QK_A8W8_PARTS(c10::BFloat16)
#undef QK_A8W8_PARTS

}  // namespace parts

// x [..., K] float -> y [..., N] (x's dtype). packed from a8w8_pack; w_scale fp32 [N]; colsum int32 [N] (sum(w_n),
// which only the VNNI layout's +128 offset needs).
at::Tensor a8w8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& colsum) {
  check_float_dtype(x_in, "x");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(3) == kGroup,
              "packed weight expected from a8w8_pack (of this build)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && colsum.scalar_type() == at::kInt, "w_scale fp32, colsum int32");
  const int64_t K = x_in.size(-1), N = w_scale.size(0);
  const int64_t NP = packed.size(0), KG = packed.size(1), Kp = KG * kGroup;
  TORCH_CHECK(Kp >= K && Kp - K < kGroup && NP == (N + kPanel - 1) / kPanel, "x / packed weight mismatch");
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.reshape(sizes);
  auto xu = at::empty({M, Kp}, x.options().dtype(kOffset ? at::kByte : at::kChar));
  auto scales = at::empty({M}, x.options().dtype(at::kFloat));
  qx_t* xup = static_cast<qx_t*>(xu.data_ptr());
  float* sp = scales.data_ptr<float>();
  const float* wsp = w_scale.data_ptr<float>();
  const int32_t* csp = colsum.data_ptr<int32_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  QK_DISPATCH_FLOAT(x.scalar_type(), "a8w8_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) sp[m] = quantize_row(xp + m * K, K, Kp, xup + m * Kp);
    });
    const int64_t chunk = std::max<int64_t>(1, NP / (8 * at::get_num_threads()));
    parallel_chunks(NP, chunk, [&](int64_t p0, int64_t p1) {
      parts::a8w8_panels(xup, sp, M, Kp, wp, KG, wsp, csp, N, p0, p1, yp, N);
    });
  });
  return y.reshape(sizes);
}

}  // namespace qk
