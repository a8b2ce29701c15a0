// The decoder's layer loop in C++: every layer of a Qwen3 step (A8W8, W4A16 or float (bf16 / fp32) linears, dense
// paged KV cache) with no return to Python between the kernels.
//
// Steps of a few rows per sequence (decode rows, the k + 1 rows of a speculative verification, short chunks: 1 to
// kMaxSeqRows query rows per sequence, up to kMaxFusedRows rows in all) run the whole step in ONE OpenMP
// parallel region with a workspace kept across calls: the threads stay in the region from the first layer to
// the final norm and meet at a barrier only where a result of the others is read next (after each GEMV, after
// attention). Each GEMV (qkv, o, gate_up, down) gives every thread a home: a contiguous stretch of its panels,
// read front to back as one stream; a thread done with its home takes chunks from the back of the others' (so a
// thread the host slows down holds up no one). The attention work items are handed out from a counter. The row-wise ops between them (add + RMSNorm, the activation quantization, SwiGLU) need a
// whole row; for a batch of at most kRedundantRows rows every thread computes them itself, into buffers of its
// own, instead of one thread computing them while the others wait at a barrier (the same function on the same
// inputs: the same bits in every copy); larger batches split the rows and meet at a barrier. q/k-norm, RoPE and
// the KV write of a (sequence, KV head) are done, for all the sequence's rows, by the thread that then runs that
// head's attention items for them (a row only reads its own sequence's keys, its earlier rows' of this step
// included, all written first by this thread; the page a new token is written to is never shared, prefix caching
// shares only full pages), so they need no barrier of their own. The region runs the kernels' pieces (parts.h), the very
// code of the ops, each output row, panel and work item computed by one thread in the op's order, so the hidden
// states and the KV cache are bit-identical to the ops' (and to the Python layer loop), whatever the batch and
// the thread count. A W4A16 linear's input rows are widened to fp32 (w4a16_linear's widening; a GPTQ act-order
// linear's gathered by its perm as well, as w4a16_linear gathers them) and its panels are
// w4a16_panel_range's, in pairs (the op's chunk); at batch 1 each thread takes the table lookup where the op does
// (the weight's lut_zero, w4a16_lut_row on the row it reads: every copy of the row the same bits, the same answer).
// A float linear (FloatLinear: a bf16 or fp32 checkpoint) is float_linear's panels of 64 outputs (float_panels),
// in float_linear's chunks, on its activation rows (the model dtype's; bf16 widened to fp32 where float_linear
// widens them, the AVX2 build): each output an fp32 sum in k order rounded once, whichever thread takes its panel.
//
// A Qwen3-MoE sparse layer (float, A8W8, W4A16 or W4A8 experts, act-order W4A16 ones with a perm per expert weight:
// moe_parts.h gathers each routed pair's rows by its expert's perms) stays in the region too: the router GEMV (float_linear's
// panels, one per work item), then ONE thread routes the step's logits as layers/moe.py's route() does (route.cpp:
// softmax in fp32, topk, renormalization, the cast, torch's own bits, ties included; without ATen ops where its
// route_rows applies, else through them, whose parallel_for runs serially inside the region) and plans the pairs per
// expert, while the others wait at a barrier; then the
// experts' phases of moe_parts.h (the native MoE op's code: gate_up items, SwiGLU, down items, the combine into
// the layer's output rows), a barrier after each; the token rows prepared as the MoE op prepares them for the
// experts' kind (moe::prepare: quantized, widened to fp32, or float experts' rows in moe_experts' activation
// type). Batch 1 reads the router and its k experts' weights only.
//
// Other steps (a sequence with more rows: prefill chunks; more than kMaxFusedRows rows) call the ops one after
// another as the Python layers do (models/qwen3.py, layers/attention.py, layers/mlp.py), with the same arguments
// in the same order: each op opens its own parallel region, which a many-row step amortizes.
#include <omp.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "moe_parts.h"
#include "ops.h"
#include "parts.h"
#include "route.h"

