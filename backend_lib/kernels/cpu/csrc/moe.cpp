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
// Work: pairs sorted per token by expert (stable, as torch.sort(stable=True)), then counted per expert in pair
// order (the composed slot's stable argsort): expert e's rows are slots [start_e, start_e + n_e). Phases, each
// split over the team, a barrier between: (1) each token's row prepared once (A8W8: quantized; W4A16 / AVX2
// float: widened to fp32); (2) gathered into its slots; (3) the gate_up panels of all touched experts;
// (4) SwiGLU of every slot and the down GEMM's input prepared; (5) the down panels; (6) the combine.
#include <omp.h>

#include <atomic>
#include <vector>

#include "ops.h"
#include "parts.h"
#include "vec.h"

namespace qk {
namespace {

enum Kind : int64_t { kFloat = 0, kA8W8 = 1, kW4A16 = 2 };
constexpr int64_t kPanelRows = 64;   // float and W4A16 panels; A8W8's is parts::a8w8_panel()
constexpr int64_t kChunk = 2;        // panels per work item (W4A16 batch 1 takes panels in pairs)
constexpr int64_t kCombineCols = 512;

// Keeps the compiler from fusing a product and the next sum into one fma (the composed slot rounds the product).
template <typename R>
inline void opaque(R& r) {
#if defined(__x86_64__)
  asm volatile("" : "+v"(r));
#else
  asm volatile("" : "+w"(r));
#endif
}

struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
};

struct Work {
  std::vector<char> bytes;
  char* reserve(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
  }
};

struct Offsets {
  size_t off = 0;
  size_t take(size_t n) {
    const size_t o = off;
    off += (n + 63) & ~size_t{63};
    return o;
  }
};

// One expert's weight in the table: column c of the expert's row.
struct Weight {
  const void* w;
  const float* scale;   // A8W8 w_scale, W4A16 scales
  const void* aux;      // A8W8 colsum, W4A16 zeros
  float lut;            // W4A16 lut_zero
};

template <typename T, typename XT>
void moe_impl(int64_t kind, const T* x, const int64_t* ids, const T* wts, int64_t Tn, int64_t k, int64_t E,
              int64_t H, int64_t I, const int64_t* table, int64_t cols, const float* lut, int64_t aux_gu,
              int64_t aux_dn, bool wbf16, T* out) {
  const int64_t S = Tn * k;
  // ---- the pairs per expert ----
  std::vector<int64_t> sid(S), cnt(E + 1, 0), slot_of(S), tok_of(S);
  std::vector<T> sw(S);
  for (int64_t t = 0; t < Tn; ++t) {
    for (int64_t j = 0; j < k; ++j) {   // insertion sort: stable, like torch.sort(stable=True)
      const int64_t e = ids[t * k + j];
      TORCH_CHECK(e >= 0 && e < E, "moe_experts: expert id ", e, " out of range [0, ", E, ")");
      int64_t i = j;
      while (i > 0 && sid[t * k + i - 1] > e) {
        sid[t * k + i] = sid[t * k + i - 1];
        sw[t * k + i] = sw[t * k + i - 1];
        --i;
      }
      sid[t * k + i] = e;
      sw[t * k + i] = wts[t * k + j];
    }
  }
  for (int64_t p = 0; p < S; ++p) ++cnt[sid[p] + 1];
  for (int64_t e = 0; e < E; ++e) cnt[e + 1] += cnt[e];
  {
    std::vector<int64_t> fill(cnt.begin(), cnt.end() - 1);
    for (int64_t p = 0; p < S; ++p) {
      slot_of[p] = fill[sid[p]]++;
      tok_of[slot_of[p]] = p / k;
    }
  }
  struct Group {
    int64_t e, start, n;
  };
  std::vector<Group> groups;
  for (int64_t e = 0; e < E; ++e)
    if (cnt[e + 1] > cnt[e]) groups.push_back({e, cnt[e], cnt[e + 1] - cnt[e]});
  const int64_t ng = static_cast<int64_t>(groups.size());
  auto weight = [&](int64_t e, int which) {   // which 0: gate_up, 1: down
    const int64_t* row = table + e * cols;
    Weight w{};
    if (kind == kFloat) {
      w.w = reinterpret_cast<const void*>(row[which]);
    } else {
      w.w = reinterpret_cast<const void*>(row[3 * which]);
      w.scale = reinterpret_cast<const float*>(row[3 * which + 1]);
      w.aux = reinterpret_cast<const void*>(row[3 * which + 2]);
      if (kind == kW4A16) w.lut = lut[e * 2 + which];
    }
    return w;
  };

  // ---- the input rows' layout of one GEMM (K inputs): bytes per row, and what goes with it ----
  const int64_t ab = parts::a8w8_act_bytes(), ag = parts::a8w8_group();
  const int64_t kp_h = kind == kA8W8 ? aux_gu * ag : H, kp_i = kind == kA8W8 ? aux_dn * ag : I;
  auto row_bytes = [&](int64_t kp) -> int64_t {
    if (kind == kA8W8) return kp * ab;
    if (kind == kW4A16) return kp * 4;
    return kp * static_cast<int64_t>(sizeof(XT));
  };
  const int64_t rb_h = row_bytes(kp_h), rb_i = row_bytes(kp_i);
  Offsets o;
  const size_t o_tok = o.take(Tn * rb_h), o_tsc = o.take(Tn * 4), o_in = o.take(S * rb_h), o_isc = o.take(S * 4),
               o_gu = o.take(S * 2 * I * sizeof(T)), o_act = o.take(S * I * sizeof(T)), o_ain = o.take(S * rb_i),
               o_asc = o.take(S * 4), o_y = o.take(S * H * sizeof(T));
  static thread_local Work ws;
  char* base = ws.reserve(o.off);
  char* tok = base + o_tok;
  float* tsc = reinterpret_cast<float*>(base + o_tsc);
  char* in = base + o_in;
  float* isc = reinterpret_cast<float*>(base + o_isc);
  T* gu = reinterpret_cast<T*>(base + o_gu);
  T* act = reinterpret_cast<T*>(base + o_act);
  char* ain = base + o_ain;
  float* asc = reinterpret_cast<float*>(base + o_asc);
  T* y = reinterpret_cast<T*>(base + o_y);

  // one GEMM's panels [p0, p1) for group g: M rows of `rows` (scales `sc`) -> dst rows [M, N]
  auto gemm = [&](int which, const Group& g, const char* rows, const float* sc, int64_t K, int64_t kp, int64_t N,
                  int64_t p0, int64_t p1, T* dst) {
    const Weight w = weight(g.e, which);
    const int64_t M = g.n;
    if (kind == kA8W8) {
      const int64_t KG = which == 0 ? aux_gu : aux_dn;
      parts::a8w8_panels<T>(rows, sc, M, kp, static_cast<const int8_t*>(w.w), KG, w.scale,
                            static_cast<const int32_t*>(w.aux), N, p0, p1, dst, N);
    } else if (kind == kW4A16) {
      const int64_t G = which == 0 ? aux_gu : aux_dn;
      const float* xf = reinterpret_cast<const float*>(rows);
      const float z = (M == 1 && w.lut >= 0.f && parts::w4a16_lut_row(xf, K)) ? w.lut : -1.f;
      parts::w4a16_panel_range<T>(xf, M, K, static_cast<const int32_t*>(w.w), w.scale,
                                  static_cast<const float*>(w.aux), G, p0, p1, dst, N, z);
    } else if (wbf16) {
      parts::float_panels<XT, c10::BFloat16, T>(reinterpret_cast<const XT*>(rows), kp,
                                                static_cast<const c10::BFloat16*>(w.w), dst, M, N, p0, p1);
    } else {
      parts::float_panels<XT, float, T>(reinterpret_cast<const XT*>(rows), kp, static_cast<const float*>(w.w), dst,
                                        M, N, p0, p1);
    }
  };
  // a row of K values of type T -> the GEMM's input row (returns its scale for A8W8)
  auto prepare = [&](const T* src, int64_t K, int64_t kp, char* dst) -> float {
    if (kind == kA8W8) return parts::a8w8_quantize_row<T>(src, K, kp, dst);
    if (kind == kW4A16) {
      float* d = reinterpret_cast<float*>(dst);
      for (int64_t c = 0; c < K; ++c) d[c] = to_f(src[c]);
    } else {
      XT* d = reinterpret_cast<XT*>(dst);
      for (int64_t c = 0; c < K; ++c) d[c] = static_cast<XT>(src[c]);
    }
    return 1.f;
  };

  const int64_t panel = kind == kA8W8 ? parts::a8w8_panel() : kPanelRows;
  const int64_t np_gu = (2 * I + panel - 1) / panel, np_dn = (H + panel - 1) / panel;
  const int64_t ch_gu = (np_gu + kChunk - 1) / kChunk, ch_dn = (np_dn + kChunk - 1) / kChunk;
  const int64_t cchunks = (H + kCombineCols - 1) / kCombineCols;
  Counter ctr[3];
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ng * ch_gu)));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    // (1) each token's row, once
    for (int64_t t = tid; t < Tn; t += team) tsc[t] = prepare(x + t * H, H, kp_h, tok + t * rb_h);
