// TurboQuant 4-bit KV cache on the CPU: encode rows into their pages, and paged attention computed
// in the rotated space straight from the nibble codes (nothing is dequantized into a buffer of the
// context). Rows are processed one at a time in a fixed order, so results are batch invariant.
//
// Layout per layer: byte c of a row = idx[c] | idx[c+d/2] << 4; K codes [pages, kv_heads, page_size / KW, d/2,
// KW] (blocked and transposed, as the dense K), V codes [pages, kv_heads, page_size, d/2]; one fp32 scale per
// row, [pages, kv_heads, page_size] = ||x|| / ||centroids[idx]||.
#include "attention_common.h"
#include <vector>

namespace qk {
namespace {

constexpr int kMaxD = kMaxHeadDim;

// y[j] = sum_i x[i] * R[i][j] (row vector times R), accumulated over i in order.
inline void rotate_row(const float* x, const float* R, int64_t D, float* y) {
  for (int64_t j = 0; j < D; ++j) y[j] = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float xi = x[i];
    const float* r = R + i * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) y[j] += xi * r[j];
  }
}

// o = y R^T, i.e. rotate_row with the transposed matrix RT (RT[j][i] = R[i][j]).
inline void unrotate_row(const float* y, const float* RT, int64_t D, float* o) { rotate_row(y, RT, D, o); }

template <typename T>
void encode_row(const T* x, const float* R, const float* cents, const float* bounds, int64_t D, uint8_t* codes,
                float* scale) {
  float xf[kMaxD], y[kMaxD];
  float part[16] = {0};
  for (int64_t i = 0; i < D; ++i) {
    xf[i] = to_f(x[i]);
    part[i & 15] += xf[i] * xf[i];
  }
  for (int s = 8; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) part[l] += part[l + s];
  const float n = std::sqrt(part[0] + 1e-6f);
  for (int64_t i = 0; i < D; ++i) xf[i] /= n;
  rotate_row(xf, R, D, y);
  uint8_t idx[kMaxD];
  float cn = 0.f;
  for (int64_t j = 0; j < D; ++j) {
    int k = 0;
    for (int b = 0; b < 15; ++b) k += (bounds[b] < y[j]);
    idx[j] = static_cast<uint8_t>(k);
    cn += cents[k] * cents[k];
  }
  const int64_t h = D / 2;
  for (int64_t c = 0; c < h; ++c) codes[c] = static_cast<uint8_t>(idx[c] | (idx[c + h] << 4));
  *scale = n / std::sqrt(cn);
}

// Centroid values of one packed row, in dimension order.
inline void unpack_row(const uint8_t* codes, const float* cents, int64_t D, float* out) {
  const int64_t h = D / 2;
#if defined(__AVX512F__)
  if (h % 16 == 0) {
    const __m512 table = _mm512_loadu_ps(cents);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t c = 0; c < h; c += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, low));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low));
      _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(lo, table));
      _mm512_storeu_ps(out + h + c, _mm512_permutexvar_ps(hi, table));
    }
    return;
  }
#endif
  for (int64_t c = 0; c < h; ++c) {
    out[c] = cents[codes[c] & 0xF];
    out[c + h] = cents[codes[c] >> 4];
  }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The 16-entry centroid table on AVX2: vpermps looks up 8 entries by the low 3 bits of each index, and
