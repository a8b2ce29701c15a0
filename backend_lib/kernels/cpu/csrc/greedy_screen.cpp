// The candidate pass of the screened greedy head (layers/greedy_head.py has the bound and why it holds): for each
// row b of the int8 product A [B, N], with B_n = sx_b C_n + l2_b D_n + coef |A_n| + eps_b (the row's terms already
// carry the margin for these fp32 roundings), the ids n with A_n + B_n >= L_b = max_n (A_n - B_n), ascending.
// One vector pass computes L_b and A_n + B_n (kept in a row buffer), a scalar pass collects the ids: ~0.1 ms for
// the 151,936 logits of Qwen3's head, where the same formula as separate torch ops made ~8 passes and as many
// temporaries (~1.5 ms a step on the 2-core AVX2 VM). A row whose A holds a non-finite value, whose L_b is not
// finite, or with more than `limit` candidates gets count -1: the caller computes the whole product instead.
#include "ops.h"
#include "vec.h"

#include <limits>
#include <memory>
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
  std::vector<std::vector<int64_t>> found(B);
  std::vector<int64_t> counts(B, -1);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    // every entry is written before the id pass reads it: no zero fill (600 KB a row for Qwen3's head)
    std::unique_ptr<float[]> hi(new float[N]);
    for (int64_t b = b0; b < b1; ++b) {
      const float* ar = ap + b * N;
      const float sx = tp[3 * b], l2 = tp[3 * b + 1], eps = tp[3 * b + 2];
      using V = VN;
      using R = typename V::reg;
      const R vsx = V::set1(sx), vl2 = V::set1(l2), vk = V::set1(k), veps = V::set1(eps);
      R lo = V::set1(-std::numeric_limits<float>::infinity()), nan = V::zero();
      int64_t n = 0;
      for (; n + V::kLanes <= N; n += V::kLanes) {
        const R av = V::load(ar + n);
        const R bnd = V::fmadd(vsx, V::load(cp + n), V::fmadd(vl2, V::load(dp + n), V::fmadd(vk, V::abs(av), veps)));
        nan = V::add(nan, V::mul(av, V::zero()));       // NaN once any A_n is an infinity or a NaN
        lo = V::max(lo, V::sub(av, bnd));
        V::store(hi.get() + n, V::add(av, bnd));
      }
      float L = V::reduce_max(lo), bad = V::reduce_add(nan);
      for (; n < N; ++n) {
        const float av = ar[n], bnd = sx * cp[n] + (l2 * dp[n] + (k * std::fabs(av) + eps));
        bad += av * 0.f;
        L = std::max(L, av - bnd);
        hi[n] = av + bnd;
      }
      if (!std::isfinite(L) || bad != 0.f) continue;   // NaN != 0: the row is left at -1
      auto& ids = found[b];
      for (int64_t m = 0; m < N; ++m)
        if (hi[m] >= L) {
          if (static_cast<int64_t>(ids.size()) == limit) { ids.clear(); break; }
          ids.push_back(m);
        }
      if (!ids.empty()) counts[b] = static_cast<int64_t>(ids.size());
    }
  });
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += std::max<int64_t>(counts[b], 0);
  auto out = at::empty({total}, a.options().dtype(at::kLong));
  auto cnt = at::empty({B}, a.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  int64_t* cq = cnt.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    cq[b] = counts[b];
    if (counts[b] > 0) op = std::copy(found[b].begin(), found[b].end(), op);
  }
  return {out, cnt};
}

}  // namespace qk
