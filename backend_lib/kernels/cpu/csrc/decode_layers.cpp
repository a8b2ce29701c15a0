// The decoder's layer loop in C++: every layer of a Qwen3 step (A8W8 linears, dense paged KV cache) with no
// return to Python between the kernels.
//
// It calls the very kernel functions the Python layers call (models/qwen3.py, layers/attention.py,
// layers/mlp.py), with the same arguments in the same order, so its hidden states are bit-identical to
// the Python path's whatever the batch; what it removes is the interpreter between them (module calls,
// the kernel set's lambdas, tensor views and argument parsing: ~1 ms of a ~20 ms batch-1 step), and
// since the kernels now follow each other without a gap, the OpenMP team is still spinning when the
// next parallel region starts.
#include "ops.h"

#include <vector>

namespace qk {

// Tensors of one layer in `layers`, kPerLayer each, in this order.
enum LayerTensor : int64_t {
  kInputNorm, kPostNorm, kQNorm, kKNorm,
  kQkvPacked, kQkvScale, kQkvColsum,
  kOPacked, kOScale, kOColsum,
  kGateUpPacked, kGateUpScale, kGateUpColsum,
  kDownPacked, kDownScale, kDownColsum,
  kPerLayer
};

// x [T, hidden] (the step's embedded tokens) -> the final-normed hidden states [T, hidden], as
// Qwen3ForCausalLM.forward computes them; writes the step's K/V rows into k_caches / v_caches (one per layer).
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList layers, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& positions, const at::Tensor& cos_sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& final_norm,
                         int64_t H, int64_t KVH, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L * kPerLayer && static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: ", kPerLayer, " tensors and one K and V cache per layer expected");
  TORCH_CHECK(x_in.dim() == 2, "decode_layers: x must be [T, hidden]");
  const int64_t T = x_in.size(0);
  at::Tensor x = x_in, residual;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + l * kPerLayer;
    at::Tensor h;
    if (l == 0) {   // Qwen3DecoderLayer.forward with residual None
      residual = x;
      h = rms_norm(x, w[kInputNorm], eps);
    } else {
      std::tie(h, residual) = add_rms_norm(x, residual, w[kInputNorm], eps);
    }
    // Qwen3Attention.forward
    at::Tensor q, k, v;
    std::tie(q, k, v) = qk_norm_rope(a8w8_linear(h, w[kQkvPacked], w[kQkvScale], w[kQkvColsum]), w[kQNorm],
                                     w[kKNorm], positions, cos_sin, H, KVH, eps);
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    write_kv(k, v, kc, vc, slot_mapping);
    at::Tensor o = paged_attention(q, kc, vc, block_tables, query_start_loc, seq_lens, scale);
    h = a8w8_linear(o.reshape({T, H * o.size(2)}), w[kOPacked], w[kOScale], w[kOColsum]);
    std::tie(h, residual) = add_rms_norm(h, residual, w[kPostNorm], eps);
    // Qwen3MLP.forward
    x = a8w8_linear(silu_mul(a8w8_linear(h, w[kGateUpPacked], w[kGateUpScale], w[kGateUpColsum])), w[kDownPacked],
                    w[kDownScale], w[kDownColsum]);
  }
  return std::get<0>(add_rms_norm(x, residual, final_norm, eps));
}

}  // namespace qk