// bit 3 (shifted into the sign bit, which is all blendv reads) picks the upper half. Index bits above
// bit 3 are ignored, so a low nibble needs no mask.
struct Table16 {
  __m256 lo, hi;
  explicit Table16(const float* cents) : lo(_mm256_loadu_ps(cents)), hi(_mm256_loadu_ps(cents + 8)) {}
  __m256 operator()(__m256i idx) const {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
};

// The table again as four byte planes, for decoding 32 nibbles at a time (vpshufb looks up 32 bytes per
// instruction and the unpacks that reassemble the fp32 words are cheap; two vpermps and a blend per 8 values
// were most of a decode step's uops). The values are the table's bit patterns, so exact. idx: 32 bytes in
// 0..15; out[v] holds the entries of bytes {4v..4v+3} of each 128-bit lane, i.e. out[0] = {0..3, 16..19},
// out[1] = {4..7, 20..23}, out[2] = {8..11, 24..27}, out[3] = {12..15, 28..31}.
struct Planes16 {
  __m256i b0, b1, b2, b3;
  explicit Planes16(const float* cents) {
    alignas(32) uint8_t b[4][32];
    for (int e = 0; e < 16; ++e) {
      uint32_t u;
      std::memcpy(&u, cents + e, sizeof(u));
      for (int k = 0; k < 4; ++k) b[k][e] = b[k][e + 16] = static_cast<uint8_t>(u >> (8 * k));
    }
    b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b[0]));
    b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b[1]));
    b2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b[2]));
    b3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b[3]));
  }
  void operator()(__m256i idx, __m256* out) const {
    const __m256i p0 = _mm256_shuffle_epi8(b0, idx), p1 = _mm256_shuffle_epi8(b1, idx);
    const __m256i p2 = _mm256_shuffle_epi8(b2, idx), p3 = _mm256_shuffle_epi8(b3, idx);
    const __m256i l01 = _mm256_unpacklo_epi8(p0, p1), l23 = _mm256_unpacklo_epi8(p2, p3);
    const __m256i h01 = _mm256_unpackhi_epi8(p0, p1), h23 = _mm256_unpackhi_epi8(p2, p3);
    out[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l01, l23));
    out[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l01, l23));
    out[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(h01, h23));
    out[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(h01, h23));
  }
};

// 8 code bytes as int32 lanes.
inline __m256i load8_codes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// score_tile for a whole 32-key block and NT <= 2 rows (decode steps): the block's 32 code bytes of
// dim c decode with one Planes16 call per nibble; keys land in the lanes Planes16 gives and are put back
// in order at the end. 8 accumulators also hide the two dependent FMAs per dim that bound the 16-key tile
// at 2 rows. Same FMA chain per key as score_tile.
template <int NT>
inline void score_codes_tile32(const RowBlock& rb, int r0, const uint8_t* kb, const float* ks, int64_t D,
                               const Planes16& table, const uint8_t* ahead, float (*out)[kMaxKW]) {
  const int64_t h = D / 2;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[NT][4];
#pragma GCC unroll 2
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t c = 0; c < h; ++c) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + c * 32));
    if (ahead && c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + c * 32), _MM_HINT_T0);
    __m256 k[4];
    table(_mm256_and_si256(b, low), k);
#pragma GCC unroll 2
    for (int i = 0; i < NT; ++i) {
      const __m256 ql = _mm256_set1_ps(rb.q[r0 + i][c]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(ql, k[v], acc[i][v]);
    }
    table(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), k);
#pragma GCC unroll 2
    for (int i = 0; i < NT; ++i) {
      const __m256 qh = _mm256_set1_ps(rb.q[r0 + i][c + h]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(qh, k[v], acc[i][v]);
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < NT; ++i) {
    const __m256 keys[4] = {_mm256_permute2f128_ps(acc[i][0], acc[i][1], 0x20),   // keys 0..7
                            _mm256_permute2f128_ps(acc[i][2], acc[i][3], 0x20),   // 8..15
                            _mm256_permute2f128_ps(acc[i][0], acc[i][1], 0x31),   // 16..23
                            _mm256_permute2f128_ps(acc[i][2], acc[i][3], 0x31)};  // 24..31
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out[i] + 8 * v, _mm256_mul_ps(keys[v], _mm256_loadu_ps(ks + 8 * v)));
  }
}

