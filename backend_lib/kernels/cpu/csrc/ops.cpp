// Registers the CPU kernels as torch operators under torch.ops.qwen3_cpu.
#include <torch/library.h>
#include "ops.h"

TORCH_LIBRARY(qwen3_cpu, m) {
  m.def("float_pack(Tensor w) -> Tensor", &qk::float_pack);
  m.def("float_packed_rows(Tensor packed, Tensor ids, int K) -> Tensor", &qk::float_packed_rows);
  m.def("float_linear(Tensor x, Tensor packed, int N, ScalarType? out_dtype=None) -> Tensor", &qk::float_linear);
  m.def("float_linear_rows(Tensor x, Tensor packed, int N, Tensor ids) -> Tensor", &qk::float_linear_rows);
  m.def("greedy_screen(Tensor a, Tensor c, Tensor d, Tensor terms, float coef, int limit) -> (Tensor, Tensor)",
        &qk::greedy_screen);
  m.def("greedy_head_picks(Tensor x, Tensor packed8, Tensor w_scale, Tensor colsum, Tensor c, Tensor d, float wmax, "
        "Tensor packed, int N, float coef, float margin, int limit) -> (Tensor, int)", &qk::greedy_head_picks);
  m.def("a8w8_pack(Tensor w_q) -> Tensor", &qk::a8w8_pack);
  m.def("a8w8_colsum(Tensor w_q) -> Tensor", &qk::a8w8_colsum);
  m.def("a8w8_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor colsum) -> Tensor", &qk::a8w8_linear);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &qk::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)", &qk::add_rms_norm);
  m.def("qk_norm_rope(Tensor qkv, Tensor q_w, Tensor k_w, Tensor positions, Tensor cos_sin, int H, int KVH, "
        "float eps) -> (Tensor, Tensor, Tensor)", &qk::qk_norm_rope);
  m.def("silu_mul(Tensor x) -> Tensor", &qk::silu_mul);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale) -> Tensor",
        &qk::paged_attention);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &qk::write_kv);
  m.def("tq_write(Tensor k, Tensor v, Tensor(a!) k_codes, Tensor(b!) k_scales, Tensor(c!) v_codes, "
        "Tensor(d!) v_scales, Tensor slot_mapping, Tensor rotation, Tensor centroids, Tensor boundaries) -> ()",
        &qk::tq_write);
  m.def("tq_paged_attention(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor rotation, Tensor centroids, "
        "float scale) -> Tensor",
        &qk::tq_paged_attention);
  m.class_<qk::LayerPack>("LayerPack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>());
  m.def("decode_layers(Tensor x, __torch__.torch.classes.qwen3_cpu.LayerPack pack, Tensor positions, "
        "Tensor cos_sin, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int H, "
        "int KVH, float eps, float scale, Tensor(c!)? aux=None, int[] aux_layers=[]) -> Tensor",
        &qk::decode_layers);
  m.def("decode_layers_profile(bool enable) -> Tensor", &qk::decode_layers_profile);
  m.def("argmax_rows(Tensor logits) -> (int[], int[])", &qk::argmax_rows);
  m.def("stream_zeros(int[] size, ScalarType dtype) -> Tensor", &qk::stream_zeros);
  m.def("moe_route(Tensor logits, int top_k, bool norm_topk_prob) -> (Tensor, Tensor)", &qk::moe_route);
  m.def("moe_route_path(int top_k, bool norm_topk_prob) -> str", &qk::moe_route_path);
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor table, Tensor lut, int[] dims) -> Tensor",
        &qk::moe_experts);
}
