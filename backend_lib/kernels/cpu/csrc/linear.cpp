// Batch-invariant float linear y = x W^T for the CPU, on weights packed at load.
//
// W is packed into panels of 64 output rows: bf16 weights as [N/64][K/2][64][2] (one zmm = 16 rows x
// a k-pair, the AVX512-BF16 dot-product layout), fp32 weights as [N/64][K][64]. x values are
// broadcast and every output lane accumulates its own dot product sequentially over k: the order is
// fixed whatever M is and whichever rows share the call, so a token's result never depends on its
// batch. Up to 6 x-rows share every weight load; a panel is one sequential memory stream (on AVX2 a
// tile of 2..6 x rows covers 8 to 32 of the panel's rows per pass over k; a single row takes all 64).
#include "ops.h"
#include "parts.h"
#include "vec.h"

#include <vector>

namespace qk {
namespace {

constexpr int64_t kPanel = 64;
constexpr int kMaxRows = 6;

inline float bf16_at(const c10::BFloat16* p) { return bf16_bits_to_float(p->x); }

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The panel kernels on V's lanes: MB x rows times NJ vectors of the panel's rows from vector j0 (AVX-512: all 4 x
// 16 rows, j0 = 0; AVX2: 16 ymm hold MB x NJ accumulators plus the weights of one k (or k-pair) and the broadcast
// x values, so a call covers NJ of the panel's 8 row groups and panel_kernel walks the groups). Each lane runs one
// FMA chain over k in order (bf16: even k, then odd k), so the tiling never changes a result.

// V::kLanes rows x a k-pair of a bf16 panel (2 V::kLanes uint16, even k in the low half of each 32-bit lane) as
// two fp32 vectors: even k (shifted up) and odd k (the high half, masked).
template <class V> inline void bf16_pairs(const uint16_t* p, typename V::reg& even, typename V::reg& odd);
#if defined(__AVX512F__)
template <> inline void bf16_pairs<F32x16>(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_load_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif
template <> inline void bf16_pairs<F32x8>(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The AVX2 batch-1 bf16 GEMV (the tied head: 311 MB a token for Qwen3-0.6B) prefetches its stream 2 KiB ahead: on the
// 2-core AVX2 VM (huge pages, one thread, alternated in the same minutes) 19.0-19.8 GB/s against 16.1-18.4 without,
// 18.0-19.5 at 4 KiB, 1 KiB in between. AVX-512 hosts do not (their read rate is at the STREAM read without it).
constexpr int64_t kPrefetchBf16 = 2048;

// bf16 panel, fp32 (or bf16 without the BF16 extension) x: split each k-pair into two fp32 vectors.
template <class V, int MB, int NJ, typename XT>
inline void panel_bf16_fma(const XT* x, int64_t ldx, const c10::BFloat16* panel, int64_t KG, float* out, int j0) {
  using R = typename V::reg;
  constexpr int W = V::kLanes;
  R acc[MB][NJ];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) acc[i][j] = V::zero();
  for (int64_t g = 0; g < KG; ++g) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(panel) + g * 128 + j0 * 2 * W;
    if constexpr (W == 8 && MB == 1 && NJ == 8) {   // AVX2, batch 1: the panel's 4 lines of this k-pair, 2 KiB ahead
      const char* c = reinterpret_cast<const char*>(p) + kPrefetchBf16;
      _mm_prefetch(c, _MM_HINT_T0);
      _mm_prefetch(c + 64, _MM_HINT_T0);
      _mm_prefetch(c + 128, _MM_HINT_T0);
      _mm_prefetch(c + 192, _MM_HINT_T0);
    }
    R we[NJ], wo[NJ];
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) bf16_pairs<V>(p + j * 2 * W, we[j], wo[j]);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const R x0 = V::set1(to_f(x[i * ldx + 2 * g])), x1 = V::set1(to_f(x[i * ldx + 2 * g + 1]));
#pragma GCC unroll 8
      for (int j = 0; j < NJ; ++j) acc[i][j] = V::fmadd(x1, wo[j], V::fmadd(x0, we[j], acc[i][j]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) V::store(out + i * kPanel + (j0 + j) * W, acc[i][j]);
}

// fp32 panel: one k per NJ vectors.
template <class V, int MB, int NJ, typename XT>
inline void panel_f32(const XT* x, int64_t ldx, const float* panel, int64_t K, float* out, int j0) {
  using R = typename V::reg;
  constexpr int W = V::kLanes;
  R acc[MB][NJ];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) acc[i][j] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel + j0 * W;
    R w[NJ];
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) w[j] = V::load(p + j * W);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const R xv = V::set1(to_f(x[i * ldx + k]));
#pragma GCC unroll 8
      for (int j = 0; j < NJ; ++j) acc[i][j] = V::fmadd(xv, w[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) V::store(out + i * kPanel + (j0 + j) * W, acc[i][j]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 x and bf16 panel on vdpbf16ps: each lane adds x[2g] w[2g] + x[2g+1] w[2g+1].
template <int MB>
inline void panel_bf16_dp(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t KG, float* out) {
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < KG; ++g) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(panel) + g * 128;
    const __m512bh w0 = (__m512bh)_mm512_load_si512(p), w1 = (__m512bh)_mm512_load_si512(p + 32),
                   w2 = (__m512bh)_mm512_load_si512(p + 64), w3 = (__m512bh)_mm512_load_si512(p + 96);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * g, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, w3);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + i * kPanel + j * 16, acc[i][j]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
template <int MB> constexpr int kGroups8 = MB == 1 ? 8 : MB == 2 ? 4 : MB <= 4 ? 2 : 1;   // NJ of an AVX2 tile
#endif

// Portable panel kernel: each output accumulates sequentially over k (pairs for bf16 panels).
template <int MB, typename XT, typename WT>
inline void panel_scalar(const XT* x, int64_t ldx, const WT* panel, int64_t K, float* out) {
  for (int i = 0; i < MB; ++i)
    for (int64_t r = 0; r < kPanel; ++r) {
      float s = 0.f;
      if constexpr (std::is_same_v<WT, float>) {
        for (int64_t k = 0; k < K; ++k) s += to_f(x[i * ldx + k]) * panel[k * kPanel + r];
      } else {
        for (int64_t g = 0; g < K / 2; ++g)
          s += to_f(x[i * ldx + 2 * g]) * bf16_at(panel + (g * kPanel + r) * 2) +
               to_f(x[i * ldx + 2 * g + 1]) * bf16_at(panel + (g * kPanel + r) * 2 + 1);
      }
      out[i * kPanel + r] = s;
    }
}

template <int MB, typename XT, typename WT>
inline void panel_kernel(const XT* x, int64_t ldx, const WT* panel, int64_t Kp, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<WT, float>) {
    panel_f32<F32x16, MB, 4>(x, ldx, panel, Kp, out, 0);
  } else {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<XT, c10::BFloat16>) {
      panel_bf16_dp<MB>(x, ldx, panel, Kp / 2, out);
      return;
    }
#endif
    panel_bf16_fma<F32x16, MB, 4>(x, ldx, panel, Kp / 2, out, 0);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  constexpr int NJ = kGroups8<MB>;
  for (int j0 = 0; j0 < kPanel / 8; j0 += NJ) {
    if constexpr (std::is_same_v<WT, float>) panel_f32<F32x8, MB, NJ>(x, ldx, panel, Kp, out, j0);
    else panel_bf16_fma<F32x8, MB, NJ>(x, ldx, panel, Kp / 2, out, j0);
  }
#else
  panel_scalar<MB>(x, ldx, panel, Kp, out);
#endif
}

template <typename XT, typename WT>
inline void panel_rows(int mb, const XT* x, int64_t ldx, const WT* panel, int64_t Kp, float* out) {
  switch (mb) {
    case 6: panel_kernel<6>(x, ldx, panel, Kp, out); break;
    case 5: panel_kernel<5>(x, ldx, panel, Kp, out); break;
    case 4: panel_kernel<4>(x, ldx, panel, Kp, out); break;
    case 3: panel_kernel<3>(x, ldx, panel, Kp, out); break;
    case 2: panel_kernel<2>(x, ldx, panel, Kp, out); break;
    default: panel_kernel<1>(x, ldx, panel, Kp, out); break;
  }
}

inline int64_t k_align(const at::Tensor& w) { return w.scalar_type() == at::kBFloat16 ? 2 : 1; }

template <typename XT, typename WT, typename OT>
void panel_range(const XT* x, int64_t Kp, const WT* wp, OT* y, int64_t M, int64_t N, int64_t p0, int64_t p1) {
    alignas(64) float acc[kMaxRows * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const WT* panel = wp + p * Kp * kPanel;
      const int64_t n0 = p * kPanel, nb = std::min<int64_t>(kPanel, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
        panel_rows(mb, x + m0 * Kp, Kp, panel, Kp, acc);
        for (int i = 0; i < mb; ++i) {
          int64_t j = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          for (; j + 8 <= nb; j += 8) store8x(y + (m0 + i) * N + n0 + j, _mm256_loadu_ps(acc + i * kPanel + j));
#endif
          for (; j < nb; ++j) y[(m0 + i) * N + n0 + j] = from_f<OT>(acc[i * kPanel + j]);
        }
      }
    }
}

template <typename XT, typename WT, typename OT>
void linear_impl(const XT* x, int64_t Kp, const WT* wp, OT* y, int64_t M, int64_t N) {
  const int64_t NP = (N + kPanel - 1) / kPanel;
  // panels handed out in chunks (common.h), as the A8W8 GEMM does: a thread slowed by the host (the lm_head
  // GEMV of a decode step is the largest read of the step) takes fewer panels instead of holding up the other
  // at the barrier of a static split; each panel's outputs are computed the same way either way
  const int64_t chunk = std::max<int64_t>(1, NP / (8 * at::get_num_threads()));
  parallel_chunks(NP, chunk, [&](int64_t p0, int64_t p1) { panel_range(x, Kp, wp, y, M, N, p0, p1); });
}

}  // namespace

namespace parts {

bool float_linear_widens_bf16() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

template <typename XT, typename WT, typename OT>
void float_panels(const XT* x, int64_t Kp, const WT* packed, OT* y, int64_t M, int64_t N, int64_t p0, int64_t p1) {
  panel_range(x, Kp, packed, y, M, N, p0, p1);
}
#define QK_FLOAT_PARTS(XT, WT, OT) \
  template void float_panels<XT, WT, OT>(const XT*, int64_t, const WT*, OT*, int64_t, int64_t, int64_t, int64_t);
QK_FLOAT_PARTS(float, float, float)
QK_FLOAT_PARTS(float, float, c10::BFloat16)
QK_FLOAT_PARTS(float, c10::BFloat16, float)
QK_FLOAT_PARTS(float, c10::BFloat16, c10::BFloat16)
QK_FLOAT_PARTS(c10::BFloat16, float, float)
QK_FLOAT_PARTS(c10::BFloat16, float, c10::BFloat16)
QK_FLOAT_PARTS(c10::BFloat16, c10::BFloat16, float)
QK_FLOAT_PARTS(c10::BFloat16, c10::BFloat16, c10::BFloat16)
#undef QK_FLOAT_PARTS

}  // namespace parts

// w [N, K] float -> packed: bf16 [ceil(N/64), ceil(K/2), 64, 2]; fp32 [ceil(N/64), K, 64, 1] (zero padded).
at::Tensor float_pack(const at::Tensor& w_in) {
  check_float_dtype(w_in, "w");
  TORCH_CHECK(w_in.dim() == 2, "w must be [N, K]");
  auto w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), A = k_align(w);
  const int64_t NP = (N + kPanel - 1) / kPanel, KG = (K + A - 1) / A;
  auto packed = stream_zeros({NP, KG, kPanel, A}, w.scalar_type());   // huge pages (memory.cpp)
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < kPanel && p * kPanel + r < N; ++r)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(dst + (((p * KG + k / A) * kPanel + r) * A + k % A) * es, src + ((p * kPanel + r) * K + k) * es,
                      es);
  });
  return packed;
}