namespace qk {
namespace {

// Tensors of one layer in `layers`, kPerLayer each, in this order.
enum LayerTensor : int64_t {
  kInputNorm, kPostNorm, kQNorm, kKNorm,
  kQkvPacked, kQkvScale, kQkvColsum,
  kOPacked, kOScale, kOColsum,
  kGateUpPacked, kGateUpScale, kGateUpColsum,
  kDownPacked, kDownScale, kDownColsum,
  kQkvPerm, kOPerm, kGateUpPerm, kDownPerm,
  kLinDims,
  kPerLayer
};
// A linear's three slots hold an A8W8 weight (a8w8_pack'ed int8, w_scale, colsum), a W4A16 one (w4a16_pack'ed
// int32, scales, zeros), a W4A8 one (`int4_activations: int8`: w4a16_pack'ed int32, scales, an empty tensor) or a
// float one (float_pack'ed fp32 / bf16, two empty tensors), told apart by the packed weight's dtype (and the int32
// ones by their third slot). kQkvPerm + j: linear j's column permutation (a W4A16 weight's GPTQ act-order perm,
// int64 [K], as w4a16_linear takes it; empty: none, and for A8W8, float and a sparse layer's MLP slots). kLinDims:
// fp64 [4, 2], per linear (qkv, o, gate_up, down) its output width N and its W4A16 lut_zero (-1: none, and for
// A8W8, float and W4A8).
enum LinSlot : int64_t { kLinQkv, kLinO, kLinGateUp, kLinDown };
constexpr int64_t kLinDimsLen = 8;
// A sparse (Qwen3-MoE) layer's MLP slots hold instead: kRouterPacked the router's float_pack'ed weight (E outputs),
// kMoeTable / kMoeLut moe_experts' table and lut, kMoeDims int64 [8]: moe_experts' dims (kind, H, I, aux_gu,
// aux_dn, bf16 weights; kind float, A8W8, W4A16 or W4A8), then top_k and norm_topk_prob; kDownScale and kDownColsum are
// unused (empty tensors), and so are kGateUpPerm and kDownPerm (the experts' perms are in the table).
// kMoeDims' dtype marks the layer (int64, where a dense layer has its int8 / int32 packed down_proj).
enum SparseTensor : int64_t { kRouterPacked = kGateUpPacked, kMoeTable = kGateUpScale, kMoeLut = kGateUpColsum,
                              kMoeDims = kDownPacked };
constexpr int64_t kMoeDimsLen = 8;

bool is_sparse(const at::Tensor* w) { return w[kMoeDims].scalar_type() == at::kLong; }

// Qwen3SparseMoe.forward with the CPU set's moe slot (kernels/cpu/moe.py): the router, route(), moe_experts.
at::Tensor sparse_mlp_ops(const at::Tensor& h, const at::Tensor* w) {
  const at::Tensor dims = w[kMoeDims].contiguous();
  TORCH_CHECK(dims.numel() == kMoeDimsLen, "decode_layers: a sparse layer's dims must be int64 [", kMoeDimsLen, "]");
  const int64_t* d = dims.data_ptr<int64_t>();
  at::Tensor ids, weights;
  const at::Tensor logits = float_linear(h, w[kRouterPacked], w[kMoeTable].size(0), c10::nullopt);
  std::tie(ids, weights) = route(logits, d[6], d[7] != 0);
  return moe_experts(h, ids, weights, w[kMoeTable], w[kMoeLut], at::IntArrayRef(d, 6));
}

constexpr int64_t kMaxFusedRows = 64;   // steps of up to this many rows take the one-region path
// ... where no sequence has more query rows than this: a verification of up to 16 drafts (k + 1 rows), a decode
// row, a short chunk; a longer chunk runs the ops (whose parallel regions it amortizes).
constexpr int64_t kMaxSeqRows = 17;
constexpr int64_t kRedundantRows = 2;   // up to this many rows, every thread computes the row-wise ops itself
constexpr int kMaxThreads = 256;
constexpr int64_t kLine = 8;             // int64 counters per cache line

// Optional time accounting of the region (decode_layers_profile): per thread, seconds in each phase.
enum Phase : int {
  kPrologue, kFork, kNormIn, kQkv, kQkvWait, kRope, kKvWrite, kAttn, kAttnWait, kQuantO, kO, kOWait, kNormPost, kGateUp,
  kGateUpWait, kSilu, kDown, kDownWait, kFinal,
  // sparse layers: the router GEMV, the routing (one thread), the experts' phases (moe_parts.h), the combine
  kRouter, kRouterWait, kRoute, kGather, kExpGateUp, kExpGateUpWait, kExpSilu, kExpDown, kExpDownWait, kCombine,
  kPhases
};
struct alignas(64) ProfRow {
  double s[kPhases];
};
std::atomic<bool> g_prof_on{false};
ProfRow g_prof[kMaxThreads];
int64_t g_prof_steps = 0;
int g_prof_threads = 0;
std::mutex g_prof_mu;

struct PhaseClock {
  bool on;
  ProfRow* row;
  std::chrono::steady_clock::time_point t;
  explicit PhaseClock(bool on_, ProfRow* r, std::chrono::steady_clock::time_point t0) : on(on_), row(r), t(t0) {}
  void mark(Phase p) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    row->s[p] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

bool is_int4(const at::Tensor* w, int64_t j) { return w[kQkvPacked + 3 * j].scalar_type() == at::kInt; }
bool is_w4a8(const at::Tensor* w, int64_t j) { return is_int4(w, j) && w[kQkvPacked + 3 * j + 2].numel() == 0; }
bool is_w4a16(const at::Tensor* w, int64_t j) { return is_int4(w, j) && !is_w4a8(w, j); }
bool is_float_lin(const at::Tensor* w, int64_t j) {
  const auto dt = w[kQkvPacked + 3 * j].scalar_type();
  return dt == at::kFloat || dt == at::kBFloat16;
}

// The layer's kLinDims as the region reads them (per linear: N, lut_zero), or nullptr where they are malformed.
const double* region_lin_dims(const at::Tensor* w) {
  const at::Tensor& dims = w[kLinDims];
  if (dims.scalar_type() != at::kDouble || !dims.is_contiguous() || dims.numel() != kLinDimsLen) return nullptr;
  return dims.data_ptr<double>();
}

// Linear j of the layer (LinSlot) as its layers/linear.py class computes it: a8w8_linear, w4a16_linear, w4a8_linear
// or float_linear (FloatLinear: the output in x's dtype).
at::Tensor linear_op(const at::Tensor& x, const at::Tensor* w, int64_t j) {
  const at::Tensor* p = w + kQkvPacked + 3 * j;
  if (!is_int4(w, j) && !is_float_lin(w, j)) return a8w8_linear(x, p[0], p[1], p[2]);
  const at::Tensor dims = w[kLinDims].contiguous();
  TORCH_CHECK(dims.scalar_type() == at::kDouble && dims.numel() == kLinDimsLen,
              "decode_layers: a layer's linear dims must be float64 [4, 2]");
  const double* d = dims.data_ptr<double>();
  if (is_float_lin(w, j)) return float_linear(x, p[0], static_cast<int64_t>(d[2 * j]), c10::nullopt);
  if (is_w4a8(w, j)) return w4a8_linear(x, p[0], p[1], static_cast<int64_t>(d[2 * j]));
  return w4a16_linear(x, p[0], p[1], p[2], w[kQkvPerm + j], static_cast<int64_t>(d[2 * j]), d[2 * j + 1]);
}

// [spec] EAGLE-3's aux hidden states: out [T, n * hidden] in x's dtype, slot j the residual stream entering layer
// ids[j] (0: the embeddings, L: the last layer's output before the final norm), as Qwen3ForCausalLM.forward_aux
// captures it (x + residual there: add_rms_norm's sum, the same fp32 add and one rounding). n = 0: none.
struct AuxOut {
  at::Tensor out;
  const int64_t* ids = nullptr;
  int64_t n = 0;
  void capture(int64_t layer, const at::Tensor& rows) const {
    for (int64_t j = 0; j < n; ++j)
      if (ids[j] == layer) out.narrow(1, j * rows.size(1), rows.size(1)).copy_(rows);
  }
};

at::Tensor decode_layers_ops(const at::Tensor& x_in, at::TensorList layers, at::TensorList k_caches,
                             at::TensorList v_caches, const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& final_norm, int64_t H, int64_t KVH, double eps, double scale,
                             const AuxOut& aux) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
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
    aux.capture(l, residual);   // the residual stream entering layer l
    // Qwen3Attention.forward
    at::Tensor q, k, v;
    std::tie(q, k, v) = qk_norm_rope(linear_op(h, w, kLinQkv), w[kQNorm], w[kKNorm], positions, cos_sin, H, KVH, eps);
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    write_kv(k, v, kc, vc, slot_mapping);
    at::Tensor o = paged_attention(q, kc, vc, block_tables, query_start_loc, seq_lens, scale);
    h = linear_op(o.reshape({T, H * o.size(2)}), w, kLinO);
    std::tie(h, residual) = add_rms_norm(h, residual, w[kPostNorm], eps);
    if (is_sparse(w)) {   // Qwen3SparseMoe.forward
      x = sparse_mlp_ops(h, w);
      continue;
    }
    // Qwen3MLP.forward
    x = linear_op(silu_mul(linear_op(h, w, kLinGateUp)), w, kLinDown);
  }
  at::Tensor out;
  std::tie(out, residual) = add_rms_norm(x, residual, final_norm, eps);
  aux.capture(L, residual);   // the last layer's output before the final norm
  return out;
}

// One linear of the region: its weight and the panels a thread takes at a time (a chunk); A8W8 (kind moe::kA8W8:
// w, scale, colsum, KG, Kp), W4A16 (moe::kW4A16: w4, scale = its scales, zeros, G groups, lut_zero), W4A8
// (moe::kW4A8: w4, scale = its scales, G groups) or float (moe::kFloat: wf, float_pack'ed fp32 or bf16 (wbf16)
// panels of 64 outputs). Its input rows (xbytes each): A8W8 quantized (a8w8_quantize_row), W4A16 widened to fp32,
// as w4a16_linear does, W4A8 prepared as w4a8_linear does (w4a8_prepare_row, its scale in sc); float in
// float_linear's activation type (x_f32: fp32 rows, or bf16 rows widened where float_linear widens them; else the
// bf16 rows as they are).
struct Lin {
  int64_t kind;
  const int8_t* w;
  const int32_t* w4;
  const float* scale;
  const int32_t* colsum;
  const float* zeros;
  int64_t N, NP, KG, Kp, K, G, chunk;
  float lut;
  size_t xbytes;
  const void* wf = nullptr;
  bool wbf16 = false, x_f32 = true;
  const int64_t* perm = nullptr;   // W4A16: the act-order perm (input column k of the weight reads x[perm[k]])
};

// An int4 weight's codes and scales as w4a16_pack and the CPU set's blocked scales shape them for K inputs and N
// outputs (the checks w4a16_linear and w4a8_linear share): packed int32 [NP, K/8, 64], scales fp32 [NP, G, 64],
// both contiguous, G groups dividing K. NP and G out; false if they are not so.
bool int4_panels_ok(const at::Tensor& packed, const at::Tensor& scale, int64_t K, int64_t N, int64_t& NP, int64_t& G) {
  constexpr int64_t P = moe::kPanelRows;
  if (packed.dim() != 3 || !packed.is_contiguous() || packed.size(2) != P || scale.scalar_type() != at::kFloat ||
      !scale.is_contiguous() || scale.dim() != 3)
    return false;
  NP = packed.size(0), G = scale.size(1);
  return NP == (N + P - 1) / P && scale.size(0) == NP && scale.size(2) == P && packed.size(1) == (K + 7) / 8 &&
         G > 0 && K % G == 0;
}

// Linear j's tensors as a8w8_linear / w4a16_linear / w4a8_linear / float_linear would check them, for an input of K
// features and N outputs (x_f32: a float linear's rows are fp32, see Lin); false if the region cannot take it (the op
// path then runs, and raises its own error for a malformed weight).
bool make_lin(const at::Tensor* w, int64_t j, int64_t K, int64_t N, int nt, bool x_f32, Lin& out) {
  const at::Tensor &packed = w[kQkvPacked + 3 * j], &scale = w[kQkvPacked + 3 * j + 1],
                   &aux = w[kQkvPacked + 3 * j + 2];
  const double* dims = region_lin_dims(w);
  if (dims == nullptr || dims[2 * j] != static_cast<double>(N)) return false;
  if (!is_w4a16(w, j) && w[kQkvPerm + j].numel() != 0) return false;   // a perm only with a W4A16 weight
  if (is_float_lin(w, j)) {   // float_linear's checks; an odd K (bf16 pairs, padded by the op) takes the op path
    constexpr int64_t P = moe::kPanelRows;
    if (packed.dim() != 4 || !packed.is_contiguous() || packed.size(2) != P ||
        packed.size(1) * packed.size(3) != K || packed.size(0) != (N + P - 1) / P)
      return false;
    const int64_t NP = packed.size(0);
    out = Lin{};
    out.kind = moe::kFloat, out.N = N, out.NP = NP, out.Kp = K, out.K = K, out.lut = -1.f;
    out.chunk = std::max<int64_t>(1, NP / (8 * nt));   // float_linear's chunk (linear_impl)
    out.wf = packed.data_ptr(), out.wbf16 = packed.scalar_type() == at::kBFloat16, out.x_f32 = x_f32;
    out.xbytes = static_cast<size_t>(K) * (x_f32 ? sizeof(float) : sizeof(c10::BFloat16));
    return true;
  }
  if (is_w4a8(w, j)) {   // w4a8_linear's checks
    int64_t NP, G;
    if (!int4_panels_ok(packed, scale, K, N, NP, G) || K / G > 16384) return false;
    out = Lin{};
    out.kind = moe::kW4A8, out.w4 = packed.data_ptr<int32_t>(), out.scale = scale.data_ptr<float>();
    out.N = N, out.NP = NP, out.K = K, out.G = G, out.lut = -1.f;
    out.chunk = 2;   // w4a8_linear's chunk: panel pairs
    out.xbytes = static_cast<size_t>(parts::w4a8_row_bytes(K, G));
    return true;
  }
  if (packed.scalar_type() == at::kInt) {   // W4A16: w4a16_linear's checks, and its zeros shaped as its scales
    int64_t NP, G;
    if (!int4_panels_ok(packed, scale, K, N, NP, G) || aux.sizes() != scale.sizes() ||
        aux.scalar_type() != at::kFloat || !aux.is_contiguous())
      return false;
    const at::Tensor& perm = w[kQkvPerm + j];   // w4a16_linear's check of the perm
    if (perm.scalar_type() != at::kLong || !perm.is_contiguous() || (perm.numel() != 0 && perm.numel() != K))
      return false;
    out = {moe::kW4A16, nullptr, packed.data_ptr<int32_t>(), scale.data_ptr<float>(), nullptr, aux.data_ptr<float>(),
           N, NP, 0, 0, K, G, 2,   // w4a16_linear's chunk: panel pairs
           static_cast<float>(dims[2 * j + 1]), static_cast<size_t>(K) * sizeof(float)};
    out.perm = perm.numel() ? perm.data_ptr<int64_t>() : nullptr;
    return true;
  }
  const int64_t P = parts::a8w8_panel(), G = parts::a8w8_group();
  if (packed.scalar_type() != at::kChar || packed.dim() != 4 || !packed.is_contiguous() || packed.size(2) != P ||
      packed.size(3) != G || scale.scalar_type() != at::kFloat || !scale.is_contiguous() || scale.dim() != 1 ||
      scale.size(0) != N || aux.scalar_type() != at::kInt || !aux.is_contiguous() || aux.numel() != N)
    return false;
  const int64_t NP = packed.size(0), KG = packed.size(1), Kp = KG * G;
  if (Kp < K || Kp - K >= G || NP != (N + P - 1) / P) return false;
  out = {moe::kA8W8, packed.data_ptr<int8_t>(), nullptr, scale.data_ptr<float>(), aux.data_ptr<int32_t>(), nullptr,
         N, NP, KG, Kp, K, 0, std::max<int64_t>(1, NP / (8 * nt)),   // a8w8_linear's chunk
         -1.f, static_cast<size_t>(Kp * parts::a8w8_act_bytes())};
  return true;
}

// Row r of a linear's input (src, K values) into its form for the GEMV: xu + r * xbytes (scale sc[r], A8W8).
template <typename T>
inline void prep_row(const Lin& lin, const T* src, int64_t r, char* xu, float* sc) {
  char* dst = xu + r * lin.xbytes;
  if (lin.kind == moe::kA8W8) {
    sc[r] = parts::a8w8_quantize_row(src, lin.K, lin.Kp, dst);
    return;
  }
  if (lin.kind == moe::kW4A8) {
    sc[r] = parts::w4a8_prepare_row(src, lin.K, lin.G, dst);
    return;
  }
  if (!lin.x_f32) {   // a float linear's bf16 rows as they are
    std::memcpy(dst, src, lin.xbytes);
    return;
  }
  // W4A16 (gathered by its act-order perm, if any), and a float linear's fp32 rows (widened: exact)
  moe::widen_row(src, lin.K, lin.perm, reinterpret_cast<float*>(dst));
}

// Output panels [p0, p1) of a float linear for the Tn prepared rows xu (prep_row): float_linear's panels.
template <typename T>
void float_lin_panels(const Lin& lin, const char* xu, int64_t Tn, T* y, int64_t p0, int64_t p1) {
  auto go = [&](const auto* x) {
    using XT = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    if (lin.wbf16)
      parts::float_panels<XT, c10::BFloat16, T>(x, lin.Kp, static_cast<const c10::BFloat16*>(lin.wf), y, Tn, lin.N,
                                                p0, p1);
    else
      parts::float_panels<XT, float, T>(x, lin.Kp, static_cast<const float*>(lin.wf), y, Tn, lin.N, p0, p1);
  };
  if (lin.x_f32) go(reinterpret_cast<const float*>(xu));
  else go(reinterpret_cast<const c10::BFloat16*>(xu));
}

// A sparse layer's MLP in the region: the router (float panels of 64 outputs, as float_linear), its top-k, the
// experts (float, A8W8, W4A16 or W4A8, moe_parts.h).
struct Sparse {
  bool on = false;
  const void* router = nullptr;
  bool router_bf16 = false, norm = false;
  int64_t E = 0, router_np = 0, k = 0;
  moe::Experts ex;
};

// A sparse layer's tensors as sparse_mlp_ops' ops would take them, for hidden width hid; false if the region
// cannot take them (then the op path runs: a malformed table). xt_bytes: float experts' activation element size
// (moe_experts' XT: 4 where the rows are fp32 or float_linear widens bf16 ones, else 2).
bool make_sparse(const at::Tensor* w, int64_t hid, int64_t xt_bytes, Sparse& sp) {
  const at::Tensor &dims = w[kMoeDims], &table = w[kMoeTable], &router = w[kRouterPacked], &lut = w[kMoeLut];
  if (!dims.is_contiguous() || dims.numel() != kMoeDimsLen || table.dim() != 2 || !table.is_contiguous() ||
      table.scalar_type() != at::kLong)
    return false;
  const int64_t* d = dims.data_ptr<int64_t>();
  if (d[0] < moe::kFloat || d[0] > moe::kW4A8 || table.size(1) != 2 * moe::table_stride(d[0])) return false;
  const int64_t E = table.size(0), G = parts::a8w8_group(), I = d[2];
  if (d[1] != hid || I <= 0 || E <= 0 || d[6] < 1 || d[6] > E) return false;
  if (d[0] == moe::kFloat) {   // float_pack'ed gate_up and down per expert (fp32 or bf16: dims[5]); moe_experts' checks
    if (hid % 2 != 0 || I % 2 != 0) return false;
  } else if (d[0] == moe::kA8W8) {   // aux: the packed K groups of gate_up and down
    if (d[3] * G < hid || d[3] * G - hid >= G || d[4] * G < I || d[4] * G - I >= G) return false;
  } else if (d[0] == moe::kW4A16) {   // aux: the quantization groups; moe_experts' checks
    if (d[3] <= 0 || d[4] <= 0 || hid % d[3] != 0 || I % d[4] != 0 || hid % 2 != 0 || I % 2 != 0 ||
        lut.scalar_type() != at::kFloat || !lut.is_contiguous() || lut.numel() != 2 * E)
      return false;
  } else if (d[0] == moe::kW4A8) {   // aux: the quantization groups; moe_experts' checks
    if (d[3] <= 0 || d[4] <= 0 || hid % d[3] != 0 || I % d[4] != 0 || hid % 2 != 0 || I % 2 != 0 ||
        hid / d[3] > 16384 || I / d[4] > 16384)
      return false;
  } else {
    return false;
  }
  if (router.dim() != 4 || !router.is_contiguous() || router.size(2) != 64 ||
      (router.scalar_type() != at::kFloat && router.scalar_type() != at::kBFloat16) ||
      router.size(0) != (E + 63) / 64 || router.size(1) * router.size(3) != hid)
    return false;
  sp.on = true;
  sp.router = router.data_ptr();
  sp.router_bf16 = router.scalar_type() == at::kBFloat16;
  sp.E = E, sp.router_np = router.size(0), sp.k = d[6], sp.norm = d[7] != 0;
  const float* lp = d[0] == moe::kW4A16 ? lut.data_ptr<float>() : nullptr;
  sp.ex = moe::Experts(d[0], E, d[1], d[2], d[3], d[4], d[5] != 0, table.data_ptr<int64_t>(), table.size(1), lp,
                       xt_bytes);
  return true;
}

// Router output panel p for the M rows hn (xf: the same rows widened to fp32, where float_linear widens bf16
// activations): logits [M, E] in the model dtype, as float_linear(hn, router) computes them.
template <typename T>
void router_panel(const Sparse& sp, const T* hn, const float* xf, int64_t M, int64_t K, T* logits, int64_t p) {
  const bool wide = std::is_same_v<T, c10::BFloat16> && parts::float_linear_widens_bf16();
  if (sp.router_bf16) {
    const auto* w = static_cast<const c10::BFloat16*>(sp.router);
    if (wide) parts::float_panels<float, c10::BFloat16, T>(xf, K, w, logits, M, sp.E, p, p + 1);
    else parts::float_panels<T, c10::BFloat16, T>(hn, K, w, logits, M, sp.E, p, p + 1);
  } else {
    const auto* w = static_cast<const float*>(sp.router);
    if (wide) parts::float_panels<float, float, T>(xf, K, w, logits, M, sp.E, p, p + 1);
    else parts::float_panels<T, float, T>(hn, K, w, logits, M, sp.E, p, p + 1);
  }
}

// The routing of a step's logits [Tn, E] (route.h: route_rows, no ATen op, where it applies; else route(), the
// ATen ops of the Python layer) and its plan; one thread runs it inside the region (the ops' own parallel_for runs
// serially there). False on any failure (the caller raises after the region).
template <typename T>
bool route_plan(const Sparse& sp, T* logits, int64_t Tn, char* plan_mem, moe::Plan& plan) noexcept {
  try {
    static thread_local std::vector<int64_t> ids_buf;
    static thread_local std::vector<T> w_buf;
    static thread_local std::vector<float> scratch;
    ids_buf.resize(Tn * sp.k), w_buf.resize(Tn * sp.k), scratch.resize(sp.E + sp.k);
    plan = moe::plan_at(plan_mem, Tn, sp.k, sp.E, sizeof(T));
    if (route_rows<T>(logits, Tn, sp.E, sp.k, sp.norm, ids_buf.data(), w_buf.data(), scratch.data()))
      return moe::make_plan<T>(ids_buf.data(), w_buf.data(), plan) < 0;
    const at::ScalarType dt = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
    at::Tensor ids, weights;
    std::tie(ids, weights) = route(at::from_blob(logits, {Tn, sp.E}, at::TensorOptions().dtype(dt)), sp.k, sp.norm);
    ids = ids.contiguous(), weights = weights.contiguous();
    return moe::make_plan<T>(ids.data_ptr<int64_t>(), weights.data_ptr<T>(), plan) < 0;
  } catch (...) {
    return false;
  }
}

// The step's buffers, kept per calling thread across calls and grown when a step needs more.
struct Workspace {
  std::vector<char> bytes;
  std::unique_ptr<std::atomic<int64_t>[]> counters;
  size_t n_counters = 0;
  char* reserve(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
  }
  std::atomic<int64_t>* reserve_counters(size_t n) {   // 64-byte aligned
    if (n_counters < n + 8) {
      counters.reset(new std::atomic<int64_t>[n + 8]);
      n_counters = n + 8;
    }
    auto* c = reinterpret_cast<std::atomic<int64_t>*>((reinterpret_cast<uintptr_t>(counters.get()) + 63) & ~uintptr_t{63});
    for (size_t i = 0; i < n; ++i) c[i].store(0, std::memory_order_relaxed);
    return c;
  }
};

struct Carve {   // offsets of 64-byte aligned pieces in one block
  size_t off = 0;
  size_t take(size_t n) {
    const size_t o = off;
    off += (n + 63) & ~size_t{63};
    return o;
  }
};

// Everything the region reads, checked and resolved to pointers before it starts (nothing in it may throw).
template <typename T>
struct Step {
  int64_t L, T_, B, hid, H, KVH, D, I, Wqkv;
  float eps;
  const T* x_in;
  std::vector<const T*> in_norm, post_norm, q_norm, k_norm;
  std::vector<Lin> qkv, o, gate_up, down;
  std::vector<Sparse> sparse;
  std::vector<T*> kc, vc;
  const T* final_norm;
  const int64_t* pos;
  const int64_t* slots;
  const float* cos_sin;
  parts::AttnArgs attn;
  T* out;
  T* aux;                 // AuxOut's rows (nullptr: none), aux_n slots of hid per row
  const int64_t* aux_ids;
  int64_t aux_n;
  std::chrono::steady_clock::time_point t_entry;   // decode_layers' start (the profile's prologue)
};

template <typename T>
void run_region(const Step<T>& s, int nt, Workspace& ws) {
  const int64_t Tn = s.T_, hid = s.hid, H = s.H, KVH = s.KVH, D = s.D, I = s.I, W = s.Wqkv, HD = s.H * s.D;
  const int64_t G = H / KVH;
  // query positions per attention item, as paged_attention's make_items
  const int32_t per_item = static_cast<int32_t>(std::max<int64_t>(1, parts::attention_item_rows() / G));
  int64_t logits_n = 0;
  size_t xrow_max = 0;   // the largest prepared input row (bytes): a GEMV's or the experts'
  size_t plan_max = 0, moe_max = 0;
  bool any_sparse = false;
  for (int64_t l = 0; l < s.L; ++l) {
    xrow_max = std::max({xrow_max, s.qkv[l].xbytes, s.o[l].xbytes, s.gate_up[l].xbytes, s.down[l].xbytes});
    const Sparse& sp = s.sparse[l];
    if (!sp.on) continue;
    any_sparse = true;
    xrow_max = std::max(xrow_max, static_cast<size_t>(sp.ex.rb_h));
    logits_n = std::max(logits_n, Tn * sp.E);
    plan_max = std::max(plan_max, moe::plan_bytes(Tn, sp.k, sp.E, sizeof(T)));
    moe_max = std::max(moe_max, moe::bufs_bytes(sp.ex, Tn, Tn * sp.k, sizeof(T), false));
  }
  const bool redundant = Tn <= kRedundantRows;
  // Shared buffers, then one set per thread (each thread's on cache lines of its own).
  Carve c;
  const size_t o_qkv = c.take(Tn * W * sizeof(T)), o_q = c.take(Tn * HD * sizeof(T)),
               o_att = c.take(Tn * HD * sizeof(T)), o_y = c.take(Tn * hid * sizeof(T)),
               o_gu = c.take(Tn * 2 * I * sizeof(T)), o_x = c.take(Tn * hid * sizeof(T)),
               o_logits = c.take(logits_n * sizeof(T)), o_plan = c.take(plan_max), o_moe = c.take(moe_max);
  Carve per;
  const size_t p_res = per.take(Tn * hid * sizeof(T)), p_hn = per.take(Tn * std::max(hid, HD) * sizeof(T)),
               p_act = per.take(Tn * I * sizeof(T)), p_xu = per.take(Tn * xrow_max),
               p_sc = per.take(Tn * sizeof(float)), p_k = per.take(D * sizeof(T)),
               p_xf = per.take(any_sparse ? Tn * hid * sizeof(float) : 0);
  const size_t shared_bytes = c.off, per_bytes = per.off;
  const int sets = redundant ? nt : 1;   // row-split steps use set 0 as the shared one
  char* base = ws.reserve(shared_bytes + per_bytes * std::max(sets, nt));
  // Counters, each on a cache line of its own: per layer the attention items' counter, then per layer, GEMV and
  // thread that thread's home chunks (common.h take_homes: one contiguous stretch of the weight per thread, then
  // the others' from their backs). Sparse layers: 2 counters each (router panels, combine items) after the homes,
  // then per thread its home of the gate_up items and of the down items (set by the thread that routes, once the
  // items are known).
  std::atomic<int64_t>* items_ctr =
      ws.reserve_counters(static_cast<size_t>(s.L * (1 + 4 * nt + 2 + 2 * nt) * kLine));
  std::atomic<int64_t>* homes = items_ctr + s.L * kLine;
  std::atomic<int64_t>* moe_ctr = homes + s.L * 4 * nt * kLine;
  std::atomic<int64_t>* moe_homes = moe_ctr + s.L * 2 * kLine;
  for (int64_t l = 0; l < s.L; ++l) {
    const Lin* lins[4] = {&s.qkv[l], &s.o[l], &s.gate_up[l], &s.down[l]};
    for (int j = 0; j < 4; ++j) {
      const int64_t chunks = (lins[j]->NP + lins[j]->chunk - 1) / lins[j]->chunk;
      for (int t = 0; t < nt; ++t)
        homes[((l * 4 + j) * nt + t) * kLine].store(home_of(chunks, t, nt), std::memory_order_relaxed);
    }
  }
  T* qkv = reinterpret_cast<T*>(base + o_qkv);
  T* qb = reinterpret_cast<T*>(base + o_q);
  T* att = reinterpret_cast<T*>(base + o_att);
  T* yb = reinterpret_cast<T*>(base + o_y);
  T* gu = reinterpret_cast<T*>(base + o_gu);
  T* xb = reinterpret_cast<T*>(base + o_x);
  T* logits = reinterpret_cast<T*>(base + o_logits);
  char* plan_mem = base + o_plan;
  char* moe_mem = base + o_moe;
  char* per_base = base + shared_bytes;
  moe::Plan plan{};      // a sparse layer's pairs per expert: set by thread 0, read by all after a barrier
  bool failed = false;   // the routing failed (raised after the region)

  const bool prof = g_prof_on.load(std::memory_order_relaxed);
  const auto t_fork = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    PhaseClock clk(prof, g_prof + tid, t_fork);
    clk.mark(kFork);
    if (prof && tid == 0) {
      g_prof[0].s[kPrologue] += std::chrono::duration<double>(t_fork - s.t_entry).count();
      ++g_prof_steps;
      g_prof_threads = std::max(g_prof_threads, team);
    }
    // this thread's buffers (redundant) or the shared set and this thread's rows (split)
    char* mine = per_base + per_bytes * (redundant ? tid : 0);
    char* own = per_base + per_bytes * tid;   // always this thread's (the rotated key row)
    T* res = reinterpret_cast<T*>(mine + p_res);
    T* hn = reinterpret_cast<T*>(mine + p_hn);
    T* act = reinterpret_cast<T*>(mine + p_act);
    char* xu = mine + p_xu;
    float* sc = reinterpret_cast<float*>(mine + p_sc);
    T* krow = reinterpret_cast<T*>(own + p_k);
    float* xf = reinterpret_cast<float*>(mine + p_xf);
    const bool wide = std::is_same_v<T, c10::BFloat16> && parts::float_linear_widens_bf16();
    const int64_t r_lo = redundant ? 0 : Tn * tid / team, r_hi = redundant ? Tn : Tn * (tid + 1) / team;
    auto rows_done = [&](Phase p) {
      if (!redundant) {
#pragma omp barrier
      }
      clk.mark(p);
    };
    auto gemv = [&](const Lin& lin, std::atomic<int64_t>* home, T* y, Phase p) {
      // W4A16 batch 1: the table lookup where w4a16_linear takes it (the weight's lut_zero, the row exact); every
      // thread checks the row it reads (its own copy: the same bits, the same answer)
      const float* xf4 = reinterpret_cast<const float*>(xu);
      const float z = lin.kind == moe::kW4A16 && Tn == 1 && lin.lut >= 0.f && parts::w4a16_lut_row(xf4, lin.K)
                          ? lin.lut : -1.f;
      auto run = [&](int64_t ch) {
        const int64_t p0 = ch * lin.chunk, p1 = std::min(lin.NP, (ch + 1) * lin.chunk);
        if (lin.kind == moe::kW4A16)
          parts::w4a16_panel_range<T>(xf4, Tn, lin.K, lin.w4, lin.scale, lin.zeros, lin.G, p0, p1, y, lin.N, z);
        else if (lin.kind == moe::kFloat)
          float_lin_panels<T>(lin, xu, Tn, y, p0, p1);
        else if (lin.kind == moe::kW4A8)
          parts::w4a8_panel_range<T>(xu, sc, Tn, lin.K, lin.w4, lin.scale, lin.G, p0, p1, y, lin.N);
        else
          parts::a8w8_panels(xu, sc, Tn, lin.Kp, lin.w, lin.KG, lin.scale, lin.colsum, lin.N, p0, p1, y, lin.N);
      };
      take_homes([&](int64_t k) -> std::atomic<int64_t>& { return home[k * kLine]; }, tid, nt, run);
      clk.mark(p);
#pragma omp barrier
      clk.mark(static_cast<Phase>(p + 1));   // the wait for the others' panels
    };
    // [spec] rows r_lo .. r_hi of src (the residual stream entering layer `layer`) into its aux slots: written by
    // the thread that holds them (redundant rows: thread 0's copy, every copy the same bits); read after the region
    auto capture = [&](int64_t layer, const T* src) {
      if (redundant && tid != 0) return;
      for (int64_t j = 0; j < s.aux_n; ++j)
        if (s.aux_ids[j] == layer)
          for (int64_t r = r_lo; r < r_hi; ++r)
            std::memcpy(s.aux + (r * s.aux_n + j) * hid, src + r * hid, hid * sizeof(T));
    };
    capture(0, s.x_in);
    for (int64_t l = 0; l < s.L; ++l) {
      std::atomic<int64_t>* home = homes + l * 4 * nt * kLine;   // this layer's four GEMVs
      std::atomic<int64_t>& items_next = items_ctr[l * kLine];
      const T* res_in = l == 0 ? s.x_in : res;   // layer 0: the residual is the embedding
      // input norm and the qkv activations
      for (int64_t r = r_lo; r < r_hi; ++r) {
        if (l == 0) parts::rms_norm_row(s.x_in + r * hid, s.in_norm[l], hn + r * hid, hid, s.eps);
        else parts::add_rms_norm_row(xb + r * hid, res + r * hid, s.in_norm[l], hn + r * hid, res + r * hid, hid, s.eps);
        prep_row(s.qkv[l], hn + r * hid, r, xu, sc);
      }
      if (l > 0) capture(l, res);
      rows_done(kNormIn);
      gemv(s.qkv[l], home, qkv, kQkv);
      // per (sequence, KV head): q/k-norm + RoPE of its heads and its K/V row into the cache for EVERY row of the
      // sequence, then its attention items. A row attends to the keys of its sequence's earlier rows of this step
      // (a verification's draft rows), so all of them are written first, by this very thread: no barrier needed
      // (no other item writes or reads this sequence's keys of head g; other sequences never share a page that is
      // written, prefix caching shares only full pages). The attention items are paged_attention's (make_items:
      // runs of kMaxRows / G rows from the sequence's first row), so each output row has the op's bits.
      const int64_t items = s.B * KVH;
      for (int64_t it = items_next.fetch_add(1, std::memory_order_relaxed); it < items;
           it = items_next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t b = it / KVH, g = it % KVH;
        const int32_t r0 = s.attn.query_start_loc[b], r1 = s.attn.query_start_loc[b + 1];
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = qkv + r * W;
          const float* cosv = s.cos_sin + s.pos[r] * D;
          for (int64_t h = g * G; h < (g + 1) * G; ++h)
            parts::qk_norm_rope_head(row + h * D, s.q_norm[l], cosv, D, s.eps, qb + (r * H + h) * D);
          parts::qk_norm_rope_head(row + (H + g) * D, s.k_norm[l], cosv, D, s.eps, krow);
          clk.mark(kRope);
          if (s.slots[r] >= 0)
            parts::write_kv_row(krow, row + (H + KVH + g) * D, s.kc[l], s.vc[l], s.slots[r], g, KVH, D, s.attn.S,
                                s.attn.KW);
          clk.mark(kKvWrite);
        }
        for (int32_t t0 = r0; t0 < r1; t0 += per_item)
          parts::dense_attention_item(s.attn, static_cast<int32_t>(b), static_cast<int32_t>(g), t0,
                                      std::min<int32_t>(per_item, r1 - t0), qb, s.kc[l], s.vc[l], att);
        clk.mark(kAttn);
      }
#pragma omp barrier
      clk.mark(kAttnWait);
      for (int64_t r = r_lo; r < r_hi; ++r)
        prep_row(s.o[l], att + r * HD, r, xu, sc);
      rows_done(kQuantO);
      gemv(s.o[l], home + nt * kLine, yb, kO);
      const Sparse& sp = s.sparse[l];
      if (sp.on) {   // Qwen3SparseMoe.forward: the router, its top-k, the experts (moe_parts.h), the combine
        const moe::Experts& ex = sp.ex;
        for (int64_t r = r_lo; r < r_hi; ++r) {
          parts::add_rms_norm_row(yb + r * hid, res_in + r * hid, s.post_norm[l], hn + r * hid, res + r * hid, hid,
                                  s.eps);
          if (wide)
            for (int64_t c = 0; c < hid; ++c) xf[r * hid + c] = to_f(hn[r * hid + c]);
          sc[r] = wide ? moe::prepare<T, float>(ex, hn + r * hid, hid, ex.kp_h, xu + r * ex.rb_h)   // (1)
                       : moe::prepare<T, T>(ex, hn + r * hid, hid, ex.kp_h, xu + r * ex.rb_h);
        }
        rows_done(kNormPost);
        std::atomic<int64_t>* mc = moe_ctr + l * 2 * kLine;
        for (int64_t p = mc[0].fetch_add(1, std::memory_order_relaxed); p < sp.router_np;
             p = mc[0].fetch_add(1, std::memory_order_relaxed))
          router_panel<T>(sp, hn, xf, Tn, hid, logits, p);
        clk.mark(kRouter);
#pragma omp barrier
        clk.mark(kRouterWait);
        std::atomic<int64_t>* mh = moe_homes + l * 2 * nt * kLine;   // this layer's gate_up and down item homes
        if (tid == 0) {
          if (!route_plan<T>(sp, logits, Tn, plan_mem, plan)) failed = true;
          for (int t = 0; t < nt && !failed; ++t) {
            mh[t * kLine].store(home_of(plan.ng * ex.ch_gu, t, nt), std::memory_order_relaxed);
            mh[(nt + t) * kLine].store(home_of(plan.ng * ex.ch_dn, t, nt), std::memory_order_relaxed);
          }
        }
#pragma omp barrier
        clk.mark(kRoute);
        if (failed) break;
        moe::Bufs b = moe::bufs_at(moe_mem, ex, Tn, plan.S, sizeof(T), false);
        b.tok = xu, b.tsc = sc;   // (1): this thread's (or the shared) quantized rows
        if (moe::needs_gather(ex, plan)) {   // (2)
          for (int64_t q = tid; q < plan.S; q += team) moe::gather_slot(ex, plan, b, q);
#pragma omp barrier
        }
        clk.mark(kGather);
        take_homes([&](int64_t k) -> std::atomic<int64_t>& { return mh[k * kLine]; }, tid, nt,
                   [&](int64_t it) {   // (3)
          wide ? moe::gate_up_item<T, float>(ex, plan, b, it) : moe::gate_up_item<T, T>(ex, plan, b, it);
        });
        clk.mark(kExpGateUp);
#pragma omp barrier
        clk.mark(kExpGateUpWait);
        for (int64_t q = tid; q < plan.S; q += team)   // (4)
          wide ? moe::silu_slot<T, float>(ex, plan, b, q) : moe::silu_slot<T, T>(ex, plan, b, q);
#pragma omp barrier
        clk.mark(kExpSilu);
        take_homes([&](int64_t k) -> std::atomic<int64_t>& { return mh[(nt + k) * kLine]; }, tid, nt,
                   [&](int64_t it) {   // (5)
          wide ? moe::down_item<T, float>(ex, plan, b, it) : moe::down_item<T, T>(ex, plan, b, it);
        });
        clk.mark(kExpDown);
#pragma omp barrier
        clk.mark(kExpDownWait);
        for (int64_t it = mc[kLine].fetch_add(1, std::memory_order_relaxed); it < Tn * ex.cchunks;
             it = mc[kLine].fetch_add(1, std::memory_order_relaxed))
          moe::combine_item<T>(ex, plan, b, it, xb);   // (6): the layer's output rows
#pragma omp barrier
        clk.mark(kCombine);
        continue;
      }
      for (int64_t r = r_lo; r < r_hi; ++r) {
        parts::add_rms_norm_row(yb + r * hid, res_in + r * hid, s.post_norm[l], hn + r * hid, res + r * hid, hid, s.eps);
        prep_row(s.gate_up[l], hn + r * hid, r, xu, sc);
      }
      rows_done(kNormPost);
      gemv(s.gate_up[l], home + 2 * nt * kLine, gu, kGateUp);
      for (int64_t r = r_lo; r < r_hi; ++r) {
        parts::silu_mul_row(gu + r * 2 * I, I, act + r * I);
        prep_row(s.down[l], act + r * I, r, xu, sc);
      }
      rows_done(kSilu);
      gemv(s.down[l], home + 3 * nt * kLine, xb, kDown);
    }
    // the final norm: the first thread (redundant rows) or each its rows
    if (!redundant || tid == 0)
      for (int64_t r = r_lo; r < r_hi; ++r)
        parts::add_rms_norm_row(xb + r * hid, res + r * hid, s.final_norm, s.out + r * hid, res + r * hid, hid, s.eps);
    capture(s.L, res);
    clk.mark(kFinal);
  }
  TORCH_CHECK(!failed, "decode_layers: the routing of a sparse layer failed");
}

