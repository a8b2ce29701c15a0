// RMSNorm (optionally fused with the residual add) for the CPU, row by row and batch invariant.
// Numerics follow Qwen3's RMSNorm: normalize in fp32, round to the activation dtype, then scale.
#include "common.h"

namespace qk {
namespace {

template <typename T>
inline void norm_row(const T* h, const T* w, T* out, int64_t D, float eps) {
  float part[16] = {0};
  for (int64_t k = 0; k < D; ++k) {
    float v = to_f(h[k]);
    part[k & 15] += v * v;
  }
  for (int s = 8; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) part[l] += part[l + s];
  const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(D) + eps);
  for (int64_t k = 0; k < D; ++k) {
    const float normed = to_f(from_f<T>(to_f(h[k]) * inv));
    out[k] = from_f<T>(to_f(w[k]) * normed);
  }
}

}  // namespace

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
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * D, wp, op + r * D, D, static_cast<float>(eps));
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
      for (int64_t row = r0; row < r1; ++row) {
        for (int64_t k = 0; k < D; ++k)
          hp[row * D + k] = from_f<scalar_t>(to_f(xp[row * D + k]) + to_f(rp[row * D + k]));
        norm_row(hp + row * D, wp, op + row * D, D, static_cast<float>(eps));
      }
    });
  });
  return {out, h};
}

}  // namespace qk
