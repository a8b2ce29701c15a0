// RMSNorm (optionally fused with the residual add) for the CPU, row by row and batch invariant.
// Numerics follow Qwen3's RMSNorm: normalize in fp32, round to the activation dtype, then scale.
#include "parts.h"
#include "vec.h"

namespace qk {
namespace {

// 1 / rms of the row: 16 partial sums part[k & 15] (16 / V::kLanes vectors of V's lanes, the same FMAs on every
// vector width when D % 16 == 0, else the scalar loop), then a fixed tree.
template <class V, typename T>
inline float inv_rms(const T* h, int64_t D, float eps) {
  float part[16] = {0};
  int64_t k = 0;
  if constexpr (V::kLanes > 1) {
    if (D % 16 == 0) {
      using R = typename V::reg;
      constexpr int NV = 16 / V::kLanes;
      R acc[NV];
#pragma GCC unroll 2
      for (int c = 0; c < NV; ++c) acc[c] = V::zero();
      for (; k < D; k += 16) {
#pragma GCC unroll 2
        for (int c = 0; c < NV; ++c) {
          const R v = V::loadx(h + k + c * V::kLanes);
          acc[c] = V::fmadd(v, v, acc[c]);
        }
      }
#pragma GCC unroll 2
      for (int c = 0; c < NV; ++c) V::store(part + c * V::kLanes, acc[c]);
    }
  }
  for (; k < D; ++k) {
    const float v = to_f(h[k]);
    part[k & 15] += v * v;
  }
  for (int s = 8; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) part[l] += part[l + s];
  return 1.0f / std::sqrt(part[0] / static_cast<float>(D) + eps);
}

// out = w * round(h * inv): the normalized row rounded to T, then scaled by the weight (V's lanes, then the
// scalar loop's operations on the tail: elementwise, so the same bits whichever computes an element).
template <class V, typename T>
inline void scale_row(const T* h, const T* w, T* out, int64_t D, float inv) {
  int64_t k = 0;
  if constexpr (V::kLanes > 1) {
    const typename V::reg vi = V::set1(inv);
    for (; k + V::kLanes <= D; k += V::kLanes)
      V::storex(out + k, V::mul(V::loadx(w + k), V::round_as(V::mul(V::loadx(h + k), vi), h)));
  }
  for (; k < D; ++k) out[k] = from_f<T>(to_f(w[k]) * to_f(from_f<T>(to_f(h[k]) * inv)));
}

template <class V, typename T>
inline void add_row(const T* x, const T* r, T* h, int64_t D) {
  int64_t k = 0;
  if constexpr (V::kLanes > 1)
    for (; k + V::kLanes <= D; k += V::kLanes) V::storex(h + k, V::add(V::loadx(x + k), V::loadx(r + k)));
  for (; k < D; ++k) h[k] = from_f<T>(to_f(x[k]) + to_f(r[k]));
}

}  // namespace

namespace parts {

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  scale_row<VN>(x, w, out, D, inv_rms<VN>(x, D, eps));
}

template <typename T>
void add_rms_norm_row(const T* x, const T* r, const T* w, T* out, T* h, int64_t D, float eps) {
  add_row<VN>(x, r, h, D);
  scale_row<VN>(h, w, out, D, inv_rms<VN>(h, D, eps));
}

template <typename T>
void qk_norm_rope_head(const T* row, const T* w, const float* cosv, int64_t D, float eps, T* dst) {
  alignas(64) T normed[512];
  const int64_t half = D / 2;
  const float* sinv = cosv + half;
  scale_row<VN>(row, w, normed, D, inv_rms<VN>(row, D, eps));
  for (int64_t i = 0; i < half; ++i) {   // rotate-half in fp32, one rounding
    const float x1 = to_f(normed[i]), x2 = to_f(normed[i + half]);
    dst[i] = from_f<T>(x1 * cosv[i] - x2 * sinv[i]);
    dst[i + half] = from_f<T>(x2 * cosv[i] + x1 * sinv[i]);
  }
}

template <typename T>
void silu_mul_row(const T* g, int64_t I, T* o) {
  const T* u = g + I;
  int64_t i = 0;
  if constexpr (VN::kLanes > 1) {
    using V = VN;
    const V::reg one = V::set1(1.0f);
    for (; i + V::kLanes <= I; i += V::kLanes) {
      const V::reg gv = V::loadx(g + i);
      const V::reg sv = V::round_as(V::div(gv, V::add(one, vexp<V>(V::sub(V::zero(), gv)))), g);
      V::storex(o + i, V::mul(sv, V::loadx(u + i)));
    }
  }
  for (; i < I; ++i) {
    const float gv = to_f(g[i]);
    const float s = to_f(from_f<T>(gv / (1.0f + std::exp(-gv))));   // tails only
    o[i] = from_f<T>(s * to_f(u[i]));
  }
}

#define QK_NORM_PARTS(T)                                                                         \
  template void rms_norm_row<T>(const T*, const T*, T*, int64_t, float);                        \
  template void add_rms_norm_row<T>(const T*, const T*, const T*, T*, T*, int64_t, float);      \
  template void qk_norm_rope_head<T>(const T*, const T*, const float*, int64_t, float, T*);     \
  template void silu_mul_row<T>(const T*, int64_t, T*);
QK_NORM_PARTS(float)
QK_NORM_PARTS(c10::BFloat16)
#undef QK_NORM_PARTS

}  // namespace parts

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_float_dtype(x_in, "x");
  TORCH_CHECK(w_in.scalar_type() == x_in.scalar_type(), "rms_norm: weight dtype must match x");
  const int64_t D = x_in.size(-1);
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.numel() / D;
  QK_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) parts::rms_norm_row(xp + r * D, wp, op + r * D, D, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                 const at::Tensor& w_in, double eps) {
  check_float_dtype(x_in, "x");
  TORCH_CHECK(res_in.scalar_type() == x_in.scalar_type() && w_in.scalar_type() == x_in.scalar_type(),
              "add_rms_norm: x, residual and weight must share a dtype");
  const int64_t D = x_in.size(-1);
  auto x = x_in.contiguous();
  auto r = res_in.contiguous();
  auto w = w_in.contiguous();
  auto out = at::empty_like(x);
  auto h = at::empty_like(x);
  const int64_t rows = x.numel() / D;
  QK_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = r.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row)
        parts::add_rms_norm_row(xp + row * D, rp + row * D, wp, op + row * D, hp + row * D, D, static_cast<float>(eps));
    });
  });
  return {out, h};
}

