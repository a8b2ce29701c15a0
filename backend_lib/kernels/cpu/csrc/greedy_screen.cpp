// The candidate pass of the screened greedy head (layers/greedy_head.py has the bound and why it holds): for each
// row b of the int8 product A [B, N], with B_n = sx_b C_n + l2_b D_n + coef |A_n| + eps_b (the row's terms already
// carry the margin for these fp32 roundings), the ids n with A_n + B_n >= L_b = max_n (A_n - B_n), ascending.
// One vector pass computes L_b and A_n + B_n (kept in a row buffer), a scalar pass collects the ids, both over
// chunks of the row on the intra-op threads: ~0.1 ms for the 151,936 logits of Qwen3's head, where the same formula
// as separate torch ops made ~8 passes and as many temporaries (~1.5 ms a step on the 2-core AVX2 VM). A row whose A holds a non-finite value, whose L_b is not
// finite, or with more than `limit` candidates gets count -1: the caller computes the whole product instead.
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace qk {

std::tuple<at::Tensor, at::Tensor> greedy_screen(const at::Tensor& a_in, const at::Tensor& c_in,
                                                 const at::Tensor& d_in, const at::Tensor& terms_in, double coef,
                                                 int64_t limit) {
  TORCH_CHECK(a_in.dim() == 2 && a_in.scalar_type() == at::kFloat, "greedy_screen: a must be fp32 [B, N]");
  const int64_t B = a_in.size(0), N = a_in.size(1);
  TORCH_CHECK(c_in.numel() == N && d_in.numel() == N && c_in.scalar_type() == at::kFloat &&
                  d_in.scalar_type() == at::kFloat, "greedy_screen: c and d must be fp32 [N]");
  TORCH_CHECK(terms_in.dim() == 2 && terms_in.size(0) == B && terms_in.size(1) == 3 &&
                  terms_in.scalar_type() == at::kFloat, "greedy_screen: terms must be fp32 [B, 3]");
  auto a = a_in.contiguous(), c = c_in.contiguous(), d = d_in.contiguous(), terms = terms_in.contiguous();
  const float* ap = a.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* tp = terms.data_ptr<float>();
  const float k = static_cast<float>(coef);
  // Work in chunks of a row's N (a batch-1 step's one row is split over the threads too): pass 1 writes A_n + B_n
  // into a row buffer and each chunk's max of A_n - B_n and its non-finite check; L_b is the max over the row's
  // chunks (a max: the same value in any split); pass 2 collects each chunk's ids, which concatenate in chunk order,
  // ascending. Up to kKeep floats the buffer is the calling thread's, kept between calls (600 KB a row for Qwen3's
  // head: a fresh allocation of it is mapped and faulted in at every call); a larger batch's is its own.
  constexpr int64_t kChunk = 16384, kKeep = int64_t{1} << 20;
  const int64_t NC = std::max<int64_t>(1, (N + kChunk - 1) / kChunk);
  static thread_local std::vector<float> kept;
  std::vector<float> own;
  std::vector<float>& buf = B * N <= kKeep ? kept : own;
  if (static_cast<int64_t>(buf.size()) < B * N) buf.resize(static_cast<size_t>(B * N));
  float* hi = buf.data();
  std::vector<float> lo_of(static_cast<size_t>(B * NC)), bad_of(static_cast<size_t>(B * NC));
  at::parallel_for(0, B * NC, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / NC, n0 = (t % NC) * kChunk, n1 = std::min(N, n0 + kChunk);
      const float* ar = ap + b * N;
      float* hr = hi + b * N;
      const float sx = tp[3 * b], l2 = tp[3 * b + 1], eps = tp[3 * b + 2];
      using V = VN;
      using R = typename V::reg;
      const R vsx = V::set1(sx), vl2 = V::set1(l2), vk = V::set1(k), veps = V::set1(eps);
      R lo = V::set1(-std::numeric_limits<float>::infinity()), nan = V::zero();
      int64_t n = n0;
      for (; n + V::kLanes <= n1; n += V::kLanes) {
        const R av = V::load(ar + n);
        const R bnd = V::fmadd(vsx, V::load(cp + n), V::fmadd(vl2, V::load(dp + n), V::fmadd(vk, V::abs(av), veps)));
        nan = V::add(nan, V::mul(av, V::zero()));       // NaN once any A_n is an infinity or a NaN
        lo = V::max(lo, V::sub(av, bnd));
        V::store(hr + n, V::add(av, bnd));
      }
      float L = V::reduce_max(lo), bad = V::reduce_add(nan);
      for (; n < n1; ++n) {
        const float av = ar[n], bnd = sx * cp[n] + (l2 * dp[n] + (k * std::fabs(av) + eps));
        bad += av * 0.f;
        L = std::max(L, av - bnd);
        hr[n] = av + bnd;
      }
      lo_of[t] = L;
      bad_of[t] = bad;
    }
  });
  std::vector<float> floor_of(static_cast<size_t>(B));
  std::vector<char> ok(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    float L = -std::numeric_limits<float>::infinity(), bad = 0.f;
    for (int64_t c = 0; c < NC; ++c) {
      L = std::max(L, lo_of[b * NC + c]);
      bad += bad_of[b * NC + c];
    }
    floor_of[b] = L;
    ok[b] = std::isfinite(L) && bad == 0.f;   // NaN != 0: the row is left at -1
  }
  std::vector<std::vector<int64_t>> part(static_cast<size_t>(B * NC));
  at::parallel_for(0, B * NC, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / NC, n0 = (t % NC) * kChunk, n1 = std::min(N, n0 + kChunk);
      if (!ok[b]) continue;
      const float L = floor_of[b];
      const float* hr = hi + b * N;
      auto& ids = part[t];
      for (int64_t m = n0; m < n1; ++m)
        if (hr[m] >= L) {
          if (static_cast<int64_t>(ids.size()) > limit) break;   // the row is over the limit whatever else it has
          ids.push_back(m);
        }
    }
  });
  // a row's count: its ids over its chunks, or -1 (not certified, no candidate, or more than `limit`)
  std::vector<int64_t> counts(B, -1);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (!ok[b]) continue;
    int64_t n = 0;
    for (int64_t c = 0; c < NC; ++c) n += static_cast<int64_t>(part[b * NC + c].size());
    if (n > 0 && n <= limit) {
      counts[b] = n;
      total += n;
    }
  }
  auto out = at::empty({total}, a.options().dtype(at::kLong));
  auto cnt = at::empty({B}, a.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  int64_t* cq = cnt.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    cq[b] = counts[b];
    if (counts[b] > 0)
      for (int64_t c = 0; c < NC; ++c) op = std::copy(part[b * NC + c].begin(), part[b * NC + c].end(), op);
  }
  return {out, cnt};
}