// Few rows (a decode step: one position x its GQA group) against a 32-key block: tiles of 2 rows.
// ahead: a block to prefetch meanwhile (the same block of the next page), one line per two dims.
inline void score_codes_few(const RowBlock& rb, int r0, int nr, const uint8_t* kb, const float* ks, int64_t D,
                            const Planes16& planes, const uint8_t* ahead, float (*out)[kMaxKW]) {
  int t = 0;
  for (; t + 2 <= nr; t += 2, ahead = nullptr) score_codes_tile32<2>(rb, r0 + t, kb, ks, D, planes, ahead, out + t);
  if (t < nr) score_codes_tile32<1>(rb, r0 + t, kb, ks, D, planes, ahead, out + t);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Prefill on AVX2: decoding a key block costs more uops than the FMAs of 3 rows, so an item of many rows
// decodes each block once into fp32 ([D/2][2][KW]: dim c then dim c + D/2, the order the code tile walks)
// and scores it with a 4-row tile. Same values (table lookups are exact), same FMA chain per lane as
// score_tile: a row's scores do not depend on which path its block took.
inline void decode_key_block(const uint8_t* kb, int64_t KW, int64_t D, const Table16& table, float* out) {
  for (int64_t c = 0; c < D / 2; ++c)
    for (int64_t l = 0; l < KW; l += 8) {
      const __m256i x = load8_codes(kb + c * KW + l);
      _mm256_storeu_ps(out + 2 * c * KW + l, table(x));
      _mm256_storeu_ps(out + (2 * c + 1) * KW + l, table(_mm256_srli_epi32(x, 4)));
    }
}

template <int NT>
inline void score_decoded_tile8(const RowBlock& rb, int r0, const float* kd, const float* ks, int64_t KW, int64_t D,
                                float (*out)[kMaxKW], int k0) {
  const int64_t h = D / 2;
  __m256 acc[NT][2];
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < h; ++c) {
    // every accumulator: fma(q[c], k[c]) then fma(q[c + h], k[c + h]), as in the code tile; the low dims of
    // all rows first, so that two key vectors are live at a time and stay in registers
    const float* lo = kd + 2 * c * KW + k0;
    __m256 klo0 = _mm256_loadu_ps(lo), klo1 = _mm256_loadu_ps(lo + 8);
    __asm__("" : "+x"(klo0), "+x"(klo1));   // loaded once: GCC would fold a load into every FMA
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) {
      const __m256 ql = _mm256_set1_ps(rb.q[r0 + i][c]);
      acc[i][0] = _mm256_fmadd_ps(ql, klo0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ql, klo1, acc[i][1]);
    }
    __m256 khi0 = _mm256_loadu_ps(lo + KW), khi1 = _mm256_loadu_ps(lo + KW + 8);
    __asm__("" : "+x"(khi0), "+x"(khi1));
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) {
      const __m256 qh = _mm256_set1_ps(rb.q[r0 + i][c + h]);
      acc[i][0] = _mm256_fmadd_ps(qh, khi0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(qh, khi1, acc[i][1]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out[i] + k0 + 8 * v, _mm256_mul_ps(acc[i][v], _mm256_loadu_ps(ks + 8 * v)));
}

inline void score_decoded_rows(const RowBlock& rb, int r0, int nr, const float* kd, const float* ks, int64_t KW,
                               int64_t D, float (*out)[kMaxKW]) {
  for (int k0 = 0; k0 < KW; k0 += 16) {
    int t = 0;
    for (; t + 4 <= nr; t += 4) score_decoded_tile8<4>(rb, r0 + t, kd, ks + k0, KW, D, out + t, k0);
    switch (nr - t) {
      case 3: score_decoded_tile8<3>(rb, r0 + t, kd, ks + k0, KW, D, out + t, k0); break;
      case 2: score_decoded_tile8<2>(rb, r0 + t, kd, ks + k0, KW, D, out + t, k0); break;
      case 1: score_decoded_tile8<1>(rb, r0 + t, kd, ks + k0, KW, D, out + t, k0); break;
      default: break;
    }
  }
}

// The value rows of a page ([S][D/2] codes) as fp32 rows in dimension order, for the same reason.
inline void decode_value_page(const uint8_t* codes, int64_t rows, int64_t D, const Table16& table, float* out) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t c = 0; c < h; c += 8) {
      const __m256i x = load8_codes(codes + j * h + c);
      _mm256_storeu_ps(out + j * D + c, table(x));
      _mm256_storeu_ps(out + j * D + h + c, table(_mm256_srli_epi32(x, 4)));
    }
}

// Per-thread buffers of the decoded path; key_block names the block that k holds, reset per item (a
// cache page's contents change between calls).
struct DecodeScratch {
  const uint8_t* key_block = nullptr;
  std::vector<float> k, v;
};
#endif

