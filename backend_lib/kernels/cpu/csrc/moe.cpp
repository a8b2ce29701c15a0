// The mixture-of-experts experts of one MoE layer for the CPU (the kernel contract's `moe` slot) in ONE OpenMP
// parallel region: the step's (token, expert) pairs grouped per expert, every touched expert's gate_up GEMM over
// its rows, SwiGLU, its down GEMM, and the weighted combine, where the composed slot (kernels/moe.py) calls 3-4
// ops per expert and a dozen torch ops around them.
//
// Bits: each GEMM is the linear op's own panel code (parts.h: a8w8_panels, float_panels, w4a16_panel_range) on
// the same rows (the pair's token row, quantized / widened as the op does it), SwiGLU is the op's silu_mul_row,
// and the combine is the composed slot's torch arithmetic in the model dtype: contrib = round(y * w) per pair,
// out = contrib of the token's first pair in ascending expert index, then out = round(out + contrib) for the next
// ones. A token's result depends on its own row and routing only: the same bits alone, in any batch, and as the
// composed slot gives them.
//
// Reads: batch 1 touches only its k experts' weights, one pass each; a batch reads each touched expert's weights
// once (its rows share every panel load, up to 6 at a time), the panels of all the touched experts handed out
// from one counter to the threads.
//
// Work: the phases of moe_parts.h (the pairs per expert, then the token rows prepared, gathered, gate_up, SwiGLU,
// down, combine), split over this op's team with a barrier between; decode_layers.cpp runs the same pieces inside
// its one parallel region per decode step.
#include <omp.h>

#include <atomic>
#include <vector>

#include "moe_parts.h"
#include "ops.h"

namespace qk {
namespace {

using namespace moe;

struct Work {
  std::vector<char> bytes;
  char* reserve(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
  }
};

struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
};

template <typename T, typename XT>
void moe_impl(const Experts& ex, const T* x, const int64_t* ids, const T* wts, int64_t Tn, int64_t k, T* out) {
  const int64_t S = Tn * k, H = ex.H;
  // ---- the pairs per expert, the phases' buffers ----
  const size_t pb = plan_bytes(Tn, k, ex.E, sizeof(T));
  static thread_local Work ws;
  char* base = ws.reserve(pb + bufs_bytes(ex, Tn, S, sizeof(T), true));
  Plan plan = plan_at(base, Tn, k, ex.E, sizeof(T));
  const int64_t bad = make_plan<T>(ids, wts, plan);
  TORCH_CHECK(bad < 0, "moe_experts: expert id ", bad < 0 ? 0 : ids[bad], " out of range [0, ", ex.E, ")");
  const Bufs b = bufs_at(base + pb, ex, Tn, S, sizeof(T), true);
  const int64_t ng = plan.ng;
  const bool gather = needs_gather(ex, plan);
  Counter ctr;   // the combine's items
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ng * ex.ch_gu)));
  // per thread its home of the gate_up items, then of the down items (common.h take_homes)
  std::vector<Counter> homes(static_cast<size_t>(2 * nt));
  for (int t = 0; t < nt; ++t) {
    homes[t].v.store(home_of(ng * ex.ch_gu, t, nt), std::memory_order_relaxed);
    homes[nt + t].v.store(home_of(ng * ex.ch_dn, t, nt), std::memory_order_relaxed);
  }
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    // (1) each token's row, once
    for (int64_t t = tid; t < Tn; t += team) b.tsc[t] = prepare<T, XT>(ex, x + t * H, H, ex.kp_h, b.tok + t * ex.rb_h);
#pragma omp barrier
    // (2) into its slots
    if (gather) {
      for (int64_t s = tid; s < S; s += team) gather_slot(ex, plan, b, s);
#pragma omp barrier
    }
    // (3) gate_up of every touched expert
    take_homes([&](int64_t k) -> std::atomic<int64_t>& { return homes[k].v; }, tid, nt,
               [&](int64_t it) { gate_up_item<T, XT>(ex, plan, b, it); });
#pragma omp barrier
    // (4) SwiGLU, the down GEMM's input
    for (int64_t s = tid; s < S; s += team) silu_slot<T, XT>(ex, plan, b, s);
#pragma omp barrier
    // (5) down
    take_homes([&](int64_t k) -> std::atomic<int64_t>& { return homes[nt + k].v; }, tid, nt,
               [&](int64_t it) { down_item<T, XT>(ex, plan, b, it); });
