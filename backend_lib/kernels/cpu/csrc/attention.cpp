// Paged causal attention over a dense (fp32 / bf16) KV cache, for prefill chunks and decode alike.
// Layout per layer: K [pages, kv_heads, page_size / KW, head_dim, KW] (blocked, transposed), V [pages,
// kv_heads, page_size, head_dim]. See attention_common.h for the blocking and batch invariance.
#include "attention_common.h"
#include "parts.h"

namespace qk {
namespace {

// Register tile: NT rows x NK vectors of V's lanes, keys k0.. of a key block ([D, KW] contiguous, kb at its
// first key): out[i][k0 + l] = sum over d of q[r0 + i][d] * K[d][k0 + l], one FMA chain over d per lane.
// Prefetch (pf non-null): per dimension d, the bytes [d B, (d + 1) B) of the two streams pf->k and pf->v, B = KW
// keys' worth (a key block's row of K): the next key block of K and this block's value rows, which are as many bytes.
// A decode item's streams are short (a KV head's 146 keys: 75 KB of bf16) and the hardware's prefetchers barely ramp
// up on them: on the 2-core AVX2 VM, one thread, 1,024 items of 146 keys from DRAM, alternated with the build before
// it, 20.2-20.7 us an item without (3.6 GB/s), 11.5-12.8 with this and the 2-row tiles below (5.8-6.5 GB/s).
// On a 2-core AVX-512 Zen 4 VM (alternated with the build before it, 16 sequences x 8 KV heads a call, ~600 MB of
// pools): the AVX2 build 10.9-11.1 -> 7.8 us an item at 146 keys, 126 -> 85 at 2,000 (one thread); the AVX-512 build
// level within the host's noise (7.0 / 7.0 at 146 keys, 74-91 / 77-88 at 2,000; 2 threads 4.7-5.3 -> 3.9-4.0 at 146).
template <int KW, typename CT>
struct Prefetch {
  const char* k;
  const char* v;
  static constexpr int64_t kBytes = KW * static_cast<int64_t>(sizeof(CT));
  inline void at(int64_t d) const {
    for (int64_t o = 0; o < kBytes; o += 64) {
      __builtin_prefetch(k + d * kBytes + o, 0, 3);
      __builtin_prefetch(v + d * kBytes + o, 0, 3);
    }
  }
};

template <class V, int NT, int NK, int KW, typename CT>
inline void score_tile(const RowBlock& rb, int r0, const CT* kb, int64_t D, float (*out)[kMaxKW], int k0,
                       const Prefetch<KW, CT>* pf) {
  using R = typename V::reg;
  R acc[NT][NK];
#pragma GCC unroll 8
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) acc[i][v] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    if (pf) pf->at(d);
    R kv[NK];
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) kv[v] = V::loadx(kb + d * KW + k0 + V::kLanes * v);
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      const R qb = V::set1(rb.q[r0 + i][d]);
#pragma GCC unroll 4
      for (int v = 0; v < NK; ++v) acc[i][v] = V::fmadd(qb, kv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) V::store(out[i] + k0 + V::kLanes * v, acc[i][v]);
}

// Raw scores of one key block (KW keys) for NR rows, in tiles of this width's shape: AVX-512 all NR (<= 8) rows
// x the block's KW / 16 vectors; AVX2 4 rows x 16 keys (2 ymm), walking the block, or up to 2 rows x the whole block;
// one lane, 1 row x the block's keys. Every score is the same chain over d whatever the tile (on one lane the plain dot product s += q * k).
template <int NR, int KW, typename CT>
inline void score_dense(const RowBlock& rb, int r0, const CT* kb, int64_t D, float (*out)[kMaxKW],
                        const Prefetch<KW, CT>* pf) {
  using V = VN;
  constexpr int W = V::kLanes;
  // AVX2: at most 2 rows (decode with a small GQA group) take 32 keys a tile, so that 8 accumulator chains hide the
  // FMA's latency (4 chains of 2 x 16 left the pipes half idle: decode attention was latency-bound, not memory-bound)
  constexpr int NT = W == 16 ? NR : W == 8 ? (NR <= 2 ? NR : 4) : 1;   // rows per tile
  constexpr int KT = W == 8 ? (NR <= 2 ? KW : 16) : KW;                // keys per tile
  for (int k0 = 0; k0 < KW; k0 += KT) {
    for (int t = 0; t + NT <= NR; t += NT)
      score_tile<V, NT, KT / W, KW>(rb, r0 + t, kb, D, out + t, k0, k0 == 0 && t == 0 ? pf : nullptr);
    if constexpr (NR % NT != 0)
      score_tile<V, NR % NT, KT / W, KW>(rb, r0 + NR / NT * NT, kb, D, out + NR / NT * NT, k0,
                                         k0 == 0 && NR < NT ? pf : nullptr);
  }
}