#pragma omp barrier
    // (2) into its slots
    for (int64_t s = tid; s < S; s += team) {
      std::memcpy(in + s * rb_h, tok + tok_of[s] * rb_h, rb_h);
      isc[s] = tsc[tok_of[s]];
    }
#pragma omp barrier
    // (3) gate_up of every touched expert
    for (int64_t it = ctr[0].v.fetch_add(1); it < ng * ch_gu; it = ctr[0].v.fetch_add(1)) {
      const Group& g = groups[it / ch_gu];
      const int64_t p0 = (it % ch_gu) * kChunk, p1 = std::min(np_gu, p0 + kChunk);
      gemm(0, g, in + g.start * rb_h, isc + g.start, H, kp_h, 2 * I, p0, p1, gu + g.start * 2 * I);
    }
#pragma omp barrier
    // (4) SwiGLU, the down GEMM's input
    for (int64_t s = tid; s < S; s += team) {
      parts::silu_mul_row<T>(gu + s * 2 * I, I, act + s * I);
      asc[s] = prepare(act + s * I, I, kp_i, ain + s * rb_i);
    }
#pragma omp barrier
    // (5) down
    for (int64_t it = ctr[1].v.fetch_add(1); it < ng * ch_dn; it = ctr[1].v.fetch_add(1)) {
      const Group& g = groups[it / ch_dn];
      const int64_t p0 = (it % ch_dn) * kChunk, p1 = std::min(np_dn, p0 + kChunk);
      gemm(1, g, ain + g.start * rb_i, asc + g.start, I, kp_i, H, p0, p1, y + g.start * H);
    }