#pragma omp barrier
    // (6) the combine
    for (int64_t it = ctr.v.fetch_add(1); it < Tn * ex.cchunks; it = ctr.v.fetch_add(1))
      combine_item<T>(ex, plan, b, it, out);
  }
}

}  // namespace

// x [T, H] (float32 / bfloat16); topk_ids int64 [T, k]; topk_weights [T, k] in x's dtype; table int64 [E, cols]:
// per expert the data pointers of its prepared weights (float: gate_up packed, down packed; A8W8: gate_up
// (packed, scale, colsum), down (the same); W4A16: gate_up (packed, scales, zeros, perm), down (the same), perm the
// act-order perm int64 [K] of that weight or 0 for none; W4A8: gate_up (packed, scales), down (the same)), held
// alive by the caller; lut fp32 [E, 2] (W4A16: each weight's lut_zero); dims = [kind (0 float, 1 A8W8, 2 W4A16,
// 3 W4A8), H, I, aux_gu, aux_dn, bf16 weights]: aux = A8W8's KG (packed.size(1)), W4A16's and W4A8's G
// (scales.size(1)).
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& weights_in,
                       const at::Tensor& table, const at::Tensor& lut, at::IntArrayRef dims) {
  check_float_dtype(x_in, "moe_experts: x");
  TORCH_CHECK(dims.size() == 6, "moe_experts: dims = [kind, H, I, aux_gu, aux_dn, bf16]");
  const int64_t kind = dims[0], H = dims[1], I = dims[2], aux_gu = dims[3], aux_dn = dims[4];
  const bool wbf16 = dims[5] != 0;
  TORCH_CHECK(kind >= kFloat && kind <= kW4A8, "moe_experts: unknown kind ", kind);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H, "moe_experts: x must be [T, ", H, "]");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) && ids_in.scalar_type() == at::kLong,
              "moe_experts: topk_ids must be int64 [T, k]");
  TORCH_CHECK(weights_in.sizes() == ids_in.sizes() && weights_in.scalar_type() == x_in.scalar_type(),
              "moe_experts: topk_weights must be [T, k] in x's dtype");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.size(1) == 2 * table_stride(kind),
              "moe_experts: table must be contiguous int64 [E, 2 | 6 | 8 | 4] (float | A8W8 | W4A16 | W4A8)");
  TORCH_CHECK(kind != kW4A16 || (lut.scalar_type() == at::kFloat && lut.is_contiguous() && lut.numel() == 2 * table.size(0)),
              "moe_experts: lut must be fp32 [E, 2]");
  TORCH_CHECK(kind == kA8W8 || (H % 2 == 0 && I % 2 == 0), "moe_experts: even H and I");
  TORCH_CHECK(kind != kW4A8 || (aux_gu > 0 && aux_dn > 0 && H % aux_gu == 0 && I % aux_dn == 0 &&
                                 H / aux_gu <= 16384 && I / aux_dn <= 16384),
              "moe_experts: W4A8 groups ", aux_gu, " / ", aux_dn, " do not divide ", H, " / ", I);
  auto x = x_in.contiguous();
  auto ids = ids_in.contiguous();
  auto wts = weights_in.contiguous();
  const int64_t Tn = x.size(0), k = ids.size(1), E = table.size(0);
  auto out = at::empty({Tn, H}, x.options());
  if (Tn == 0 || k == 0) return out.zero_();
  const float* lp = kind == kW4A16 ? lut.data_ptr<float>() : nullptr;
  QK_DISPATCH_FLOAT(x.scalar_type(), "moe_experts", [&] {
    using T = scalar_t;
    auto run = [&](auto xt_tag) {
      using XT = decltype(xt_tag);
      const Experts ex(kind, E, H, I, aux_gu, aux_dn, wbf16, table.data_ptr<int64_t>(), table.size(1), lp,
                       sizeof(XT));
      moe_impl<T, XT>(ex, x.data_ptr<T>(), ids.data_ptr<int64_t>(), wts.data_ptr<T>(), Tn, k, out.data_ptr<T>());
    };
    // float experts: float_linear's activation type (the AVX2 build widens bf16 rows to fp32, exactly)
    if (kind == kFloat && std::is_same_v<T, c10::BFloat16> && parts::float_linear_widens_bf16()) run(float{});
    else run(T{});
  });
  return out;
}

}  // namespace qk