// Rows `ids` of the original [N, K] matrix, read from its packed form (a tied embedding).
at::Tensor float_packed_rows(const at::Tensor& packed, const at::Tensor& ids_in, int64_t K) {
  const int64_t NP = packed.size(0), KG = packed.size(1), A = packed.size(3);
  auto ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel(), es = packed.element_size();
  auto out = at::empty({T, K}, packed.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(packed.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < T; ++i) {
    const int64_t n = ip[i], p = n / kPanel, r = n % kPanel;
    TORCH_CHECK(n >= 0 && p < NP, "row id ", n, " out of range");
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(dst + (i * K + k) * es, src + (((p * KG + k / A) * kPanel + r) * A + k % A) * es, es);
  }
  return out;
}

namespace {

// x [..., K] as the panel kernels read it: [M, Kp] rows, zero padded to the packed pairs, and (AVX2 builds) bf16
// widened to fp32, after the checks of x against a float_pack weight of N rows. float_linear and float_linear_rows
// share it, so both hand the kernels the same x.
at::Tensor kernel_x(const at::Tensor& x_in, const at::Tensor& packed, int64_t N) {
  check_float_dtype(x_in, "x");
  check_float_dtype(packed, "packed");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kPanel,
              "packed weight expected from float_pack");
  const int64_t K = x_in.size(-1), NP = packed.size(0), Kp = packed.size(1) * packed.size(3);
  TORCH_CHECK(Kp >= K && Kp - K < packed.size(3) && NP == (N + kPanel - 1) / kPanel, "x / packed weight mismatch");
  auto x = x_in.reshape({-1, K}).contiguous();
  if (Kp != K) x = at::constant_pad_nd(x, {0, Kp - K});   // odd K with bf16 pairs
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // bf16 -> fp32 is exact: widening x once makes every broadcast in the AVX2 kernels a plain load
  if (x.scalar_type() == at::kBFloat16) x = x.to(at::kFloat);
#endif
  return x;
}

}  // namespace