// The 16 centroids as a lookup of V's lanes: at(p, lo, hi) reads the code bytes of V::kLanes consecutive keys at p
// and gives the centroids of their low nibbles (dim c) and high nibbles (dim c + D/2). Table lookups are exact.
template <class V> struct CodeTable;
#if defined(__AVX512F__)
template <> struct CodeTable<F32x16> {
  __m512 table;
  explicit CodeTable(const float* cents) : table(_mm512_loadu_ps(cents)) {}
  void at(const uint8_t* p, __m512& lo, __m512& hi) const {   // vpermps reads only the low 4 bits: no nibble mask
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(x, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
  }
};
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
template <> struct CodeTable<F32x8> {
  Table16 table;
  explicit CodeTable(const float* cents) : table(cents) {}
  void at(const uint8_t* p, __m256& lo, __m256& hi) const {
    const __m256i x = load8_codes(p);
    lo = table(x);
    hi = table(_mm256_srli_epi32(x, 4));
  }
};
#endif
template <> struct CodeTable<F32x1> {
  const float* cents;
  explicit CodeTable(const float* c) : cents(c) {}
  void at(const uint8_t* p, float& lo, float& hi) const {
    lo = cents[*p & 0xF];
    hi = cents[*p >> 4];
  }
};

// Register tile: NT rows x NK vectors of V's lanes, keys k0.. of a key block ([D/2, KW] bytes, byte c of key j
// holding dims c (low nibble) and c + D/2 (high nibble)), times the keys' scales ks: per lane, for each c in order,
// acc += q[c] * k[c] then acc += q[c + h] * k[c + h] (two FMAs; on one lane a multiply and an add each).
template <class V, int NT, int NK, int KW>
inline void score_tile(const RowBlock& rb, int r0, const uint8_t* kb, const float* ks, int64_t D,
                       const CodeTable<V>& table, float (*out)[kMaxKW], int k0) {
  using R = typename V::reg;
  const int64_t h = D / 2;
  R acc[NT][NK];
#pragma GCC unroll 8
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NK; ++v) acc[i][v] = V::zero();
  for (int64_t c = 0; c < h; ++c) {
    R klo[NK], khi[NK];
#pragma GCC unroll 2
    for (int v = 0; v < NK; ++v) table.at(kb + c * KW + k0 + V::kLanes * v, klo[v], khi[v]);
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      const R ql = V::set1(rb.q[r0 + i][c]), qh = V::set1(rb.q[r0 + i][c + h]);
#pragma GCC unroll 2
      for (int v = 0; v < NK; ++v) acc[i][v] = V::fmadd(qh, khi[v], V::fmadd(ql, klo[v], acc[i][v]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NK; ++v)
      V::store(out[i] + k0 + V::kLanes * v, V::mul(acc[i][v], V::load(ks + k0 + V::kLanes * v)));
}

// Raw scores of one key block (KW keys) for NR rows straight from the nibble codes, in tiles of this width's
// shape: AVX-512 all NR (<= 8) rows x KW / 16 vectors; AVX2 3 rows x 16 keys (16 ymm with the table and the
// decoded keys); one lane, 1 row x the block's keys. The same chain per score whatever the tile.
template <int NR, int KW>
inline void score_codes(const RowBlock& rb, int r0, const uint8_t* kb, const float* ks, int64_t D,
                        const float* cents, float (*out)[kMaxKW]) {
  using V = VN;
  constexpr int W = V::kLanes;
  constexpr int NT = W == 16 ? NR : W == 8 ? 3 : 1;   // rows per tile
  constexpr int KT = W == 8 ? 16 : KW;                // keys per tile
  const CodeTable<V> table(cents);
  for (int k0 = 0; k0 < KW; k0 += KT) {
    for (int t = 0; t + NT <= NR; t += NT) score_tile<V, NT, KT / W, KW>(rb, r0 + t, kb, ks, D, table, out + t, k0);
    if constexpr (NR % NT != 0)
      score_tile<V, NR % NT, KT / W, KW>(rb, r0 + NR / NT * NT, kb, ks, D, table, out + NR / NT * NT, k0);
  }
}

template <int KW>
inline void score_codes_rows(const RowBlock& rb, int r0, int nr, const uint8_t* kb, const float* ks, int64_t D,
                             const float* cents, float (*out)[kMaxKW]) {
  switch (nr) {
    case 8: score_codes<8, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 7: score_codes<7, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 6: score_codes<6, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 5: score_codes<5, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 4: score_codes<4, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 3: score_codes<3, KW>(rb, r0, kb, ks, D, cents, out); break;
    case 2: score_codes<2, KW>(rb, r0, kb, ks, D, cents, out); break;
    default: score_codes<1, KW>(rb, r0, kb, ks, D, cents, out); break;
  }
}

// Value rows of one page of TurboQuant codes ([S, D/2] bytes + [S] scales). A chunk pair p covers dims
// [16p, 16p + 16) (low nibbles of bytes 16p..16p+15) and [16p + D/2, ...) (their high nibbles).
struct CodeValues {
  const uint8_t* codes;
  const float* scales;
  const float* cents;
  int64_t D;
  void fold_scales(float* w, int64_t n) const {
    for (int64_t j = 0; j < n; ++j) w[j] *= scales[j];
  }
  void row(int64_t j, float* out) const { unpack_row(codes + j * (D / 2), cents, D, out); }
#if defined(__AVX512F__)
  template <int DC>
  void full(int64_t j, __m512* v) const {
    const __m512 table = _mm512_loadu_ps(cents);
#pragma GCC unroll 8
    for (int p = 0; p < DC / 2; ++p) pair(j, p, v[p], v[p + DC / 2], table);
  }
  std::pair<int64_t, int64_t> pair_dims(int64_t p) const { return {16 * p, 16 * p + D / 2}; }
  void pair(int64_t j, int64_t p, __m512& va, __m512& vb) const { pair(j, p, va, vb, _mm512_loadu_ps(cents)); }
  void pair(int64_t j, int64_t p, __m512& va, __m512& vb, __m512 table) const {
    // vpermps reads only the low 4 bits of each index: the low nibble needs no mask
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * (D / 2) + 16 * p)));
    va = _mm512_permutexvar_ps(x, table);
    vb = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // pair p: dims [8p, 8p + 8) (low nibbles of bytes 8p..8p+7) and [8p + D/2, ...) (their high nibbles)
  std::pair<int64_t, int64_t> pair8_dims(int64_t p) const { return {8 * p, 8 * p + D / 2}; }
  const float* decoded = nullptr;   // the page's rows decoded (decode_value_page), or read from the codes
  const Planes16* planes = nullptr;
  const uint8_t* ahead = nullptr;   // the next page's codes: the first pass over a row prefetches its twin
  // Two pairs at once (accumulate8 with NP = 2): the 16 code bytes of dims [8p0, 8p0 + 16) decode in one
  // Planes16 call, low nibbles in the lower 128-bit lane and high nibbles in the upper, so vector k holds dims
  // 8p0 + 4k.. (low half) and 8p0 + D/2 + 4k.. (high half), the halves quad_dims names.
  static constexpr bool kQuads = true;
  void quad_dims(int64_t p0, int64_t* lo, int64_t* hi) const {
    for (int k = 0; k < 4; ++k) {
      lo[k] = 8 * p0 + 4 * k;
      hi[k] = lo[k] + D / 2;
    }
  }
  void quad(int64_t j, int64_t p0, __m256* v) const {
    if (decoded) {
      const float* row = decoded + j * D + 8 * p0;
      for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu2_m128(row + D / 2 + 4 * k, row + 4 * k);
      return;
    }
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * (D / 2) + 8 * p0));
    if (p0 == 0 && ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * (D / 2)), _MM_HINT_T0);
    const __m128i low = _mm_set1_epi8(0x0F);
    (*planes)(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), low), _mm_and_si128(x, low)), v);
  }
  void pair8(int64_t j, int64_t p, __m256& va, __m256& vb) const {
    if (decoded) {
      va = _mm256_loadu_ps(decoded + j * D + 8 * p);
      vb = _mm256_loadu_ps(decoded + j * D + 8 * p + D / 2);
      return;
    }
    const Table16 table(cents);
    const __m256i x = load8_codes(codes + j * (D / 2) + 8 * p);
    va = table(x);
    vb = table(_mm256_srli_epi32(x, 4));
  }
