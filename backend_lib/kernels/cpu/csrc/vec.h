// Width traits of the CPU kernels: one struct per vector width of fp32 lanes (F32x16 on AVX-512, F32x8 on AVX2 +
// FMA, F32x1 scalar), each op one intrinsic (or the short sequence this width has always used for it), so that an
// algorithm is written once as a template over the width (template <class V> ... V::fmadd(...)) and compiles, per
// width, to the very operations its hand-written copies were. VN is this build's widest. Every helper computes in
// a fixed order, so results never depend on how rows are batched.
//
// F32x1 is the scalar build's width: its fmadd is c + a * b, a multiply and an add (the scalar builds have no FMA
// instruction), as the scalar loops it stands for; it is not meant for builds with FMA.
#pragma once

#include <algorithm>

#include "common.h"

namespace qk {

#if defined(__AVX512F__)
struct F32x16 {
  using reg = __m512;
  using mask = __mmask16;
  static constexpr int kLanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  template <typename T> static reg loadx(const T* p) { return load16x(p); }
  template <typename T> static void storex(T* p, reg v) { store16x(p, v); }
  template <typename T> static reg round_as(reg v, const T* p) { return round_to(v, p); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg abs(reg a) { return _mm512_abs_ps(a); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
  static reg round_nearest(reg v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for integral lanes n in [-126, 127]
  static reg pow2(reg n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static reg zero_where_le(reg x, reg lo, reg v) {   // v, 0 in the lanes where x <= lo
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), v, _mm512_setzero_ps());
  }
  // The first m (0..16) lanes, for tails: masked loads read nothing past them.
  static mask first(int64_t m) { return static_cast<mask>((1u << m) - 1); }
  static reg load_first(mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }   // 0 in the other lanes
  static reg load_first_or(mask m, const float* p, reg other) { return _mm512_mask_loadu_ps(other, m, p); }
  static void store_first(mask m, float* p, reg v) { _mm512_mask_storeu_ps(p, m, v); }
  static reg keep(mask m, reg v) { return _mm512_maskz_mov_ps(m, v); }                     // 0 in the other lanes
  static reg mul_or(mask m, reg a, reg b, reg other) { return _mm512_mask_mul_ps(other, m, a, b); }
  static float reduce_max(reg v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(reg v) { return _mm512_reduce_add_ps(v); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// All-ones in the first m (0..8) lanes: the tail mask of maskload / maskstore / blendv.
inline __m256i lanes_below(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

struct F32x8 {
  using reg = __m256;
  using mask = __m256i;
  static constexpr int kLanes = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  template <typename T> static reg loadx(const T* p) { return load8x(p); }
  template <typename T> static void storex(T* p, reg v) { store8x(p, v); }
  template <typename T> static reg round_as(reg v, const T* p) { return round_to(v, p); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg abs(reg a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg round_nearest(reg v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg pow2(reg n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static reg zero_where_le(reg x, reg lo, reg v) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LE_OQ), v); }
  static mask first(int64_t m) { return lanes_below(m); }
  static reg load_first(mask m, const float* p) { return _mm256_maskload_ps(p, m); }
  static reg load_first_or(mask m, const float* p, reg other) {
    return _mm256_blendv_ps(other, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
  }
  static void store_first(mask m, float* p, reg v) { _mm256_maskstore_ps(p, m, v); }
  static reg keep(mask m, reg v) { return _mm256_and_ps(v, _mm256_castsi256_ps(m)); }
  static reg mul_or(mask m, reg a, reg b, reg other) {
    return _mm256_blendv_ps(other, _mm256_mul_ps(a, b), _mm256_castsi256_ps(m));
  }
  static float reduce_max(reg v) { return hmax8(v); }
  static float reduce_add(reg v) { return hsum8(v); }
};
#endif

struct F32x1 {
  using reg = float;
  using mask = bool;
  static constexpr int kLanes = 1;
  static reg zero() { return 0.f; }
  static reg set1(float v) { return v; }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg v) { *p = v; }
  template <typename T> static reg loadx(const T* p) { return to_f(*p); }
  template <typename T> static void storex(T* p, reg v) { *p = from_f<T>(v); }
  template <typename T> static reg round_as(reg v, const T*) { return to_f(from_f<T>(v)); }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg min(reg a, reg b) { return std::min(a, b); }
  static reg max(reg a, reg b) { return std::max(a, b); }
  static reg abs(reg a) { return std::fabs(a); }
  static reg fmadd(reg a, reg b, reg c) { return c + a * b; }   // the scalar loops' s += a * b
  static mask first(int64_t m) { return m > 0; }
  static reg load_first(mask m, const float* p) { return m ? *p : 0.f; }
  static reg load_first_or(mask m, const float* p, reg other) { return m ? *p : other; }
  static void store_first(mask m, float* p, reg v) {
    if (m) *p = v;
  }
  static reg keep(mask m, reg v) { return m ? v : 0.f; }
  static reg mul_or(mask m, reg a, reg b, reg other) { return m ? a * b : other; }
  static float reduce_max(reg v) { return v; }
  static float reduce_add(reg v) { return v; }
};

// This build's widest width.
#if defined(__AVX512F__)
using VN = F32x16;
#elif defined(__AVX2__) && defined(__FMA__)
using VN = F32x8;
#else
using VN = F32x1;
#endif

// exp(x) for fp32 lanes: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (relative error
// ~2e-7); inputs below -87 flush to 0, as softmax needs. The same polynomial and range reduction on every vector
// width; one lane is std::exp (the scalar builds' exp).
template <class V>
inline typename V::reg vexp(typename V::reg x) {
  using R = typename V::reg;
  if constexpr (V::kLanes == 1) {
    return std::exp(x);
  } else {
    const R lo = V::set1(-87.0f), hi = V::set1(88.0f);
    x = V::min(V::max(x, lo), hi);
    const R n = V::round_nearest(V::mul(x, V::set1(1.44269504088896341f)));
    R r = V::fnmadd(n, V::set1(0.693359375f), x);
    r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
    R p = V::set1(1.9875691500e-4f);
    p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
    p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
    p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
    p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
    p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
    const R r2 = V::mul(r, r);
    p = V::fmadd(p, r2, V::add(r, V::set1(1.0f)));
    return V::zero_where_le(x, lo, V::mul(p, V::pow2(n)));
  }
}

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) { return vexp<F32x16>(x); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp256(__m256 x) { return vexp<F32x8>(x); }
#endif

// exp over n floats in place: V's lanes, then a masked tail (the polynomial on AVX-512; std::exp elsewhere, as
// this helper has always computed it there).
template <class V>
inline void exp_inplace_v(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::store(v + i, vexp<V>(V::load(v + i)));
  if (i < n) {
    const auto m = V::first(n - i);
    V::store_first(m, v + i, vexp<V>(V::load_first(m, v + i)));
  }
}

inline void exp_inplace(float* v, int64_t n) {
#if defined(__AVX512F__)
  exp_inplace_v<F32x16>(v, n);
#else
  exp_inplace_v<F32x1>(v, n);
#endif
}

}  // namespace qk
