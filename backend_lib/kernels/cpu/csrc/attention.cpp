// Paged causal attention over a dense (fp32 / bf16) KV cache, for prefill chunks and decode alike.
// Layout per layer: K [pages, kv_heads, page_size / KW, head_dim, KW] (blocked, transposed), V [pages,
// kv_heads, page_size, head_dim]. See attention_common.h for the blocking and batch invariance.
#include "attention_common.h"
#include "parts.h"

namespace qk {
namespace {

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 register tile: 16 keys (2 ymm) x NT <= 4 rows, one FMA chain over d per lane. kb points at the
// tile's first key in its block (row stride KW); out gets columns k0..k0+15.
template <int NT, typename CT>
inline void score_tile8(const RowBlock& rb, int r0, const CT* kb, int64_t KW, int64_t D, float (*out)[kMaxKW], int k0) {
  __m256 acc[NT][2];
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0v = load8x(kb + d * KW), k1v = load8x(kb + d * KW + 8);
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) {
      const __m256 qb = _mm256_set1_ps(rb.q[r0 + i][d]);
      acc[i][0] = _mm256_fmadd_ps(qb, k0v, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(qb, k1v, acc[i][1]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i) {
    _mm256_storeu_ps(out[i] + k0, acc[i][0]);
    _mm256_storeu_ps(out[i] + k0 + 8, acc[i][1]);
  }
}
#endif

// Raw scores of one key block (KW keys) for NR rows: sum over d of q[r][d] * K[d][j], one FMA chain
// per lane. kb points at the block: [D, KW] contiguous.
template <int NR, int KW, typename CT>
inline void score_dense(const RowBlock& rb, int r0, const CT* kb, int64_t D, float (*out)[kMaxKW]) {
#if defined(__AVX512F__)
  constexpr int V = KW / 16;
  __m512 acc[NR][V];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) kv[v] = load16x(kb + d * KW + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const __m512 qb = _mm512_set1_ps(rb.q[r0 + i][d]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(qb, kv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm512_store_ps(out[i] + 16 * v, acc[i][v]);
#elif defined(__AVX2__) && defined(__FMA__)
  for (int k0 = 0; k0 < KW; k0 += 16) {
    for (int t = 0; t + 4 <= NR; t += 4) score_tile8<4>(rb, r0 + t, kb + k0, KW, D, out + t, k0);
    if constexpr (NR % 4 != 0) score_tile8<NR % 4>(rb, r0 + NR / 4 * 4, kb + k0, KW, D, out + NR / 4 * 4, k0);
  }
#else
  for (int i = 0; i < NR; ++i)
    for (int l = 0; l < KW; ++l) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += rb.q[r0 + i][d] * to_f(kb[d * KW + l]);
      out[i][l] = s;
    }
#endif
}

template <int KW, typename CT>
inline void score_dense_rows(const RowBlock& rb, int r0, int nr, const CT* kb, int64_t D, float (*out)[kMaxKW]) {
  switch (nr) {
    case 8: score_dense<8, KW>(rb, r0, kb, D, out); break;
    case 7: score_dense<7, KW>(rb, r0, kb, D, out); break;
    case 6: score_dense<6, KW>(rb, r0, kb, D, out); break;
    case 5: score_dense<5, KW>(rb, r0, kb, D, out); break;
    case 4: score_dense<4, KW>(rb, r0, kb, D, out); break;
    case 3: score_dense<3, KW>(rb, r0, kb, D, out); break;
    case 2: score_dense<2, KW>(rb, r0, kb, D, out); break;
    default: score_dense<1, KW>(rb, r0, kb, D, out); break;
  }
}

// Value rows of one page of a dense cache ([S, D]).
template <typename CT>
struct DenseValues {
  const CT* page;
  int64_t D;
  void fold_scales(float*, int64_t) const {}
  void row(int64_t j, float* out) const {
    for (int64_t d = 0; d < D; ++d) out[d] = to_f(page[j * D + d]);
  }
#if defined(__AVX512F__)
  template <int DC>
  void full(int64_t j, __m512* v) const {
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) v[c] = load16x(page + j * D + 16 * c);
  }
  std::pair<int64_t, int64_t> pair_dims(int64_t p) const { return {32 * p, 32 * p + 16}; }
  void pair(int64_t j, int64_t p, __m512& va, __m512& vb) const {
    va = load16x(page + j * D + 32 * p);
    vb = load16x(page + j * D + 32 * p + 16);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  static constexpr bool kQuads = false;
  std::pair<int64_t, int64_t> pair8_dims(int64_t p) const { return {16 * p, 16 * p + 8}; }
  void pair8(int64_t j, int64_t p, __m256& va, __m256& vb) const {
    va = load8x(page + j * D + 16 * p);
    vb = load8x(page + j * D + 16 * p + 8);
  }
#endif
};

// One work item on a dense cache: the rows of w, read from q and written to out ([T, H, D]), in the calling
// thread (paged_attention hands its items to the intra-op threads; decode_layers to its own).
template <typename QT, typename CT>
inline void dense_item(RowBlock& rb, const WorkItem& w, const int32_t* qs, const int32_t* ls, const int32_t* btp,
                       int64_t max_pages, int G, int64_t H, int64_t KVH, int64_t D, int64_t S, int64_t KW, float sm,
                       const QT* qp, const CT* kc, const CT* vc, QT* op) {
  load_rows(rb, w, qs, ls, G, H, D, qp, copy_row);
  auto score = [&](int64_t page, int64_t block, int r0, int nr, float (*o)[kMaxKW]) {
    const CT* kb = kc + ((page * KVH + w.kv_head) * S + block * KW) * D;
    if (KW == 32) score_dense_rows<32>(rb, r0, nr, kb, D, o);
    else score_dense_rows<16>(rb, r0, nr, kb, D, o);
  };
  auto values = [&](int64_t page) { return DenseValues<CT>{vc + (page * KVH + w.kv_head) * S * D, D}; };
  attend_rows(rb, btp + w.seq * max_pages, S, D, sm, score, values, [](int64_t) {});
  store_rows(rb, w, G, H, D, op, copy_row);
}

template <typename T>
inline void kv_row(const T* krow, const T* vrow, T* kd, T* vd, int64_t slot, int64_t g, int64_t KVH, int64_t D,
                   int64_t S, int64_t KW) {
  const int64_t page = slot / S, off = slot % S;
  T* kb = kd + ((page * KVH + g) * S + (off / KW) * KW) * D + off % KW;   // the key's lane
  for (int64_t d = 0; d < D; ++d) kb[d * KW] = krow[d];
  std::memcpy(vd + ((page * KVH + g) * S + off) * D, vrow, D * sizeof(T));
}

}  // namespace

namespace parts {

template <typename T>
void dense_attention_item(const AttnArgs& a, int32_t seq, int32_t kv_head, int32_t t0, int32_t nq, const T* q,
                          const T* k_cache, const T* v_cache, T* out) {
  static thread_local RowBlock rb;
  const WorkItem w{seq, kv_head, t0, nq};
  dense_item<T, T>(rb, w, a.query_start_loc, a.seq_lens, a.block_tables, a.max_pages, static_cast<int>(a.H / a.KVH),
                   a.H, a.KVH, a.D, a.S, a.KW, a.scale, q, k_cache, v_cache, out);
}

template <typename T>
void write_kv_row(const T* k, const T* v, T* k_cache, T* v_cache, int64_t slot, int64_t g, int64_t KVH, int64_t D,
                  int64_t S, int64_t KW) {
  kv_row(k, v, k_cache, v_cache, slot, g, KVH, D, S, KW);
}

#define QK_ATTN_PARTS(T)                                                                                      \
  template void dense_attention_item<T>(const AttnArgs&, int32_t, int32_t, int32_t, int32_t, const T*, const T*, \
                                        const T*, T*);                                                       \
  template void write_kv_row<T>(const T*, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
QK_ATTN_PARTS(float)
QK_ATTN_PARTS(c10::BFloat16)
#undef QK_ATTN_PARTS

}  // namespace parts

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& query_start_loc_in,
                           const at::Tensor& seq_lens_in, double scale) {
  check_float_dtype(q_in, "q");
  check_float_dtype(k_cache, "k_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 5, "q must be [T, H, D] and k_cache [P, KVH, S/KW, D, KW]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto q = q_in.contiguous();
  auto bt = block_tables_in.to(at::kInt).contiguous();
  auto qsl = query_start_loc_in.to(at::kInt).contiguous();
  auto lens = seq_lens_in.to(at::kInt).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), S = k_cache.size(2) * k_cache.size(4), KW = k_cache.size(4);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.size(3) == D && v_cache.size(2) == S && KW == key_block_width(S),
              "cache shapes do not match q");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxRows && D <= kMaxHeadDim, "attention: unsupported shape");
  const int G = static_cast<int>(H / KVH);
  auto out = at::empty_like(q);
  if (T == 0) return out;
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();
  const auto items = make_items(qs, lens.size(0), KVH, G);
  const int64_t max_pages = bt.size(1);
  const float sm = static_cast<float>(scale);
  QK_DISPATCH_FLOAT(q.scalar_type(), "paged_attention", [&] {
    using QT = scalar_t;
    QK_DISPATCH_FLOAT(k_cache.scalar_type(), "paged_attention", [&] {
      using CT = scalar_t;
      const QT* qp = q.data_ptr<QT>();
      QT* op = out.data_ptr<QT>();
      const CT* kc = k_cache.data_ptr<CT>();
      const CT* vc = v_cache.data_ptr<CT>();
      const int32_t* btp = bt.data_ptr<int32_t>();
      for_each_item(static_cast<int64_t>(items.size()), [&](int64_t it, RowBlock& rb) {
        dense_item<QT, CT>(rb, items[it], qs, ls, btp, max_pages, G, H, KVH, D, S, KW, sm, qp, kc, vc, op);
      });
    });
  });
  return out;
}

// Scatter new K/V rows [T, KVH, D] into the paged caches at slot_mapping (page * S + offset).
void write_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto k = k_in.to(k_cache.scalar_type()).contiguous();
  auto v = v_in.to(v_cache.scalar_type()).contiguous();
  auto slots = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), KW = k_cache.size(4);
  const int64_t S = k_cache.size(2) * KW;
  const int64_t* sp = slots.data_ptr<int64_t>();
  QK_DISPATCH_FLOAT(k.scalar_type(), "write_kv", [&] {
    const scalar_t* ks = k.data_ptr<scalar_t>();
    const scalar_t* vs = v.data_ptr<scalar_t>();
    scalar_t* kd = k_cache.data_ptr<scalar_t>();
    scalar_t* vd = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < KVH; ++g)
        kv_row(ks + (t * KVH + g) * D, vs + (t * KVH + g) * D, kd, vd, sp[t], g, KVH, D, S, KW);
  });
}

}  // namespace qk