#endif
};

void check_codebook(const at::Tensor& R, const at::Tensor& cents, int64_t D) {
  TORCH_CHECK(R.scalar_type() == at::kFloat && R.is_contiguous() && R.size(0) == D && R.size(1) == D,
              "rotation must be a contiguous fp32 [d, d] matrix");
  TORCH_CHECK(cents.scalar_type() == at::kFloat && cents.numel() == 16, "centroids must be 16 fp32 values");
  TORCH_CHECK(D % 2 == 0 && D <= kMaxD, "head_dim must be even and <= ", kMaxD);
}

}  // namespace

// Encodes K and V rows [T, KVH, D] into their pages: K codes transposed [pages, KVH, D/2, S], V codes
// [pages, KVH, S, D/2], one fp32 scale per row.
void tq_write(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_codes, at::Tensor& k_scales,
              at::Tensor& v_codes, at::Tensor& v_scales, const at::Tensor& slot_mapping_in, const at::Tensor& R,
              const at::Tensor& cents_in, const at::Tensor& bounds_in) {
  check_float_dtype(k_in, "k");
  TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type(), "k and v dtypes differ");
  auto k = k_in.contiguous();
  auto v = v_in.contiguous();
  auto slots = slot_mapping_in.to(at::kLong).contiguous();
  auto cents = cents_in.contiguous();
  auto bounds = bounds_in.contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), hd = D / 2;
  check_codebook(R, cents, D);
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && k_codes.is_contiguous() && k_codes.dim() == 5 &&
                  k_codes.size(3) == hd && v_codes.is_contiguous() && v_codes.size(3) == hd,
              "codes must be contiguous uint8: K [pages, KVH, S/KW, D/2, KW], V [pages, KVH, S, D/2]");
  const int64_t KW = k_codes.size(4), S = k_codes.size(2) * KW;
  const int64_t* sp = slots.data_ptr<int64_t>();
  uint8_t* kcp = k_codes.data_ptr<uint8_t>();
  uint8_t* vcp = v_codes.data_ptr<uint8_t>();
  QK_DISPATCH_FLOAT(k.scalar_type(), "tq_write", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, T * KVH, 8, [&](int64_t i0, int64_t i1) {
      uint8_t row[kMaxD / 2];
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t t = it / KVH, g = it % KVH;
        const int64_t page = sp[t] / S, off = sp[t] % S;
        const int64_t slot = (page * KVH + g) * S + off;
        encode_row(kp + it * D, R.data_ptr<float>(), cents.data_ptr<float>(), bounds.data_ptr<float>(), D, row,
                   k_scales.data_ptr<float>() + slot);
        uint8_t* kb = kcp + ((page * KVH + g) * S + (off / KW) * KW) * hd;   // the key's block [D/2, KW]
        for (int64_t c = 0; c < hd; ++c) kb[c * KW + off % KW] = row[c];
        encode_row(vp + it * D, R.data_ptr<float>(), cents.data_ptr<float>(), bounds.data_ptr<float>(), D,
                   vcp + slot * hd, v_scales.data_ptr<float>() + slot);
      }
    });
  });
}