// The lines of rows `ip[0..C)` of a packed weight (4 bytes a row per k-pair, or per k) gathered into panels of
// their own: row c at lane c % 64 of panel c / 64, the lanes past C zero. Work is split over (panel, k-pair) lines,
// and one destination line takes its (up to) 64 source rows in one pass, so its loads are independent of each
// other and in flight together: a row's lines are 64 x line bytes apart in its panel and every one is a cache miss
// (the candidates of a greedy head are scattered over the vocabulary), so a loop over one row's lines at a time
// waited on each miss (~2 us a row for the 0.6B head's 512 k-pairs; now the misses overlap).
namespace {

void gather_panel_rows(const char* src, char* dst, const int64_t* ip, int64_t C, int64_t KG) {
  constexpr int64_t kLine = 4;
  const int64_t NPc = (C + kPanel - 1) / kPanel;
  std::vector<int64_t> base(static_cast<size_t>(C));   // each row's first line, in bytes
  for (int64_t c = 0; c < C; ++c) base[c] = ((ip[c] / kPanel) * KG * kPanel + ip[c] % kPanel) * kLine;
  at::parallel_for(0, NPc * KG, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t dp = t / KG, g = t % KG, c0 = dp * kPanel, cn = std::min<int64_t>(kPanel, C - c0);
      char* out = dst + t * kPanel * kLine;
      const int64_t* b = base.data() + c0;
      const char* from = src + g * kPanel * kLine;
      for (int64_t i = 0; i < cn; ++i) std::memcpy(out + i * kLine, from + b[i], kLine);   // one 4-byte move
      std::memset(out + cn * kLine, 0, (kPanel - cn) * kLine);
    }
  });
}

}  // namespace