template <int KW, typename CT>
inline void score_dense_rows(const RowBlock& rb, int r0, int nr, const CT* kb, int64_t D, float (*out)[kMaxKW],
                             const Prefetch<KW, CT>* pf) {
  switch (nr) {
    case 8: score_dense<8, KW>(rb, r0, kb, D, out, pf); break;
    case 7: score_dense<7, KW>(rb, r0, kb, D, out, pf); break;
    case 6: score_dense<6, KW>(rb, r0, kb, D, out, pf); break;
    case 5: score_dense<5, KW>(rb, r0, kb, D, out, pf); break;
    case 4: score_dense<4, KW>(rb, r0, kb, D, out, pf); break;
    case 3: score_dense<3, KW>(rb, r0, kb, D, out, pf); break;
    case 2: score_dense<2, KW>(rb, r0, kb, D, out, pf); break;
    default: score_dense<1, KW>(rb, r0, kb, D, out, pf); break;
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
  // Each key block is prefetched once (at its first row group's first tile): the next key block of K (the next
  // page's first one after a page's last, none after the last page) and this block's value rows.
  int64_t next_page = -1;
  const CT* last_kb = nullptr;
  auto score = [&](int64_t page, int64_t block, int r0, int nr, float (*o)[kMaxKW]) {
    const CT* kb = kc + ((page * KVH + w.kv_head) * S + block * KW) * D;
    const CT* kn = (block + 1) * KW < S ? kb + KW * D
                   : next_page >= 0     ? kc + (next_page * KVH + w.kv_head) * S * D
                                        : kb;   // the last block: its own lines again (already there)
    const CT* vb = vc + ((page * KVH + w.kv_head) * S + block * KW) * D;
    const bool first = kb != last_kb;
    last_kb = kb;
    const auto* k8 = reinterpret_cast<const char*>(kn);
    const auto* v8 = reinterpret_cast<const char*>(vb);
    if (KW == 32) {
      const Prefetch<32, CT> pf{k8, v8};
      score_dense_rows<32>(rb, r0, nr, kb, D, o, first ? &pf : nullptr);
    } else {
      const Prefetch<16, CT> pf{k8, v8};
      score_dense_rows<16>(rb, r0, nr, kb, D, o, first ? &pf : nullptr);
    }
  };
  auto values = [&](int64_t page) { return DenseValues<CT>{vc + (page * KVH + w.kv_head) * S * D, D}; };
  attend_rows(rb, btp + w.seq * max_pages, S, D, sm, score, values, [&](int64_t np) { next_page = np; });
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

int64_t attention_item_rows() { return kMaxRows; }

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
  PagedBatch b(q_in, block_tables_in, query_start_loc_in, seq_lens_in);
  const int64_t H = b.H, D = b.D;
  const int64_t KVH = k_cache.size(1), S = k_cache.size(2) * k_cache.size(4), KW = k_cache.size(4);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.size(3) == D && v_cache.size(2) == S && KW == key_block_width(S),
              "cache shapes do not match q");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxRows && D <= kMaxHeadDim, "attention: unsupported shape");
  auto out = b.plan(KVH);
  if (b.T == 0) return out;
  const int G = b.G;
  const int32_t* qs = b.qsl();
  const int32_t* ls = b.lens();
  const auto& items = b.items;
  const int64_t max_pages = b.max_pages;
  const float sm = static_cast<float>(scale);
  QK_DISPATCH_FLOAT(b.q.scalar_type(), "paged_attention", [&] {
    using QT = scalar_t;
    QK_DISPATCH_FLOAT(k_cache.scalar_type(), "paged_attention", [&] {
      using CT = scalar_t;
      const QT* qp = b.q.data_ptr<QT>();
      QT* op = out.data_ptr<QT>();
      const CT* kc = k_cache.data_ptr<CT>();
      const CT* vc = v_cache.data_ptr<CT>();
      const int32_t* btp = b.tables();
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
