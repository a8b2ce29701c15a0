// The sampler's pass over a step of plain greedy rows (sampling/sampler.py's plain_greedy_picks) in one read of
// the logits as the head wrote them: each row's first index of its maximum (torch.argmax's and numpy's rule) and
// whether it holds a NaN or an infinity. The Python pass widened bf16 logits to fp32 and ran three numpy passes
// over them: right after the head's stream all of it runs cold, 0.23-0.35 ms of a W4A16 MoE step with the int4
// head (151,936 logits; bench.step_profile --region, the 2-core Zen 4 VM), where this reads 300 KB once.
// Exactness: bf16 -> fp32 is exact and order-preserving, so the first maximum is the same index either way; a
// row's index is not used where the row is flagged (the sampler fails that row alone). The answers are Python lists
// (int[]): each torch op the sampler runs on them after the head (tolist, nonzero) costs tens of us cold.
#include <cmath>
#include <tuple>
#include <vector>
#include "ops.h"

namespace qk {

std::tuple<std::vector<int64_t>, std::vector<int64_t>> argmax_rows(const at::Tensor& logits) {
  check_float_dtype(logits, "argmax_rows: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be [B, V] with V > 0");
  const at::Tensor x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  std::vector<int64_t> ids(B);
  std::vector<char> bad(B);
  QK_DISPATCH_FLOAT(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* row = base + b * V;
        float best = static_cast<float>(row[0]);
        int64_t arg = 0;
        bool finite = std::isfinite(best);
        for (int64_t v = 1; v < V; ++v) {
          const float f = static_cast<float>(row[v]);
          finite = finite && std::isfinite(f);
          if (f > best) best = f, arg = v;
        }
        ids[b] = arg, bad[b] = !finite;
      }
    });
  });
  std::vector<int64_t> bad_rows;
  for (int64_t b = 0; b < B; ++b)
    if (bad[b]) bad_rows.push_back(b);
  return {ids, bad_rows};
}

}  // namespace qk