// fp32 y [M, C] = float_linear(x, packed, N, fp32)[:, ids], the same bits: the rows `ids` are gathered from their
// panels into panels of their own (row c of the gather at lane c % 64), and every lane of a panel runs the same
// arithmetic, whatever its lane (layers/greedy_head.py relies on it). Reads one cache line per id and k-pair (its 4
// bytes of each k-pair line), so it pays for a few thousand rows at most.
at::Tensor float_linear_rows(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, const at::Tensor& ids_in) {
  auto x = kernel_x(x_in, packed, N);
  const int64_t M = x.size(0), KG = packed.size(1), A = packed.size(3), Kp = KG * A;
  auto ids = ids_in.to(at::kLong).contiguous();
  const int64_t C = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) TORCH_CHECK(ip[c] >= 0 && ip[c] < N, "row id ", ip[c], " out of range");
  auto y = at::empty({M, C}, x.options().dtype(at::kFloat));
  if (M == 0 || C == 0) return y;
  auto rows = at::empty({(C + kPanel - 1) / kPanel, KG, kPanel, A}, packed.options());
  // one row's k-pair (bf16) or k (fp32): 4 bytes either way (check_float_dtype: no other packed dtype)
  TORCH_CHECK(A * packed.element_size() == 4, "float_linear_rows: a packed line of 4 bytes expected");
  gather_panel_rows(static_cast<const char*>(packed.data_ptr()), static_cast<char*>(rows.data_ptr()), ip, C, KG);
  QK_DISPATCH_FLOAT(x.scalar_type(), "float_linear_rows", [&] {
    using XT = scalar_t;
    QK_DISPATCH_FLOAT(packed.scalar_type(), "float_linear_rows", [&] {
      linear_impl<XT, scalar_t, float>(x.data_ptr<XT>(), Kp, rows.data_ptr<scalar_t>(), y.data_ptr<float>(), M, C);
    });
  });
  return y;
}

at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                        c10::optional<at::ScalarType> out_dtype) {
  auto x = kernel_x(x_in, packed, N);
  const int64_t Kp = packed.size(1) * packed.size(3), M = x.size(0);
  auto odt = out_dtype.value_or(x_in.scalar_type());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options().dtype(odt));
  if (M == 0) return y.reshape(sizes);
  QK_DISPATCH_FLOAT(x.scalar_type(), "float_linear", [&] {
    using XT = scalar_t;
    QK_DISPATCH_FLOAT(packed.scalar_type(), "float_linear", [&] {
      using WT = scalar_t;
      QK_DISPATCH_FLOAT(odt, "float_linear", [&] {
        linear_impl<XT, WT, scalar_t>(x.data_ptr<XT>(), Kp, packed.data_ptr<WT>(), y.data_ptr<scalar_t>(), M, N);
      });
    });
  });
  return y.reshape(sizes);
}

}  // namespace qk
