// The shared core of the paged attention kernels (dense and TurboQuant).
//
// Keys are stored blocked and transposed within a page: blocks of KW keys (32, or 16 when the page
// size is not a multiple of 32), each block [head_dim, KW], so that one vector holds one dimension of
// consecutive keys (scores accumulate along head_dim with FMAs, no horizontal reductions) and a block
// is one sequential memory stream. A work item is a block of rows (query positions x the GQA heads
// that share a KV head) of one sequence; every row walks its keys page by page in position order with
// an online softmax. A row's arithmetic never depends on the other rows of its block, on how many
// rows the block has, or on how the batch was formed: prefill chunks, whole prompts and decode steps
// give bit-identical results for the same position.
#pragma once

#include <tuple>
#include <utility>
#include <vector>

#include "vec.h"

namespace qk {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 32;    // rows per work item
constexpr int kMaxKW = 32;      // keys per score block (at most)
constexpr int kScoreRows = 8;   // rows scored together against one key block

inline int64_t key_block_width(int64_t page_size) { return page_size % 32 == 0 ? 32 : 16; }

struct RowBlock {
  int n = 0;                                   // rows in use
  int64_t n_keys[kMaxRows];                    // keys each row attends to (its position + 1)
  alignas(64) float q[kMaxRows][kMaxHeadDim];  // query rows in fp32 (rotated for TurboQuant)
  alignas(64) float acc[kMaxRows][kMaxHeadDim];
  float mx[kMaxRows], den[kMaxRows];

