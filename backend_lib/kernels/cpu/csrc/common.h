// Shared helpers of the CPU kernels: bf16 <-> fp32 and the element types the kernels take.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace qk {

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round-to-nearest-even fp32 -> bf16, as torch does (NaN kept quiet).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> inline float to_f(T v);
template <> inline float to_f<float>(float v) { return v; }
template <> inline float to_f<c10::BFloat16>(c10::BFloat16 v) { return bf16_bits_to_float(v.x); }

template <typename T> inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  c10::BFloat16 r;
  r.x = float_to_bf16_bits(v);
  return r;
}

#if defined(__AVX512F__)
// 16 consecutive values as fp32 lanes.
inline __m512 load16x(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16x(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#if defined(__AVX512F__)
// fp32 lanes -> bf16, round to nearest even exactly as float_to_bf16_bits (NaN stays quiet).
inline __m256i f32x16_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}
inline void store16x(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16x(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32x16_to_bf16(v));
}
// The first n (<= 16) lanes, rounded as store16x does.
template <typename T>
inline void store16_upto(T* dst, __m512 v, int64_t n) {
  if (n >= 16) return store16x(dst, v);
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int64_t l = 0; l < n; ++l) dst[l] = from_f<T>(tmp[l]);
}
// Rounds fp32 lanes to T's precision and back (identity for float).
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 consecutive values as fp32 lanes (bf16 -> fp32 is a 16-bit shift).
inline __m256 load8x(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8x(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// fp32 lanes -> bf16, round to nearest even exactly as float_to_bf16_bits (NaN stays quiet).
inline __m128i f32x8_to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                         _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
  // |u| > inf as a signed compare is exact: the masked value is non-negative.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  // every lane is in [0, 0xffff], so the unsigned-saturating pack is a plain narrowing
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8x(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8x(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32x8_to_bf16(v));
}
// The first n (<= 8) lanes, rounded as store8x does.
template <typename T>
inline void store8_upto(T* dst, __m256 v, int64_t n) {
  if (n >= 8) return store8x(dst, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t l = 0; l < n; ++l) dst[l] = from_f<T>(tmp[l]);
}
// Rounds fp32 lanes to T's precision and back (identity for float).
inline __m256 round_to(__m256 v, const float*) { return v; }
inline __m256 round_to(__m256 v, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(f32x8_to_bf16(v)), 16));
}
// Horizontal max / sum of 8 lanes in a fixed order (the same for every row).
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

// Work split into homes: thread t of nt owns the chunks [chunks * t / nt, chunks * (t + 1) / nt), one contiguous
// stretch of the weight, and takes them from the front; then it takes the others' from their backs, so that a
// thread slowed by the host (a busy neighbour, an OS tick) takes fewer chunks instead of holding up the others at
// the barrier, as a static split would. A home is one atomic (front << 32 | back). Handing the chunks out one at a
// time from one counter instead interleaves the threads' chunks over the weight: small chunks (W4A16 / W4A8 panel
// pairs, 128 KB of a 2048-wide int4 weight) then read 37-44 GB/s where the same kernel on contiguous stretches reads
// 58-63 (the 151,936 x 2048 int4a8 head, two threads of this project's Zen 4 VM; docs/performance.md).
inline int64_t home_of(int64_t chunks, int64_t t, int64_t nt) {
  return ((chunks * t / nt) << 32) | (chunks * (t + 1) / nt);
}
// One chunk from the front (a thread's own) or the back (another's) of a home; false once it is empty.
inline bool take_chunk(std::atomic<int64_t>& home, bool front, int64_t& c) {
  int64_t v = home.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t f = v >> 32, b = v & 0xffffffff;
    if (f >= b) return false;
    const int64_t nv = front ? (((f + 1) << 32) | b) : ((f << 32) | (b - 1));
    if (home.compare_exchange_weak(v, nv, std::memory_order_relaxed)) {
      c = front ? f : b - 1;
      return true;
    }
  }
}
// Thread t's chunks of the homes home(0 .. nt) (home(k): thread k's atomic): its own from the front, then the
// others' from their backs; fn(chunk) for each.
template <typename Home, typename Fn>
inline void take_homes(Home&& home, int64_t t, int64_t nt, Fn&& fn) {
  int64_t c;
  while (take_chunk(home(t), true, c)) fn(c);
  for (int64_t k = 1; k < nt; ++k)
    while (take_chunk(home((t + k) % nt), false, c)) fn(c);
}

// fn(i0, i1) over [0, n) in chunks of `chunk` on the intra-op threads, split into homes (above).
template <typename Fn>
inline void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  if (n <= 0) return;
  chunk = std::max(chunk, (n + (int64_t{1} << 30) - 1) >> 30);   // a home's ends fit in 32 bits each
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  constexpr int64_t stride = 8;   // one home per 64 bytes: no two on one cache line
  std::vector<std::atomic<int64_t>> homes(static_cast<size_t>(threads * stride));
  for (int64_t t = 0; t < threads; ++t) homes[t * stride].store(home_of(chunks, t, threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)   // one home per thread (a smaller team: several, each then stolen from)
      take_homes([&](int64_t k) -> std::atomic<int64_t>& { return homes[k * stride]; }, t, threads,
                 [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
  });
}

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace qk

// Dispatch a lambda over float / bfloat16 with scalar_t bound.
#define QK_DISPATCH_FLOAT(TYPE, NAME, ...)                                   \
  [&] {                                                                      \
    if ((TYPE) == at::kFloat) {                                              \
      using scalar_t = float;                                                \
      return __VA_ARGS__();                                                  \
    } else if ((TYPE) == at::kBFloat16) {                                    \
      using scalar_t = c10::BFloat16;                                        \
      return __VA_ARGS__();                                                  \
    }                                                                        \
    TORCH_CHECK(false, NAME, ": unsupported dtype ", (TYPE));               \
  }()
