// The mixture-of-experts op's pieces (moe.cpp) at pointer level, with no parallel region and no allocation of
// their own: the standalone op (moe_experts) runs them in a parallel region of its own, decode_layers.cpp inside
// its one region per step. Whichever thread runs a piece, the piece computes the same bits (see moe.cpp).
//
// Work: pairs sorted per token by expert (stable, as torch.sort(stable=True)), then counted per expert in pair
// order (the composed slot's stable argsort): expert e's rows are slots [start_e, start_e + n_e) (make_plan,
// serial). Then, each split over the team with a barrier between: (1) each token's row prepared once (A8W8, W4A8:
// quantized; W4A16 / AVX2 float: widened to fp32, prepare); (2) gathered into its slots (gather_slot; a group of
// one row reads its token's row in place, direct_rows); (3) the gate_up panels of all touched experts
// (gate_up_item); (4) SwiGLU of every slot and the down GEMM's input prepared (silu_slot); (5) the down panels
// (down_item); (6) the combine (combine_item).
//
// W4A16 experts with a GPTQ act-order perm (each expert's gate_up and down its own, or none): w4a16_linear gathers
// its fp32 input row into the weight's column order (row[k] = x[perm[k]]), so do these pieces: gather_slot gathers
// the pair's token row by its expert's gate_up perm (such a slot is never read in place), silu_slot prepares the
// down GEMM's input by the expert's down perm. The values are the same fp32 numbers in another order: the
// GEMMs' bits are the standalone op's.
#pragma once

#include <cstring>

#include "parts.h"
#include "vec.h"

namespace qk {
namespace moe {

// kW4A8: int4 codes (zero point 8) on int8 activations, w4a8_linear's arithmetic (`moe_experts_quant: int4a8`)
enum Kind : int64_t { kFloat = 0, kA8W8 = 1, kW4A16 = 2, kW4A8 = 3 };
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
  const float* scale;   // A8W8 w_scale, W4A16 / W4A8 scales
  const void* aux;      // A8W8 colsum, W4A16 zeros
  float lut;            // W4A16 lut_zero
  const int64_t* perm;  // W4A16 act-order perm [K] (nullptr: none)
};

// Table columns per weight: float (packed), A8W8 (packed, w_scale, colsum), W4A16 (packed, scales, zeros, perm),
// W4A8 (packed, scales).
inline int64_t table_stride(int64_t kind) {
  return kind == kFloat ? 1 : kind == kA8W8 ? 3 : kind == kW4A8 ? 2 : 4;
}

// One layer's experts (moe_experts' table, lut and dims) and the layout of its GEMMs' input rows for the
// activation type XT (sizes of XT passed as xt_bytes).
struct Experts {
  int64_t kind = 0, E = 0, H = 0, I = 0, aux_gu = 0, aux_dn = 0;
  bool wbf16 = false;
  const int64_t* table = nullptr;
  int64_t cols = 0;
  const float* lut = nullptr;
  int64_t kp_h = 0, kp_i = 0, rb_h = 0, rb_i = 0, panel = 0, np_gu = 0, np_dn = 0, ch_gu = 0, ch_dn = 0, cchunks = 0;

  Experts() = default;
  Experts(int64_t kind_, int64_t E_, int64_t H_, int64_t I_, int64_t aux_gu_, int64_t aux_dn_, bool wbf16_,
          const int64_t* table_, int64_t cols_, const float* lut_, int64_t xt_bytes)
      : kind(kind_), E(E_), H(H_), I(I_), aux_gu(aux_gu_), aux_dn(aux_dn_), wbf16(wbf16_), table(table_),
        cols(cols_), lut(lut_) {
    const int64_t ab = parts::a8w8_act_bytes(), ag = parts::a8w8_group();
    kp_h = kind == kA8W8 ? aux_gu * ag : H;
    kp_i = kind == kA8W8 ? aux_dn * ag : I;
    auto row_bytes = [&](int64_t kp, int64_t groups) -> int64_t {
      if (kind == kA8W8) return kp * ab;
      if (kind == kW4A16) return kp * 4;
      if (kind == kW4A8) return parts::w4a8_row_bytes(kp, groups);
      return kp * xt_bytes;
    };
    rb_h = row_bytes(kp_h, aux_gu), rb_i = row_bytes(kp_i, aux_dn);
    panel = kind == kA8W8 ? parts::a8w8_panel() : kPanelRows;
    np_gu = (2 * I + panel - 1) / panel, np_dn = (H + panel - 1) / panel;
    ch_gu = (np_gu + kChunk - 1) / kChunk, ch_dn = (np_dn + kChunk - 1) / kChunk;
    cchunks = (H + kCombineCols - 1) / kCombineCols;
  }