#pragma omp barrier
    // (6) the combine, in the model dtype, each token's pairs in ascending expert index
    for (int64_t it = ctr[2].v.fetch_add(1); it < Tn * cchunks; it = ctr[2].v.fetch_add(1)) {
      const int64_t t = it / cchunks, c0 = (it % cchunks) * kCombineCols, c1 = std::min(H, c0 + kCombineCols);
      T* dst = out + t * H;
      for (int64_t j = 0; j < k; ++j) {
        const T* src = y + slot_of[t * k + j] * H;
        const float wj = to_f(sw[t * k + j]);
        int64_t c = c0;
        if constexpr (VN::kLanes > 1) {
          using V = VN;
          const V::reg wv = V::set1(wj);
          for (; c + V::kLanes <= c1; c += V::kLanes) {
            V::reg prod = V::round_as(V::mul(V::loadx(src + c), wv), src);
            opaque(prod);
            V::storex(dst + c, j == 0 ? prod : V::add(V::loadx(dst + c), prod));
          }
        }
        for (; c < c1; ++c) {
          float prod = to_f(from_f<T>(to_f(src[c]) * wj));
          opaque(prod);
          dst[c] = j == 0 ? from_f<T>(prod) : from_f<T>(to_f(dst[c]) + prod);
        }
      }
    }
  }
}

}  // namespace

// x [T, H] (float32 / bfloat16); topk_ids int64 [T, k]; topk_weights [T, k] in x's dtype; table int64 [E, cols]:
// per expert the data pointers of its prepared weights (float: gate_up packed, down packed; A8W8 / W4A16: gate_up
// (packed, scale, colsum / zeros), down (the same)), held alive by the caller; lut fp32 [E, 2] (W4A16: each
// weight's lut_zero); dims = [kind (0 float, 1 A8W8, 2 W4A16), H, I, aux_gu, aux_dn, bf16 weights]: aux = A8W8's
// KG (packed.size(1)), W4A16's G (scales.size(1)).
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& weights_in,
                       const at::Tensor& table, const at::Tensor& lut, at::IntArrayRef dims) {
  check_float_dtype(x_in, "moe_experts: x");
  TORCH_CHECK(dims.size() == 6, "moe_experts: dims = [kind, H, I, aux_gu, aux_dn, bf16]");
  const int64_t kind = dims[0], H = dims[1], I = dims[2], aux_gu = dims[3], aux_dn = dims[4];
  const bool wbf16 = dims[5] != 0;
  TORCH_CHECK(kind >= kFloat && kind <= kW4A16, "moe_experts: unknown kind ", kind);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H, "moe_experts: x must be [T, ", H, "]");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) && ids_in.scalar_type() == at::kLong,
              "moe_experts: topk_ids must be int64 [T, k]");
  TORCH_CHECK(weights_in.sizes() == ids_in.sizes() && weights_in.scalar_type() == x_in.scalar_type(),
              "moe_experts: topk_weights must be [T, k] in x's dtype");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.size(1) == (kind == kFloat ? 2 : 6),
              "moe_experts: table must be contiguous int64 [E, 2 | 6]");
  TORCH_CHECK(kind != kW4A16 || (lut.scalar_type() == at::kFloat && lut.is_contiguous() && lut.numel() == 2 * table.size(0)),
              "moe_experts: lut must be fp32 [E, 2]");
  TORCH_CHECK(kind == kA8W8 || (H % 2 == 0 && I % 2 == 0), "moe_experts: even H and I");
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
      moe_impl<T, XT>(kind, x.data_ptr<T>(), ids.data_ptr<int64_t>(), wts.data_ptr<T>(), Tn, k, E, H, I,
                      table.data_ptr<int64_t>(), table.size(1), lp, aux_gu, aux_dn, wbf16, out.data_ptr<T>());
    };
    // float experts: float_linear's activation type (the AVX2 build widens bf16 rows to fp32, exactly)
    if (kind == kFloat && std::is_same_v<T, c10::BFloat16> && parts::float_linear_widens_bf16()) run(float{});
    else run(T{});
  });
  return out;
}

}  // namespace qk