template <typename T>
const T* ptr_of(const at::Tensor& t, int64_t numel, at::ScalarType dt, bool& ok) {
  ok = ok && t.scalar_type() == dt && t.is_contiguous() && t.numel() == numel;
  return ok ? static_cast<const T*>(t.data_ptr()) : nullptr;
}

// The one-region step over the pack's layers, or an undefined tensor where it does not apply (then the op path runs).
at::Tensor decode_layers_region(const at::Tensor& x_in, LayerPack& pack, const at::Tensor& positions,
                                const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, int64_t H, int64_t KVH, double eps, double scale,
                                const AuxOut& aux) {
  const auto t_entry = std::chrono::steady_clock::now();
  const at::TensorList layers = pack.layers, k_caches = pack.k_caches, v_caches = pack.v_caches;
  const at::Tensor& final_norm = pack.final_norm;
  const int64_t L = static_cast<int64_t>(k_caches.size()), Tn = x_in.size(0), hid = x_in.size(1);
  const auto dt = x_in.scalar_type();
  if (L == 0 || Tn == 0 || Tn > kMaxFusedRows || (dt != at::kFloat && dt != at::kBFloat16) || !x_in.is_contiguous() ||
      H <= 0 || KVH <= 0 || H % KVH != 0 || H / KVH > parts::attention_item_rows())
    return {};
  // B sequences of 1 to kMaxSeqRows query rows each (decode rows, verification rows, short chunks)
  const int64_t B = seq_lens.numel();
  if (query_start_loc.scalar_type() != at::kInt || B < 1 || query_start_loc.numel() != B + 1 ||
      seq_lens.scalar_type() != at::kInt || block_tables.scalar_type() != at::kInt || block_tables.dim() != 2 ||
      block_tables.size(0) < B || !block_tables.is_contiguous() || positions.scalar_type() != at::kLong ||
      positions.numel() != Tn || slot_mapping.scalar_type() != at::kLong || slot_mapping.numel() != Tn ||
      !query_start_loc.is_contiguous() || !seq_lens.is_contiguous() || !positions.is_contiguous() ||
      !slot_mapping.is_contiguous() || cos_sin.scalar_type() != at::kFloat || !cos_sin.is_contiguous() ||
      cos_sin.dim() != 2)
    return {};
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  if (qsl[0] != 0 || qsl[B] != Tn) return {};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    if (nq < 1 || nq > kMaxSeqRows || lens[b] < nq) return {};   // lens < nq: no key for its first row
  }
  const int64_t D = cos_sin.size(1);
  const at::Tensor& kc0 = k_caches[0];
  if (D > 256 || D % 2 != 0 || kc0.dim() != 5 || kc0.size(1) != KVH || kc0.size(3) != D) return {};
  const int64_t KW = kc0.size(4), S = kc0.size(2) * KW;
  if (KW != (S % 32 == 0 ? 32 : 16)) return {};
  const int nt = std::max(1, std::min(at::get_num_threads(), kMaxThreads));
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tn; ++t)
    if (pos[t] < 0 || pos[t] >= cos_sin.size(0)) return {};
  // the layers' part of the step (the same for every step of a pack: kept there, keyed by what it depends on)
  const std::array<double, 8> key{static_cast<double>(dt), static_cast<double>(nt), static_cast<double>(hid),
                                  static_cast<double>(H), static_cast<double>(KVH), static_cast<double>(D), eps,
                                  static_cast<double>(L)};
  auto layers_of = [&](auto tag, Step<decltype(tag)>& s) -> bool {
    using T = decltype(tag);
    s.L = L, s.hid = hid, s.H = H, s.KVH = KVH, s.D = D, s.eps = static_cast<float>(eps);
    s.Wqkv = (H + 2 * KVH) * D;
    s.I = 0;   // the dense layers' intermediate width (none: all layers sparse)
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = layers.data() + l * kPerLayer;
      if (is_sparse(w)) continue;
      const double* dims = region_lin_dims(w);
      if (dims == nullptr) return false;
      const double n_gu = dims[2 * kLinGateUp];
      if (!(n_gu > 0) || n_gu > 1e12 || std::fmod(n_gu, 2.0) != 0) return false;
      s.I = static_cast<int64_t>(n_gu) / 2;
      break;
    }
    // a float linear's / float experts' activation type, float_linear's and moe_experts' (Lin, make_sparse)
    const bool x_f32 = std::is_same_v<T, float> || parts::float_linear_widens_bf16();
    bool ok = true;
    for (auto* v : {&s.in_norm, &s.post_norm, &s.q_norm, &s.k_norm}) v->reserve(L);
    for (auto* v : {&s.qkv, &s.o, &s.gate_up, &s.down}) v->reserve(L);
    s.sparse.reserve(L);
    s.kc.reserve(L), s.vc.reserve(L);
    for (int64_t l = 0; l < L && ok; ++l) {
      const at::Tensor* w = layers.data() + l * kPerLayer;
      s.in_norm.push_back(ptr_of<T>(w[kInputNorm], hid, dt, ok));
      s.post_norm.push_back(ptr_of<T>(w[kPostNorm], hid, dt, ok));
      s.q_norm.push_back(ptr_of<T>(w[kQNorm], D, dt, ok));
      s.k_norm.push_back(ptr_of<T>(w[kKNorm], D, dt, ok));
      Lin a{}, b{}, c{}, d{};
      Sparse sp{};
      c.chunk = d.chunk = 1;   // a sparse layer's (no panels)
      ok = ok && make_lin(w, kLinQkv, hid, s.Wqkv, nt, x_f32, a) && make_lin(w, kLinO, H * D, hid, nt, x_f32, b);
      if (is_sparse(w))
        ok = ok && make_sparse(w, hid, x_f32 ? 4 : 2, sp);
      else
        ok = ok && make_lin(w, kLinGateUp, hid, 2 * s.I, nt, x_f32, c) &&
             make_lin(w, kLinDown, s.I, hid, nt, x_f32, d);
      s.qkv.push_back(a), s.o.push_back(b), s.gate_up.push_back(c), s.down.push_back(d), s.sparse.push_back(sp);
      const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
      ok = ok && kc.scalar_type() == dt && vc.scalar_type() == dt && kc.is_contiguous() && vc.is_contiguous() &&
           kc.sizes() == kc0.sizes() && vc.dim() == 4 && vc.size(0) == kc.size(0) && vc.size(1) == KVH &&
           vc.size(2) == S && vc.size(3) == D;
      s.kc.push_back(ok ? static_cast<T*>(kc.data_ptr()) : nullptr);
      s.vc.push_back(ok ? static_cast<T*>(vc.data_ptr()) : nullptr);
    }
    s.final_norm = ptr_of<T>(final_norm, hid, dt, ok);
    return ok;
  };
  auto run = [&](auto tag) -> at::Tensor {
    using T = decltype(tag);
    Step<T> s;
    std::shared_ptr<const void> plan;
    {
      std::lock_guard<std::mutex> lock(pack.mu);
      if (pack.plan && pack.plan_key == key) plan = pack.plan;
    }
    if (plan) {
      s = *static_cast<const Step<T>*>(plan.get());
    } else {
      if (!layers_of(tag, s)) return {};
      std::lock_guard<std::mutex> lock(pack.mu);
      pack.plan = std::make_shared<const Step<T>>(s), pack.plan_key = key;
    }
    s.t_entry = t_entry;
    s.T_ = Tn, s.B = B;
    s.x_in = static_cast<const T*>(x_in.data_ptr());
    s.pos = pos;
    s.slots = slot_mapping.data_ptr<int64_t>();
    s.cos_sin = cos_sin.data_ptr<float>();
    s.attn = {qsl, lens, block_tables.data_ptr<int32_t>(), block_tables.size(1), H, KVH, D,
              S, KW, static_cast<float>(scale)};
    at::Tensor out = at::empty({Tn, hid}, x_in.options());
    s.out = static_cast<T*>(out.data_ptr());
    s.aux = aux.n ? static_cast<T*>(aux.out.data_ptr()) : nullptr;
    s.aux_ids = aux.ids, s.aux_n = aux.n;
    static thread_local Workspace ws;
    run_region(s, nt, ws);
    return out;
  };
  return dt == at::kFloat ? run(float{}) : run(c10::BFloat16{});
}

}  // namespace

