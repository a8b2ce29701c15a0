// The Qwen3-MoE router's top-k as layers/moe.py's route() computes it, bit for bit: probs = softmax(logits) in fp32,
// torch.topk(probs, k), weights / weights.sum(-1) when norm_topk_prob, the cast to the logits' dtype.
//
// route_rows computes it with no ATen op: inside the decode region each call of an op (softmax, topk, sum, div, to,
// the allocations) runs cold, its code and data evicted by the layer's weight stream, and routing through them took
// ~37-50 us a sparse layer there (most steps through at::topk: bf16 router logits tie), ~7 us now with the region's
// barrier (the 2-core Zen 4 VM; Qwen3-30B-A3B has 48 sparse layers). Its bits are ATen's:
// - the softmax is ATen's CPU kernel for a float row (_vec_softmax_lastdim: reduce_all of the maximum, map
//   (x - max).exp(), reduce_all of the sum, times 1 / sum) written with the same at::vec functions, compiled for the
//   capability ATen dispatches to at run time (its Vectorized<float> and Sleef's expf of that width, exported by
//   libtorch_cpu). This file is built for the capability its flags allow (AVX512 or AVX2) and the path applies only
//   where ATen runs that one (at::get_cpu_capability(); ATEN_CPU_CAPABILITY can lower it): otherwise route() runs
//   the ATen ops. A bfloat16 row is widened first, as softmax(dtype=float32) converts it.
// - the top-k is ATen's CPU topk written out (topk_row: the same pairs, comparator and standard algorithms, so the
//   same experts where values tie, as they do often among bfloat16 router logits);
// - the renormalizing sum of k fp32 values is ATen's order for the k it is taken for: for k in 1..4 and 8 its sum
//   over the last dimension of a [T, k] tensor is the left-to-right one, for every T (checked on both capabilities,
//   tests/test_layer_loop.py compares route_rows with route() for every such k); other k fall back;
// - the division is IEEE's, the bfloat16 cast round-to-nearest-even as Tensor.to.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define QK_ROUTE_CAPABILITY "AVX512"
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define QK_ROUTE_CAPABILITY "AVX2"
#endif

#include "route.h"

#include "ops.h"

#include <ATen/Context.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace qk {
namespace {

// torch.topk(row, k) (largest, sorted) of one fp32 row as ATen's CPU kernel computes it (TopKImpl.h's
// topk_impl_loop): the (value, index) pairs in index order, then std::partial_sort of the first k where k * 64 <= E,
// else std::nth_element at k - 1 and std::sort of the k - 1 before it, with ATen's comparator (NaN above every
// number). Where values tie, which of them come first is the standard library's algorithms' (introselect,
// introsort, heap select: libstdc++'s, unchanged for many releases; tests/test_layer_loop.py compares ties,
// all-equal rows and NaN rows with torch.topk).
void topk_row(const float* row, int64_t E, int64_t k, int64_t* ids, float* vals) {
  using Elem = std::pair<float, int64_t>;
  static thread_local std::vector<Elem> queue;
  queue.resize(E);
  for (int64_t e = 0; e < E; ++e) queue[e] = {row[e], e};
  auto above = [](const Elem& x, const Elem& y) -> bool {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= E) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), above);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), above);
    std::sort(queue.begin(), queue.begin() + k - 1, above);
  }
  for (int64_t j = 0; j < k; ++j) vals[j] = queue[j].first, ids[j] = queue[j].second;
}

// The capability of this file's at::vec code where ATen runs the same one, else "".
const std::string& vec_capability() {
#ifdef QK_ROUTE_CAPABILITY
  static const std::string cap = at::get_cpu_capability() == QK_ROUTE_CAPABILITY ? QK_ROUTE_CAPABILITY : "";
#else
  static const std::string cap;
#endif
  return cap;
}

bool sum_left_to_right(int64_t k) { return (k >= 1 && k <= 4) || k == 8; }

}  // namespace