at::Tensor tq_paged_attention(const at::Tensor& q_in, const at::Tensor& k_codes, const at::Tensor& k_scales,
                              const at::Tensor& v_codes, const at::Tensor& v_scales, const at::Tensor& block_tables_in,
                              const at::Tensor& query_start_loc_in, const at::Tensor& seq_lens_in, const at::Tensor& R,
                              const at::Tensor& cents_in, double scale) {
  check_float_dtype(q_in, "q");
  PagedBatch b(q_in, block_tables_in, query_start_loc_in, seq_lens_in);
  auto cents = cents_in.contiguous();
  const int64_t H = b.H, D = b.D, hd = D / 2;
  const int64_t KVH = k_codes.size(1), KW = k_codes.size(4), S = k_codes.size(2) * KW;
  check_codebook(R, cents, D);
  TORCH_CHECK(KW == key_block_width(S), "k_codes key blocks do not match the page size");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxRows, "unsupported GQA group size");
  auto out = b.plan(KVH);
  if (b.T == 0) return out;
  const int G = b.G;
  const int32_t* qs = b.qsl();
  const int32_t* ls = b.lens();
  const auto& items = b.items;
  const int64_t max_pages = b.max_pages;
  const float* Rp = R.data_ptr<float>();
  const auto RT = R.t().contiguous();
  const float* RTp = RT.data_ptr<float>();
  const float* cp = cents.data_ptr<float>();
  const uint8_t* kcp = k_codes.data_ptr<uint8_t>();
  const uint8_t* vcp = v_codes.data_ptr<uint8_t>();
  const float* ksp = k_scales.data_ptr<float>();
  const float* vsp = v_scales.data_ptr<float>();
  const float sm = static_cast<float>(scale);
  QK_DISPATCH_FLOAT(b.q.scalar_type(), "tq_paged_attention", [&] {
    const scalar_t* qp = b.q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_each_item(static_cast<int64_t>(items.size()), [&](int64_t it, RowBlock& rb) {
      const WorkItem& w = items[it];
      load_rows(rb, w, qs, ls, G, H, D, qp,   // rotate each query once
                [&](const float* src, float* dst, int64_t n) { rotate_row(src, Rp, n, dst); });
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
      // many rows (prefill): decode each key block and value page once for the item, not once per tile
      const bool decode_once = rb.n >= 4 && D % 16 == 0;
      static thread_local DecodeScratch scratch;
      scratch.key_block = nullptr;
      const Table16 table(cp);
      const Planes16 planes(cp);
#endif
      int64_t next_page = -1;   // the page after the one being read (attend_rows' ahead), to prefetch
      auto score = [&](int64_t page, int64_t block, int r0, int nr, float (*o)[kMaxKW]) {
        const int64_t slot = (page * KVH + w.kv_head) * S + block * KW;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if (decode_once) {
          const uint8_t* kb = kcp + slot * hd;
          if (scratch.key_block != kb) {
            scratch.k.resize(static_cast<size_t>(D) * KW);
            decode_key_block(kb, KW, D, table, scratch.k.data());
            scratch.key_block = kb;
          }
          score_decoded_rows(rb, r0, nr, scratch.k.data(), ksp + slot, KW, D, o);
          return;
        }
        if (KW == 32) {   // a decode step: prefetch the same block of the next page as this one is read
          const int64_t ahead = next_page < 0 ? slot : (next_page * KVH + w.kv_head) * S + block * KW;
          score_codes_few(rb, r0, nr, kcp + slot * hd, ksp + slot, D, planes, kcp + ahead * hd, o);
          return;
        }
#endif
        if (KW == 32) score_codes_rows<32>(rb, r0, nr, kcp + slot * hd, ksp + slot, D, cp, o);
        else score_codes_rows<16>(rb, r0, nr, kcp + slot * hd, ksp + slot, D, cp, o);
      };
      auto values = [&](int64_t page) {
        const int64_t slot = (page * KVH + w.kv_head) * S;
        CodeValues values{vcp + slot * hd, vsp + slot, cp, D};
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        values.planes = &planes;
        values.ahead = next_page < 0 ? values.codes : vcp + (next_page * KVH + w.kv_head) * S * hd;
        if (decode_once) {
          scratch.v.resize(static_cast<size_t>(S) * D);
          decode_value_page(values.codes, S, D, table, scratch.v.data());
          values.decoded = scratch.v.data();
        }
#endif
        return values;
      };
      attend_rows(rb, b.tables() + w.seq * max_pages, S, D, sm, score, values,
                  [&](int64_t page) { next_page = page; });
      store_rows(rb, w, G, H, D, op,   // de-rotate once per head and step
                 [&](const float* src, float* dst, int64_t n) { unrotate_row(src, RTp, n, dst); });
    });
  });
  return out;
}

}  // namespace qk