// Seconds per thread and phase of the one-region steps since the last call ([threads, phases + 1], the last
// column the number of steps in row 0), then resets; `enable` switches the accounting on or off from now on.
at::Tensor decode_layers_profile(bool enable) {
  std::lock_guard<std::mutex> lock(g_prof_mu);
  const int n = std::max(1, g_prof_threads);
  auto out = at::zeros({n, kPhases + 1}, at::kDouble);
  double* o = out.data_ptr<double>();
  for (int t = 0; t < n; ++t)
    for (int p = 0; p < kPhases; ++p) o[t * (kPhases + 1) + p] = g_prof[t].s[p];
  o[kPhases] = static_cast<double>(g_prof_steps);
  for (auto& r : g_prof) r = ProfRow{};
  g_prof_steps = 0;
  g_prof_threads = 0;
  g_prof_on.store(enable);
  return out;
}

// x [T, hidden] (the step's embedded tokens) -> the final-normed hidden states [T, hidden], as
// Qwen3ForCausalLM.forward computes them over the pack's layers; writes the step's K/V rows into the pack's K / V
// caches (one per layer). The region's plan of the layers is built at the first call and kept in the pack.
// [spec] aux (with aux_layers, n ids in [0, L]): written with EAGLE-3's aux hidden states, [T, n * hidden] (AuxOut).
at::Tensor decode_layers(const at::Tensor& x_in, const c10::intrusive_ptr<LayerPack>& pack,
                         const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         int64_t H, int64_t KVH, double eps, double scale, const c10::optional<at::Tensor>& aux,
                         at::IntArrayRef aux_layers) {
  LayerPack& p = *pack;
  const int64_t L = static_cast<int64_t>(p.k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(p.layers.size()) == L * kPerLayer && static_cast<int64_t>(p.v_caches.size()) == L,
              "decode_layers: ", kPerLayer, " tensors and one K and V cache per layer expected");
  TORCH_CHECK(x_in.dim() == 2, "decode_layers: x must be [T, hidden]");
  AuxOut ax;
  TORCH_CHECK(aux.has_value() == !aux_layers.empty(), "decode_layers: aux and aux_layers go together");
  if (aux.has_value()) {
    const int64_t n = static_cast<int64_t>(aux_layers.size());
    const at::Tensor& a = *aux;
    TORCH_CHECK(a.scalar_type() == x_in.scalar_type() && a.is_contiguous() && a.dim() == 2 &&
                    a.size(0) == x_in.size(0) && a.size(1) == n * x_in.size(1),
                "decode_layers: aux must be contiguous [T, ", n, " * hidden] in x's dtype");
    for (const int64_t i : aux_layers)
      TORCH_CHECK(i >= 0 && i <= L, "decode_layers: aux layer ", i, " outside [0, ", L, "]");
    ax = {a, aux_layers.data(), n};
  }
  at::Tensor out = decode_layers_region(x_in, p, positions, cos_sin, slot_mapping, block_tables, query_start_loc,
                                        seq_lens, H, KVH, eps, scale, ax);
  if (out.defined()) return out;
  return decode_layers_ops(x_in, p.layers, p.k_caches, p.v_caches, positions, cos_sin, slot_mapping, block_tables,
                           query_start_loc, seq_lens, p.final_norm, H, KVH, eps, scale, ax);
}

}  // namespace qk