  void reset(int64_t D) {
    for (int r = 0; r < n; ++r) {
      for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
      mx[r] = -INFINITY;
      den[r] = 0.f;
    }
  }
};

// Online-softmax update of row r with the scores of one page (n keys, -inf where masked): the
// scores become probabilities in place; acc and den are rescaled. One template over the width V (vec.h):
// key j always lands in lane j % V::kLanes and masked lanes add exact zeros, so a row's sum does not
// depend on how many keys the other rows of its block have (the same code, hence the same rounding, for
// every row whatever its block). On one lane it is the plain loop: max, exp and sum in key order.
template <class V>
inline void softmax_update_v(RowBlock& rb, int r, float* s, int64_t n, int64_t D) {
  using R = typename V::reg;
  constexpr int W = V::kLanes;
  const R ninf = V::set1(-INFINITY);
  R vm = ninf;
  int64_t j = 0;
  for (; j + W <= n; j += W) vm = V::max(vm, V::load(s + j));
  const auto tail = V::first(n - j);
  if (j < n) vm = V::max(vm, V::load_first_or(tail, s + j, ninf));
  const float bm = std::max(rb.mx[r], V::reduce_max(vm));
  const R vb = V::set1(bm);
  R vsum = V::zero();
  for (j = 0; j + W <= n; j += W) {
    const R e = vexp<V>(V::sub(V::load(s + j), vb));
    V::store(s + j, e);
    vsum = V::add(vsum, e);
  }
  if (j < n) {
    const R e = V::keep(tail, vexp<V>(V::sub(V::load_first(tail, s + j), vb)));
    V::store_first(tail, s + j, e);
    vsum = V::add(vsum, e);
  }
  const float sum = V::reduce_add(vsum);
  const float alpha = std::exp(rb.mx[r] - bm);
  rb.den[r] = rb.den[r] * alpha + sum;
  if (alpha != 1.0f) {   // x * 1 is x: skipping it changes no bit
    const R va = V::set1(alpha);
    float* a = rb.acc[r];
    int64_t d = 0;
    for (; d + W <= D; d += W) V::store(a + d, V::mul(V::load(a + d), va));
    for (; d < D; ++d) a[d] *= alpha;
  }
  rb.mx[r] = bm;
}

inline void softmax_update(RowBlock& rb, int r, float* s, int64_t n, int64_t D) { softmax_update_v<VN>(rb, r, s, n, D); }

// Scores of one row for one key block: times `scale`, -inf past the row's last key. raw holds kMaxKW >= n
// floats: the full loads stay inside it.
template <class V>
inline void store_scores_v(float* s, const float* raw, int64_t n, int64_t valid, float scale) {
  using R = typename V::reg;
  constexpr int W = V::kLanes;
  const R vs = V::set1(scale), ninf = V::set1(-INFINITY);
  for (int64_t l = 0; l < n; l += W) {
    const auto st = V::first(std::min<int64_t>(W, n - l));
    const auto ok = V::first(std::max<int64_t>(0, std::min<int64_t>(W, valid - l)));
    V::store_first(st, s + l, V::mul_or(ok, V::load(raw + l), vs, ninf));
  }
}

inline void store_scores(float* s, const float* raw, int64_t n, int64_t valid, float scale) {
  store_scores_v<VN>(s, raw, n, valid, scale);
}

#if defined(__AVX512F__)
// Value accumulation, few rows: every value row is loaded once (DC vectors of 16 dims) and added to
// the NR rows' accumulators, all held in registers. Sums run over keys in key order.
template <int NR, int DC, bool Masked, typename Values>
inline void accumulate_rows(RowBlock& rb, int r0, const float* w, int64_t w_stride, const int64_t* n, int64_t nk,
                            Values& values) {
  __m512 acc[NR][DC];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) acc[i][c] = _mm512_loadu_ps(rb.acc[r0 + i] + 16 * c);
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[DC];
    values.template full<DC>(j, v);
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      if (!Masked || j < n[i]) {
        const __m512 wv = _mm512_set1_ps(w[(r0 + i) * w_stride + j]);
#pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) acc[i][c] = _mm512_fmadd_ps(wv, v[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(rb.acc[r0 + i] + 16 * c, acc[i][c]);
}

// Value accumulation, many rows: one pair of 16-dim chunks at a time (values.pair(j, p, va, vb) and
// values.pair_dims(p)), up to 8 rows' accumulators in registers. Masked: some rows see fewer keys.
template <int NR, bool Masked, typename Values>
inline void accumulate_pair(RowBlock& rb, int r0, const float* w, int64_t w_stride, const int64_t* n, int64_t nk,
                            int64_t pair, Values& values) {
  const auto [a0, b0] = values.pair_dims(pair);
  __m512 acc_a[NR], acc_b[NR];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) {
    acc_a[i] = _mm512_loadu_ps(rb.acc[r0 + i] + a0);
    acc_b[i] = _mm512_loadu_ps(rb.acc[r0 + i] + b0);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 va, vb;
    values.pair(j, pair, va, vb);
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      if (!Masked || j < n[i]) {
        const __m512 wv = _mm512_set1_ps(w[(r0 + i) * w_stride + j]);
        acc_a[i] = _mm512_fmadd_ps(wv, va, acc_a[i]);
        acc_b[i] = _mm512_fmadd_ps(wv, vb, acc_b[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) {
    _mm512_storeu_ps(rb.acc[r0 + i] + a0, acc_a[i]);
    _mm512_storeu_ps(rb.acc[r0 + i] + b0, acc_b[i]);
  }
}
#endif

#if defined(__AVX512F__)
template <bool Masked, typename Values>
inline void accumulate_rows_dispatch(RowBlock& rb, int r0, int rows, int64_t D, const float* w, int64_t ws,
                                     const int64_t* n, int64_t nk, Values& values) {
  if (D == 128) {
    if (rows == 2) accumulate_rows<2, 8, Masked>(rb, r0, w, ws, n, nk, values);
    else accumulate_rows<1, 8, Masked>(rb, r0, w, ws, n, nk, values);
  } else {
    if (rows == 2) accumulate_rows<2, 4, Masked>(rb, r0, w, ws, n, nk, values);
    else accumulate_rows<1, 4, Masked>(rb, r0, w, ws, n, nk, values);
  }
}

template <bool Masked, typename Values>
inline void accumulate_pair_dispatch(RowBlock& rb, int r0, int nr, const float* w, int64_t ws, const int64_t* n,
                                     int64_t nk, int64_t pair, Values& values) {
  switch (nr) {
    case 8: accumulate_pair<8, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 7: accumulate_pair<7, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 6: accumulate_pair<6, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 5: accumulate_pair<5, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 4: accumulate_pair<4, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 3: accumulate_pair<3, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    case 2: accumulate_pair<2, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
    default: accumulate_pair<1, Masked>(rb, r0, w, ws, n, nk, pair, values); break;
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Value accumulation on AVX2: NR rows x NP chunk pairs (values.pair8(j, p, va, vb) loads the 8-dim
// chunks at values.pair8_dims(p)), all accumulators in registers (16 ymm). Every accumulator lane is
// one FMA chain over the keys in key order, whatever NR and NP: rows never depend on their block.
// Values with kQuads give NP = 2 pairs as 4 vectors of two 4-dim halves each (values.quad(j, p0, v), the
// halves at values.quad_dims(p0, lo, hi)): which lane holds a dim changes no arithmetic.
template <int NR, int NP, bool Masked, typename Values>
inline void accumulate8(RowBlock& rb, int r0, const float* w, int64_t w_stride, const int64_t* n, int64_t nk,
                        int64_t p0, Values& values) {
  constexpr bool quads = NP == 2 && Values::kQuads;
  int64_t lo[2 * NP], hi[2 * NP];
  if constexpr (quads) {
    values.quad_dims(p0, lo, hi);
  } else {
    for (int c = 0; c < NP; ++c) std::tie(lo[2 * c], lo[2 * c + 1]) = values.pair8_dims(p0 + c);
    for (int c = 0; c < 2 * NP; ++c) hi[c] = lo[c] + 4;
  }
  __m256 acc[NR][2 * NP];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NP; ++c) acc[i][c] = _mm256_loadu2_m128(rb.acc[r0 + i] + hi[c], rb.acc[r0 + i] + lo[c]);
  for (int64_t j = 0; j < nk; ++j) {
    __m256 v[2 * NP];
    if constexpr (quads) {
      values.quad(j, p0, v);
    } else {
#pragma GCC unroll 2
      for (int c = 0; c < NP; ++c) values.pair8(j, p0 + c, v[2 * c], v[2 * c + 1]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      if (!Masked || j < n[i]) {
        const __m256 wv = _mm256_set1_ps(w[(r0 + i) * w_stride + j]);
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NP; ++c) acc[i][c] = _mm256_fmadd_ps(wv, v[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NP; ++c) _mm256_storeu2_m128(rb.acc[r0 + i] + hi[c], rb.acc[r0 + i] + lo[c], acc[i][c]);
}

// rows <= 2 (decode with a small GQA group): 32 dims per pass; otherwise 16 dims x up to 6 rows.
template <bool Masked, typename Values>
inline void accumulate8_dispatch(RowBlock& rb, int r_first, int64_t D, const float* w, int64_t ws, const int64_t* n,
                                 int64_t nk, Values& values) {
  const int rows = rb.n - r_first;
  const int64_t pairs = D / 16;
  if (rows <= 2 && pairs % 2 == 0) {
    for (int64_t p = 0; p < pairs; p += 2) {
      if (rows == 2) accumulate8<2, 2, Masked>(rb, r_first, w, ws, n + r_first, nk, p, values);
      else accumulate8<1, 2, Masked>(rb, r_first, w, ws, n + r_first, nk, p, values);
    }
    return;
  }
  for (int64_t p = 0; p < pairs; ++p)
    for (int r0 = r_first; r0 < rb.n; r0 += 6) {
      switch (std::min(6, rb.n - r0)) {
        case 6: accumulate8<6, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
        case 5: accumulate8<5, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
        case 4: accumulate8<4, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
        case 3: accumulate8<3, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
        case 2: accumulate8<2, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
        default: accumulate8<1, 1, Masked>(rb, r0, w, ws, n + r0, nk, p, values); break;
      }
    }
}
#endif

// Drives one row block over a sequence's pages.
//   score(page, block, r0, nr, out[kScoreRows][kMaxKW]): raw scores of the KW keys of key block `block` for
//     up to kScoreRows rows starting at r0;
//   values(page): a value reader for the page with fold_scales(w, n) (no-op for dense caches), row(j, float*),
//     full<DC>(j, __m512*), pair(j, p, va, vb) and pair_dims(p) (AVX-512), pair8(j, p, va, vb) and
//     pair8_dims(p) (AVX2: D / 16 pairs of 8-dim chunks).
//   ahead(page): called before a page's scores with the page after it (-1 for the last), so that a kernel can
//     prefetch it while it works on this one.
template <typename Scorer, typename ValuesOf, typename Ahead>
void attend_rows(RowBlock& rb, const int32_t* block_table, int64_t S, int64_t D, float scale, Scorer&& score,
                 ValuesOf&& values_of, Ahead&& ahead) {
  static thread_local std::vector<float> sbuf;
  sbuf.resize(static_cast<size_t>(kMaxRows) * S);
  float* scores = sbuf.data();
  const int64_t KW = key_block_width(S);
  int64_t max_keys = 0;
  for (int r = 0; r < rb.n; ++r) max_keys = std::max(max_keys, rb.n_keys[r]);
  const int64_t n_pages = (max_keys + S - 1) / S;
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t page = block_table[p];
    const int64_t base = p * S;
    const int64_t nk = std::min(S, max_keys - base);
    ahead(p + 1 < n_pages ? block_table[p + 1] : -1);
    int r_first = 0;   // rows whose keys end before this page are done (they come first: positions ascend)
    while (r_first < rb.n && rb.n_keys[r_first] <= base) ++r_first;
    for (int64_t j0 = 0; j0 < nk; j0 += KW) {
      for (int r0 = r_first; r0 < rb.n; r0 += kScoreRows) {
        const int nr = std::min(kScoreRows, rb.n - r0);
        alignas(64) float out[kScoreRows][kMaxKW];
        score(page, j0 / KW, r0, nr, out);
        for (int i = 0; i < nr; ++i)   // keys of this block the row may see: n_keys - base - j0
          store_scores(scores + (r0 + i) * S + j0, out[i], std::min(KW, nk - j0), rb.n_keys[r0 + i] - base - j0,
                       scale);
      }
    }
    auto values = values_of(page);
    int64_t n[kMaxRows];
    for (int r = r_first; r < rb.n; ++r) {
      softmax_update(rb, r, scores + r * S, nk, D);
      values.fold_scales(scores + r * S, nk);   // value-row scales into the weights (TurboQuant)
      n[r] = std::max<int64_t>(0, std::min(nk, rb.n_keys[r] - base));
    }
    const int rows = rb.n - r_first;
#if defined(__AVX512F__)
    bool masked = false;
    for (int r = r_first; r < rb.n; ++r) masked |= n[r] < nk;
    if (rows <= 2 && (D == 128 || D == 64)) {
      if (masked) accumulate_rows_dispatch<true>(rb, r_first, rows, D, scores, S, n + r_first, nk, values);
      else accumulate_rows_dispatch<false>(rb, r_first, rows, D, scores, S, n + r_first, nk, values);
      continue;
    }
    if (D % 32 == 0) {
      for (int64_t pair = 0; pair < D / 32; ++pair)
        for (int r0 = r_first; r0 < rb.n; r0 += 8) {
          const int nr = std::min(8, rb.n - r0);
          if (masked) accumulate_pair_dispatch<true>(rb, r0, nr, scores, S, n + r0, nk, pair, values);
          else accumulate_pair_dispatch<false>(rb, r0, nr, scores, S, n + r0, nk, pair, values);
        }
      continue;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 16 == 0) {
      bool masked = false;
      for (int r = r_first; r < rb.n; ++r) masked |= n[r] < nk;
      if (masked) accumulate8_dispatch<true>(rb, r_first, D, scores, S, n, nk, values);
      else accumulate8_dispatch<false>(rb, r_first, D, scores, S, n, nk, values);
      continue;
    }
#endif
    alignas(64) float vbuf[kMaxHeadDim];
    for (int64_t j = 0; j < nk; ++j) {
      values.row(j, vbuf);
      for (int r = r_first; r < rb.n; ++r)
        if (j < n[r]) {
          const float wj = scores[r * S + j];
          for (int64_t d = 0; d < D; ++d) rb.acc[r][d] += wj * vbuf[d];
        }
    }
  }
}

// Splits the step's rows into work items: (sequence, KV head, first query row, query rows). A block
// holds at most kMaxRows / G query positions so that each item has <= kMaxRows rows.
struct WorkItem {
  int32_t seq, kv_head, t0, nq;
};

// Fills rb with the item's rows (query position i, GQA head h -> row i * G + h): each row's key count and
// its query, converted to fp32 and passed through prep(src, dst, D) (a copy, or the TurboQuant rotation).
template <typename QT, typename Prep>
inline void load_rows(RowBlock& rb, const WorkItem& w, const int32_t* qsl, const int32_t* seq_lens, int G, int64_t H,
                      int64_t D, const QT* q, Prep&& prep) {
  const int64_t first_pos = seq_lens[w.seq] - (qsl[w.seq + 1] - qsl[w.seq]) + (w.t0 - qsl[w.seq]);
  alignas(64) float tmp[kMaxHeadDim];
  rb.n = w.nq * G;
  for (int i = 0; i < w.nq; ++i)
    for (int h = 0; h < G; ++h) {
      const int r = i * G + h;
      rb.n_keys[r] = first_pos + i + 1;
      const QT* src = q + ((w.t0 + i) * H + w.kv_head * G + h) * D;
      for (int64_t d = 0; d < D; ++d) tmp[d] = to_f(src[d]);
      prep(tmp, rb.q[r], D);
    }
  rb.reset(D);
}

// Writes each row's attention output acc / den, passed through post(src, dst, D) (a copy, or the
// TurboQuant de-rotation), into out [T, H, D].
template <typename QT, typename Post>
inline void store_rows(RowBlock& rb, const WorkItem& w, int G, int64_t H, int64_t D, QT* out, Post&& post) {
  alignas(64) float tmp[kMaxHeadDim];
  for (int i = 0; i < w.nq; ++i)
    for (int h = 0; h < G; ++h) {
      const int r = i * G + h;
      const float inv = 1.0f / rb.den[r];
      for (int64_t d = 0; d < D; ++d) rb.acc[r][d] *= inv;
      post(rb.acc[r], tmp, D);
      QT* dst = out + ((w.t0 + i) * H + w.kv_head * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_f<QT>(tmp[d]);
    }
}

inline void copy_row(const float* src, float* dst, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }

// Runs fn(item, rb) for items 0..n-1 on the intra-op threads, handing them out one at a time from the last
// (make_items orders a sequence's items by position, so the last ones see the most keys: largest first). A
// static split of causal prefill items leaves one thread with most of the keys (the first 512-token chunk
// of a prompt: 1/4 vs 3/4 of the work). Which thread runs an item never changes its arithmetic.
template <typename Fn>
inline void for_each_item(int64_t n, Fn&& fn) {
  parallel_chunks(n, 1, [&](int64_t i, int64_t) {
    static thread_local RowBlock rb;   // one per thread (64 KB of rows), reused across items and calls
    fn(n - 1 - i, rb);
  });
}

// (decode_layers.cpp's region builds the same items itself: keep the two in step)
inline std::vector<WorkItem> make_items(const int32_t* qsl, int64_t B, int64_t KVH, int G) {
  const int per = std::max(1, kMaxRows / G);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int32_t t = qsl[b]; t < qsl[b + 1]; t += per)
      for (int64_t g = 0; g < KVH; ++g)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(g), t, std::min<int32_t>(per, qsl[b + 1] - t)});
  return items;
}

// The host side that paged_attention and tq_paged_attention share: q [T, H, D] made contiguous, the int32 block
// tables / query_start_loc / seq_lens, the output, and (plan, once the caller has checked its cache against q) the
// GQA group and the work items.
struct PagedBatch {
  at::Tensor q, block_tables, query_start_loc, seq_lens;
  int64_t T, H, D, max_pages = 0;
  int G = 1;
  std::vector<WorkItem> items;

  PagedBatch(const at::Tensor& q_in, const at::Tensor& block_tables_in, const at::Tensor& query_start_loc_in,
             const at::Tensor& seq_lens_in)
      : q(q_in.contiguous()),
        block_tables(block_tables_in.to(at::kInt).contiguous()),
        query_start_loc(query_start_loc_in.to(at::kInt).contiguous()),
        seq_lens(seq_lens_in.to(at::kInt).contiguous()),
        T(q.size(0)), H(q.size(1)), D(q.size(2)) {}

  const int32_t* qsl() const { return query_start_loc.data_ptr<int32_t>(); }
  const int32_t* lens() const { return seq_lens.data_ptr<int32_t>(); }
  const int32_t* tables() const { return block_tables.data_ptr<int32_t>(); }

  // The output (empty like q) and, when there are rows, the work items over KVH KV heads.
  at::Tensor plan(int64_t KVH) {
    G = static_cast<int>(H / KVH);
    auto out = at::empty_like(q);
    if (T == 0) return out;
    max_pages = block_tables.size(1);
    items = make_items(qsl(), seq_lens.size(0), KVH, G);
    return out;
  }
};

}  // namespace qk