// Qwen3 attention prologue on the fused qkv projection [T, (H + 2 KVH) * D]: per-head RMSNorm of q and
// k (q_norm, k_norm), rotate-half RoPE at `positions` (fp32 math, one rounding), v copied out.
// Returns q [T, H, D], k [T, KVH, D], v [T, KVH, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& qkv_in, const at::Tensor& q_w,
                                                            const at::Tensor& k_w, const at::Tensor& positions_in,
                                                            const at::Tensor& cos_sin, int64_t H, int64_t KVH,
                                                            double eps) {
  check_float_dtype(qkv_in, "qkv");
  auto qkv = qkv_in.contiguous();
  auto pos = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin must be contiguous fp32");
  const int64_t T = qkv.size(0), D = cos_sin.size(1), W = (H + 2 * KVH) * D;
  TORCH_CHECK(qkv.size(1) == W, "qkv width does not match heads and head_dim");
  auto q = at::empty({T, H, D}, qkv.options());
  auto k = at::empty({T, KVH, D}, qkv.options());
  auto v = at::empty({T, KVH, D}, qkv.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  QK_DISPATCH_FLOAT(qkv.scalar_type(), "qk_norm_rope", [&] {
    using T_ = scalar_t;
    const T_* src = qkv.data_ptr<T_>();
    const T_* qw = q_w.data_ptr<T_>();
    const T_* kw = k_w.data_ptr<T_>();
    T_* qo = q.data_ptr<T_>();
    T_* ko = k.data_ptr<T_>();
    T_* vo = v.data_ptr<T_>();
    at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* cosv = cs + pp[t] * D;
        for (int64_t hh = 0; hh < H + KVH; ++hh) {
          const bool is_q = hh < H;
          T_* dst = is_q ? qo + (t * H + hh) * D : ko + (t * KVH + hh - H) * D;
          parts::qk_norm_rope_head(src + t * W + hh * D, is_q ? qw : kw, cosv, D, static_cast<float>(eps), dst);
        }
        std::memcpy(vo + t * KVH * D, src + t * W + (H + KVH) * D, KVH * D * sizeof(T_));
      }
    });
  });
  return {q, k, v};
}

// SwiGLU on the fused [gate | up] projection: silu(gate) * up, each op rounded as PyTorch does.
at::Tensor silu_mul(const at::Tensor& x_in) {
  check_float_dtype(x_in, "x");
  auto x = x_in.contiguous();
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, x.options());
  QK_DISPATCH_FLOAT(x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) parts::silu_mul_row(xp + r * 2 * I, I, op + r * I);
    });
  });
  return out;
}

}  // namespace qk