  Weight weight(int64_t e, int which) const {   // which 0: gate_up, 1: down
    const int64_t* row = table + e * cols + table_stride(kind) * which;
    Weight w{};
    w.w = reinterpret_cast<const void*>(row[0]);
    if (kind != kFloat) w.scale = reinterpret_cast<const float*>(row[1]);
    if (kind == kA8W8 || kind == kW4A16) w.aux = reinterpret_cast<const void*>(row[2]);
    if (kind == kW4A16) w.lut = lut[e * 2 + which], w.perm = reinterpret_cast<const int64_t*>(row[3]);
    return w;
  }
  const int64_t* perm(int64_t e, int which) const {   // a W4A16 weight's act-order perm, or nullptr
    if (kind != kW4A16) return nullptr;
    return reinterpret_cast<const int64_t*>(table[e * cols + table_stride(kind) * which + 3]);
  }
};

struct Group {
  int64_t e, start, n;
};

// The step's (token, expert) pairs per expert, in memory of the caller's (plan_bytes, plan_at).
struct Plan {
  int64_t Tn, k, S, E, ng;
  int64_t *sid, *cnt, *fill, *slot_of, *tok_of, *exp_of;
  Group* groups;
  char* sw;   // [S] routing weights (in the model dtype) sorted per token by expert
};

inline size_t plan_layout(int64_t Tn, int64_t k, int64_t E, size_t sw_bytes, size_t* off) {
  const int64_t S = Tn * k;
  Offsets o;
  off[0] = o.take(S * 8), off[1] = o.take((E + 1) * 8), off[2] = o.take((E + 1) * 8), off[3] = o.take(S * 8);
  off[4] = o.take(S * 8), off[5] = o.take(std::min(E, S) * sizeof(Group)), off[6] = o.take(S * sw_bytes);
  off[7] = o.take(S * 8);
  return o.off;
}
inline size_t plan_bytes(int64_t Tn, int64_t k, int64_t E, size_t sw_bytes) {
  size_t off[8];
  return plan_layout(Tn, k, E, sw_bytes, off);
}
inline Plan plan_at(char* base, int64_t Tn, int64_t k, int64_t E, size_t sw_bytes) {
  size_t off[8];
  plan_layout(Tn, k, E, sw_bytes, off);
  Plan p{};
  p.Tn = Tn, p.k = k, p.S = Tn * k, p.E = E, p.ng = 0;
  p.sid = reinterpret_cast<int64_t*>(base + off[0]);
  p.cnt = reinterpret_cast<int64_t*>(base + off[1]);
  p.fill = reinterpret_cast<int64_t*>(base + off[2]);
  p.slot_of = reinterpret_cast<int64_t*>(base + off[3]);
  p.tok_of = reinterpret_cast<int64_t*>(base + off[4]);
  p.groups = reinterpret_cast<Group*>(base + off[5]);
  p.sw = base + off[6];
  p.exp_of = reinterpret_cast<int64_t*>(base + off[7]);
  return p;
}

// Fills the plan from ids / wts [Tn, k]; returns -1, or the index of the first pair whose id is out of range.
template <typename T>
int64_t make_plan(const int64_t* ids, const T* wts, Plan& p) {
  const int64_t Tn = p.Tn, k = p.k, S = p.S, E = p.E;
  T* sw = reinterpret_cast<T*>(p.sw);
  for (int64_t t = 0; t < Tn; ++t) {
    for (int64_t j = 0; j < k; ++j) {   // insertion sort: stable, like torch.sort(stable=True)
      const int64_t e = ids[t * k + j];
      if (e < 0 || e >= E) {
        p.ng = 0;
        return t * k + j;
      }
      int64_t i = j;
      while (i > 0 && p.sid[t * k + i - 1] > e) {
        p.sid[t * k + i] = p.sid[t * k + i - 1];
        sw[t * k + i] = sw[t * k + i - 1];
        --i;
      }
      p.sid[t * k + i] = e;
      sw[t * k + i] = wts[t * k + j];
    }
  }
  for (int64_t e = 0; e <= E; ++e) p.cnt[e] = 0;
  for (int64_t q = 0; q < S; ++q) ++p.cnt[p.sid[q] + 1];
  for (int64_t e = 0; e < E; ++e) p.cnt[e + 1] += p.cnt[e];
  for (int64_t e = 0; e < E; ++e) p.fill[e] = p.cnt[e];
  for (int64_t q = 0; q < S; ++q) {
    p.slot_of[q] = p.fill[p.sid[q]]++;
    p.tok_of[p.slot_of[q]] = q / k;
    p.exp_of[p.slot_of[q]] = p.sid[q];
  }
  p.ng = 0;
  for (int64_t e = 0; e < E; ++e)
    if (p.cnt[e + 1] > p.cnt[e]) p.groups[p.ng++] = {e, p.cnt[e], p.cnt[e + 1] - p.cnt[e]};
  return -1;
}

// The phases' buffers (moe_bufs_bytes, bufs_at): the token rows prepared (tok, tsc), their slots (in, isc), the
// gate_up outputs, SwiGLU, the down GEMM's input rows (ain, asc) and the pairs' outputs (y).
struct Bufs {
  char* tok;
  float* tsc;
  char* in;
  float* isc;
  char* gu;
  char* act;
  char* ain;
  float* asc;
  char* y;
};

inline size_t bufs_layout(const Experts& ex, int64_t Tn, int64_t S, size_t t_bytes, bool with_tok, size_t* off) {
  Offsets o;
  off[0] = with_tok ? o.take(Tn * ex.rb_h) : 0, off[1] = with_tok ? o.take(Tn * 4) : 0;
  off[2] = o.take(S * ex.rb_h), off[3] = o.take(S * 4), off[4] = o.take(S * 2 * ex.I * t_bytes);
  off[5] = o.take(S * ex.I * t_bytes), off[6] = o.take(S * ex.rb_i), off[7] = o.take(S * 4);
  off[8] = o.take(S * ex.H * t_bytes);
  return o.off;
}
// with_tok false: the caller holds the prepared token rows (tok, tsc set by it)
inline size_t bufs_bytes(const Experts& ex, int64_t Tn, int64_t S, size_t t_bytes, bool with_tok) {
  size_t off[9];
  return bufs_layout(ex, Tn, S, t_bytes, with_tok, off);
}
inline Bufs bufs_at(char* base, const Experts& ex, int64_t Tn, int64_t S, size_t t_bytes, bool with_tok) {
  size_t off[9];
  bufs_layout(ex, Tn, S, t_bytes, with_tok, off);
  Bufs b{};
  if (with_tok) b.tok = base + off[0], b.tsc = reinterpret_cast<float*>(base + off[1]);
  b.in = base + off[2], b.isc = reinterpret_cast<float*>(base + off[3]), b.gu = base + off[4];
  b.act = base + off[5], b.ain = base + off[6], b.asc = reinterpret_cast<float*>(base + off[7]);
  b.y = base + off[8];
  return b;
}

// One GEMM's panels [p0, p1) for group g: M rows of `rows` (scales `sc`) -> dst rows [M, N].
template <typename T, typename XT>
void gemm(const Experts& ex, int which, const Group& g, const char* rows, const float* sc, int64_t K, int64_t kp,
          int64_t N, int64_t p0, int64_t p1, T* dst) {
  const Weight w = ex.weight(g.e, which);
  const int64_t M = g.n;
  if (ex.kind == kA8W8) {
    const int64_t KG = which == 0 ? ex.aux_gu : ex.aux_dn;
    parts::a8w8_panels<T>(rows, sc, M, kp, static_cast<const int8_t*>(w.w), KG, w.scale,
                          static_cast<const int32_t*>(w.aux), N, p0, p1, dst, N);
  } else if (ex.kind == kW4A16) {
    const int64_t G = which == 0 ? ex.aux_gu : ex.aux_dn;
    const float* xf = reinterpret_cast<const float*>(rows);
    const float z = (M == 1 && w.lut >= 0.f && parts::w4a16_lut_row(xf, K)) ? w.lut : -1.f;
    parts::w4a16_panel_range<T>(xf, M, K, static_cast<const int32_t*>(w.w), w.scale,
                                static_cast<const float*>(w.aux), G, p0, p1, dst, N, z);
  } else if (ex.kind == kW4A8) {
    parts::w4a8_panel_range<T>(rows, sc, M, K, static_cast<const int32_t*>(w.w), w.scale,
                               which == 0 ? ex.aux_gu : ex.aux_dn, p0, p1, dst, N);
  } else if (ex.wbf16) {
    parts::float_panels<XT, c10::BFloat16, T>(reinterpret_cast<const XT*>(rows), kp,
                                              static_cast<const c10::BFloat16*>(w.w), dst, M, N, p0, p1);
  } else {
    parts::float_panels<XT, float, T>(reinterpret_cast<const XT*>(rows), kp, static_cast<const float*>(w.w), dst,
                                      M, N, p0, p1);
  }
}

// K values of type T widened to fp32 (exact), gathered into a W4A16 weight's column order by its GPTQ act-order perm
// (d[c] = src[perm[c]], w4a16_linear's gather; perm nullptr: none): the one copy of that loop (prepare, gather_slot,
// decode_layers.cpp's prep_row).
template <typename T>
inline void widen_row(const T* src, int64_t K, const int64_t* perm, float* d) {
  if (perm)
    for (int64_t c = 0; c < K; ++c) d[c] = to_f(src[perm[c]]);
  else
    for (int64_t c = 0; c < K; ++c) d[c] = to_f(src[c]);
}

// A row of K values of type T -> the GEMM's input row (returns its scale for A8W8 and W4A8) of the gate_up
// (which 0) or down (1) GEMM; perm: a W4A16 weight's act-order perm (the row gathered into its column order, as
// w4a16_linear), nullptr for none.
template <typename T, typename XT>
float prepare(const Experts& ex, const T* src, int64_t K, int64_t kp, char* dst, const int64_t* perm = nullptr,
              int which = 0) {
  if (ex.kind == kA8W8) return parts::a8w8_quantize_row<T>(src, K, kp, dst);
  if (ex.kind == kW4A8) return parts::w4a8_prepare_row<T>(src, K, which == 0 ? ex.aux_gu : ex.aux_dn, dst);
  if (ex.kind == kW4A16) {
    widen_row(src, K, perm, reinterpret_cast<float*>(dst));
  } else {
    XT* d = reinterpret_cast<XT*>(dst);
    for (int64_t c = 0; c < K; ++c) d[c] = static_cast<XT>(src[c]);
  }
  return 1.f;
}

// (2) slot s's row from its token's prepared row (W4A16 with an act-order perm: gathered by its expert's gate_up
// perm; the token row is the widened fp32 row, so this is w4a16_linear's gather of the same values)
inline void gather_slot(const Experts& ex, const Plan& p, const Bufs& b, int64_t s) {
  const char* src = b.tok + p.tok_of[s] * ex.rb_h;
  if (const int64_t* perm = ex.perm(p.exp_of[s], 0)) {
    widen_row(reinterpret_cast<const float*>(src), ex.H, perm, reinterpret_cast<float*>(b.in + s * ex.rb_h));
  } else {
    std::memcpy(b.in + s * ex.rb_h, src, ex.rb_h);
  }
  b.isc[s] = b.tsc[p.tok_of[s]];
}
// Whether group g's gate_up reads its token's prepared row in place (one row, no gate_up perm) instead of its slot.
inline bool direct_rows(const Experts& ex, const Group& g) { return g.n == 1 && ex.perm(g.e, 0) == nullptr; }
// Whether the step needs the gather: some group reads its slots.
inline bool needs_gather(const Experts& ex, const Plan& p) {
  for (int64_t i = 0; i < p.ng; ++i)
    if (!direct_rows(ex, p.groups[i])) return true;
  return false;
}

// (3) gate_up work item it of [0, ng * ch_gu)
template <typename T, typename XT>
void gate_up_item(const Experts& ex, const Plan& p, const Bufs& b, int64_t it) {
  const Group& g = p.groups[it / ex.ch_gu];
  const int64_t p0 = (it % ex.ch_gu) * kChunk, p1 = std::min(ex.np_gu, p0 + kChunk);
  const bool direct = direct_rows(ex, g);
  const char* rows = direct ? b.tok + p.tok_of[g.start] * ex.rb_h : b.in + g.start * ex.rb_h;
  const float* sc = direct ? b.tsc + p.tok_of[g.start] : b.isc + g.start;
  gemm<T, XT>(ex, 0, g, rows, sc, ex.H, ex.kp_h, 2 * ex.I, p0, p1, reinterpret_cast<T*>(b.gu) + g.start * 2 * ex.I);
}

// (4) SwiGLU of slot s, the down GEMM's input row (by its expert's down perm, W4A16 act-order)
template <typename T, typename XT>
void silu_slot(const Experts& ex, const Plan& p, const Bufs& b, int64_t s) {
  T* act = reinterpret_cast<T*>(b.act) + s * ex.I;
  parts::silu_mul_row<T>(reinterpret_cast<const T*>(b.gu) + s * 2 * ex.I, ex.I, act);
  b.asc[s] = prepare<T, XT>(ex, act, ex.I, ex.kp_i, b.ain + s * ex.rb_i, ex.perm(p.exp_of[s], 1), 1);
}

// (5) down work item it of [0, ng * ch_dn)
template <typename T, typename XT>
void down_item(const Experts& ex, const Plan& p, const Bufs& b, int64_t it) {
  const Group& g = p.groups[it / ex.ch_dn];
  const int64_t p0 = (it % ex.ch_dn) * kChunk, p1 = std::min(ex.np_dn, p0 + kChunk);
  gemm<T, XT>(ex, 1, g, b.ain + g.start * ex.rb_i, b.asc + g.start, ex.I, ex.kp_i, ex.H, p0, p1,
              reinterpret_cast<T*>(b.y) + g.start * ex.H);
}

// (6) combine work item it of [0, Tn * cchunks): in the model dtype, each token's pairs in ascending expert index
// (out row t, columns of chunk it % cchunks).
template <typename T>
void combine_item(const Experts& ex, const Plan& p, const Bufs& b, int64_t it, T* out) {
  const int64_t H = ex.H, k = p.k;
  const int64_t t = it / ex.cchunks, c0 = (it % ex.cchunks) * kCombineCols, c1 = std::min(H, c0 + kCombineCols);
  const T* sw = reinterpret_cast<const T*>(p.sw);
  const T* y = reinterpret_cast<const T*>(b.y);
  T* dst = out + t * H;
  for (int64_t j = 0; j < k; ++j) {
    const T* src = y + p.slot_of[t * k + j] * H;
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

}  // namespace moe
}  // namespace qk