template <typename T>
bool route_rows(const T* logits, int64_t Tn, int64_t E, int64_t k, bool norm_topk_prob, int64_t* ids, T* weights,
                float* scratch) {
#ifdef QK_ROUTE_CAPABILITY
  using Vec = at::vec::Vectorized<float>;
  if (vec_capability().empty() || k < 1 || k > E || (norm_topk_prob && !sum_left_to_right(k))) return false;
  // a row's logits, then its softmax (in place) in p; its top-k values in v
  float* p = scratch;
  float* v = scratch + E;
  for (int64_t t = 0; t < Tn; ++t) {
    const T* row = logits + t * E;
    const float* in = reinterpret_cast<const float*>(row);
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(row[e]);
      in = p;
    }
    const float mx = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, in, E);
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, p, in, E);
    float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, p, E);
    sum = 1 / sum;
    at::vec::map([sum](Vec x) { return x * Vec(sum); }, p, p, E);
    topk_row(p, E, k, ids + t * k, v);
    if (norm_topk_prob) {
      float s = v[0];
      for (int64_t j = 1; j < k; ++j) s += v[j];
      for (int64_t j = 0; j < k; ++j) v[j] = v[j] / s;
    }
    for (int64_t j = 0; j < k; ++j) weights[t * k + j] = T(v[j]);
  }
  return true;
#else
  return false;
#endif
}
template bool route_rows<float>(const float*, int64_t, int64_t, int64_t, bool, int64_t*, float*, float*);
template bool route_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, bool, int64_t*,
                                        c10::BFloat16*, float*);

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob) {
  const int64_t Tn = logits.size(0), E = logits.size(1);
  at::Tensor ids = at::empty({Tn, top_k}, logits.options().dtype(at::kLong));
  if (logits.is_contiguous() && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16)) {
    at::Tensor weights = at::empty({Tn, top_k}, logits.options());
    std::vector<float> scratch(E + top_k);
    const bool done = logits.scalar_type() == at::kFloat
        ? route_rows(logits.data_ptr<float>(), Tn, E, top_k, norm_topk_prob, ids.data_ptr<int64_t>(),
                     weights.data_ptr<float>(), scratch.data())
        : route_rows(logits.data_ptr<c10::BFloat16>(), Tn, E, top_k, norm_topk_prob, ids.data_ptr<int64_t>(),
                     weights.data_ptr<c10::BFloat16>(), scratch.data());
    if (done) return {ids, weights};
  }
  // ATen's softmax and sum themselves (the top-k topk_row's: torch.topk's answer)
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat).contiguous();
  at::Tensor weights = at::empty({Tn, top_k}, probs.options());
  for (int64_t t = 0; t < Tn; ++t)
    topk_row(probs.data_ptr<float>() + t * E, E, top_k, ids.data_ptr<int64_t>() + t * top_k,
             weights.data_ptr<float>() + t * top_k);
  const int64_t last = -1;
  if (norm_topk_prob) weights = weights / weights.sum(at::IntArrayRef(&last, 1), true);
  if (logits.scalar_type() != at::kBFloat16) return {ids, weights.to(logits.scalar_type())};
  const at::Tensor w = weights.contiguous();
  at::Tensor out = at::empty({Tn, top_k}, probs.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < Tn * top_k; ++i) dst[i] = c10::BFloat16(src[i]);
  return {ids, out};
}

// route() on router logits [T, E]: what the region and the op path compute, for the tests against layers/moe.py's
// route().
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "moe_route: logits must be float32 or bfloat16 [T, E]");
  TORCH_CHECK(top_k >= 1 && top_k <= logits.size(1), "moe_route: top_k must be in [1, ", logits.size(1), "]");
  return route(logits, top_k, norm_topk_prob);
}

// Whether route() takes route_rows for this k: the at::vec capability it runs ("AVX512", "AVX2"), or "" (ATen's
// softmax and sum).
std::string moe_route_path(int64_t top_k, bool norm_topk_prob) {
  if (norm_topk_prob && !sum_left_to_right(top_k)) return "";
  return vec_capability();
}

}  // namespace qk