// A screened greedy head's whole pick in one call (layers/greedy_head.py, ScreenedHead.greedy_picks, composes the
// same steps from the slots; this removes the ~15 small torch ops and Python between them, ~1 ms of a batch-1 step
// on the 2-core AVX2 VM, where they run with cold caches after the layers): per row of x [B, K] the terms of the
// bound as ScreenedHead.screen_terms computes them (s_x = max|x| / 127 in fp32, then up by 2^-20; |x|_2 in fp64, up
// by 2^-30; eps; each times `margin`, rounded to fp32), the int8 product A of the screen (a8w8_linear), the
// candidates (greedy_screen), their exact logits (float_linear_rows over the rows' union, in x's dtype as the whole
// product takes it) and the first index of each row's largest. Returns (picks int64 [B], the union's size), or
// (all -1, -1) where a row cannot be certified (a non-finite x, A or candidate logit, more than `limit`
// candidates): the caller computes the whole product then, as greedy_picks does.
std::tuple<at::Tensor, int64_t> greedy_head_picks(const at::Tensor& x_in, const at::Tensor& packed8,
                                                  const at::Tensor& w_scale, const at::Tensor& colsum,
                                                  const at::Tensor& c, const at::Tensor& d, double wmax,
                                                  const at::Tensor& packed, int64_t N, double coef, double margin,
                                                  int64_t limit) {
  TORCH_CHECK(x_in.dim() == 2, "greedy_head_picks: x must be [B, K]");
  const int64_t B = x_in.size(0), K = x_in.size(1);
  auto picks = at::full({B}, -1, x_in.options().dtype(at::kLong));
  const std::tuple<at::Tensor, int64_t> refused{picks, -1};
  if (B == 0) return refused;
  auto xf = x_in.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  auto terms = at::empty({B, 3}, xf.options());
  float* tp = terms.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    float amax = 0.f;
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xp[b * K + k];
      amax = std::max(amax, std::fabs(v));   // a NaN is caught by the norm below
      ss += static_cast<double>(v) * static_cast<double>(v);
    }
    const double l2 = std::sqrt(ss) * (1 + std::ldexp(1.0, -30));
    if (!std::isfinite(l2)) return refused;
    const double sx = (amax > 0.f ? static_cast<double>(amax / 127.0f) : 0.0) * (1 + std::ldexp(1.0, -20));
    const double eps = static_cast<double>(K + 1) * std::ldexp(1.0, -125) * (1 + wmax) * (1 + static_cast<double>(amax));
    tp[3 * b] = static_cast<float>(sx * margin);
    tp[3 * b + 1] = static_cast<float>(l2 * margin);
    tp[3 * b + 2] = static_cast<float>(eps);
  }
  auto a = a8w8_linear(xf, packed8, w_scale, colsum);
  auto [ids, counts] = greedy_screen(a, c, d, terms, coef, limit);
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    if (cp[b] < 0) return refused;
  auto uni = B == 1 ? ids : std::get<0>(at::_unique2(ids, /*sorted=*/true, false, false));
  const int64_t U = uni.numel();
  if (U > limit) return refused;
  auto vals = float_linear_rows(x_in, packed, N, uni);   // [B, U] fp32, the whole product's bits
  const float* vp = vals.data_ptr<float>();
  for (int64_t i = 0; i < B * U; ++i)
    if (!std::isfinite(vp[i])) return refused;
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* up = uni.data_ptr<int64_t>();
  int64_t* pp = picks.data_ptr<int64_t>();
  for (int64_t b = 0, off = 0; b < B; off += cp[b], ++b) {
    int64_t best = -1;
    float bv = 0.f;
    for (int64_t j = off; j < off + cp[b]; ++j) {   // ascending ids: a strict > keeps the first maximum
      const int64_t u = std::lower_bound(up, up + U, ip[j]) - up;
      const float v = vp[b * U + u];
      if (best < 0 || v > bv) {
        best = ip[j];
        bv = v;
      }
    }
    pp[b] = best;
  }
  return {picks, U};
}

}  // namespace qk
