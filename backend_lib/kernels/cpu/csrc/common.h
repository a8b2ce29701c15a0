// Shared helpers of the CPU kernels: bf16 <-> fp32 and the element types the kernels take.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// fn(i0, i1) over [0, n) in chunks of `chunk` handed out one at a time to the intra-op threads (an atomic
// counter): a thread that is slowed (a busy neighbour on a shared host, an OS tick) takes fewer chunks
// instead of holding up the others at the region's barrier, as a static split would.
template <typename Fn>
inline void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  if (n <= 0) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
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
