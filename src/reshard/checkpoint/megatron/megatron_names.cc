#include "reshard/checkpoint/megatron/megatron_names.h"

#include <iterator>

#include "reshard/checkpoint/model_config.h"

namespace reshard::megatron {
namespace {

using enum Part;
using enum Scope;

// Megatron-Core's keys (local and Transformer Engine specs alike: the local spec saves its
// norms under TE's fused names) and the Hugging Face tensors of Llama-, Qwen2/3-, Mixtral-,
// Qwen-MoE- and DeepSeek-style (non-MLA) checkpoints.
constexpr NameRule kRules[] = {
    {kModel, "embedding.word_embeddings.weight", kVocab, "V,H", "model.embed_tokens.weight"},
    {kModel, "decoder.final_layernorm.weight", kWhole, "H", "model.norm.weight"},
    {kModel, "output_layer.weight", kVocab, "V,H", "lm_head.weight"},

    {kLayer, "self_attention.linear_qkv.layer_norm_weight", kWhole, "H", "input_layernorm.weight"},
    {kLayer, "input_layernorm.weight", kWhole, "H", "input_layernorm.weight"},
    {kLayer, "self_attention.linear_qkv.weight", kQ, "QKV,H", "self_attn.q_proj.weight"},
    {kLayer, "self_attention.linear_qkv.weight", kK, "QKV,H", "self_attn.k_proj.weight"},
    {kLayer, "self_attention.linear_qkv.weight", kV, "QKV,H", "self_attn.v_proj.weight"},
    {kLayer, "self_attention.linear_qkv.bias", kQ, "QKV", "self_attn.q_proj.bias"},
    {kLayer, "self_attention.linear_qkv.bias", kK, "QKV", "self_attn.k_proj.bias"},
    {kLayer, "self_attention.linear_qkv.bias", kV, "QKV", "self_attn.v_proj.bias"},
    {kLayer, "self_attention.q_layernorm.weight", kWhole, "D", "self_attn.q_norm.weight"},
    {kLayer, "self_attention.k_layernorm.weight", kWhole, "D", "self_attn.k_norm.weight"},
    {kLayer, "self_attention.linear_proj.weight", kWhole, "H,A", "self_attn.o_proj.weight"},
    {kLayer, "self_attention.linear_proj.bias", kWhole, "H", "self_attn.o_proj.bias"},
    {kLayer, "mlp.linear_fc1.layer_norm_weight", kWhole, "H", "post_attention_layernorm.weight"},
    {kLayer, "pre_mlp_layernorm.weight", kWhole, "H", "post_attention_layernorm.weight"},
    {kLayer, "mlp.linear_fc1.weight", kGate, "2F,H", "mlp.gate_proj.weight"},
    {kLayer, "mlp.linear_fc1.weight", kUp, "2F,H", "mlp.up_proj.weight"},
    {kLayer, "mlp.linear_fc1.weight_w", kWhole, "F,H", "mlp.gate_proj.weight"},
    {kLayer, "mlp.linear_fc1.weight_v", kWhole, "F,H", "mlp.up_proj.weight"},
    {kLayer, "mlp.linear_fc2.weight", kWhole, "H,F", "mlp.down_proj.weight"},
    {kLayer, "mlp.linear_fc1.bias", kGate, "2F", "mlp.gate_proj.bias"},
    {kLayer, "mlp.linear_fc1.bias", kUp, "2F", "mlp.up_proj.bias"},
    {kLayer, "mlp.linear_fc2.bias", kWhole, "H", "mlp.down_proj.bias"},
    {kLayer, "mlp.router.weight", kWhole, "E,H", "{moe}.gate.weight"},
    {kLayer, "mlp.router.expert_bias", kWhole, "E", "{moe}.gate.e_score_correction_bias"},
    {kLayer, "mlp.shared_experts.linear_fc1.weight", kGate, "2S,H",
     "mlp.{shared}.gate_proj.weight"},
    {kLayer, "mlp.shared_experts.linear_fc1.weight", kUp, "2S,H", "mlp.{shared}.up_proj.weight"},
    {kLayer, "mlp.shared_experts.linear_fc2.weight", kWhole, "H,S",
     "mlp.{shared}.down_proj.weight"},
    {kLayer, "mlp.shared_experts.gate_weight", kWhole, "1,H", "mlp.shared_expert_gate.weight"},

    // LoRA adapters of Megatron-Bridge (its ParallelLinearAdapter under the wrapped layer's
    // "adapter."): linear_in is A [R, in], linear_out is B [out, R], named as PEFT names the
    // pair of the Hugging Face projection (under base_model.model.). A fused layer's A is
    // every projection's A (a copy each); its B is fused as the layer's weight is.
    {kLayer, "self_attention.linear_qkv.adapter.linear_in.weight", kWhole, "R,H",
     "self_attn.q_proj.lora_A.weight"},
    {kLayer, "self_attention.linear_qkv.adapter.linear_in.weight", kWhole, "R,H",
     "self_attn.k_proj.lora_A.weight"},
    {kLayer, "self_attention.linear_qkv.adapter.linear_in.weight", kWhole, "R,H",
     "self_attn.v_proj.lora_A.weight"},
    {kLayer, "self_attention.linear_qkv.adapter.linear_out.weight", kQ, "QKV,R",
     "self_attn.q_proj.lora_B.weight"},
    {kLayer, "self_attention.linear_qkv.adapter.linear_out.weight", kK, "QKV,R",
     "self_attn.k_proj.lora_B.weight"},
    {kLayer, "self_attention.linear_qkv.adapter.linear_out.weight", kV, "QKV,R",
     "self_attn.v_proj.lora_B.weight"},
    {kLayer, "self_attention.linear_proj.adapter.linear_in.weight", kWhole, "R,A",
     "self_attn.o_proj.lora_A.weight"},
    {kLayer, "self_attention.linear_proj.adapter.linear_out.weight", kWhole, "H,R",
     "self_attn.o_proj.lora_B.weight"},
    {kLayer, "mlp.linear_fc1.adapter.linear_in.weight", kWhole, "R,H",
     "mlp.gate_proj.lora_A.weight"},
    {kLayer, "mlp.linear_fc1.adapter.linear_in.weight", kWhole, "R,H", "mlp.up_proj.lora_A.weight"},
    {kLayer, "mlp.linear_fc1.adapter.linear_out.weight", kGate, "2F,R",
     "mlp.gate_proj.lora_B.weight"},
    {kLayer, "mlp.linear_fc1.adapter.linear_out.weight", kUp, "2F,R", "mlp.up_proj.lora_B.weight"},
    {kLayer, "mlp.linear_fc2.adapter.linear_in.weight", kWhole, "R,F",
     "mlp.down_proj.lora_A.weight"},
    {kLayer, "mlp.linear_fc2.adapter.linear_out.weight", kWhole, "H,R",
     "mlp.down_proj.lora_B.weight"},

    {kExpert, "linear_fc1.weight", kGate, "2I,H", "{w1}.weight"},
    {kExpert, "linear_fc1.weight", kUp, "2I,H", "{w3}.weight"},
    {kExpert, "linear_fc1.weight_w", kWhole, "I,H", "{w1}.weight"},
    {kExpert, "linear_fc1.weight_v", kWhole, "I,H", "{w3}.weight"},
    {kExpert, "linear_fc2.weight", kWhole, "H,I", "{w2}.weight"},
};

constexpr NameFamily kFamilies[] = {
    {"mixtral minimax phimoe", "block_sparse_moe", "w1", "w3", "w2", "shared_experts"},
    {"qwen2_moe", "mlp", "gate_proj", "up_proj", "down_proj", "shared_expert"},
    {"", "mlp", "gate_proj", "up_proj", "down_proj", "shared_experts"},
};

}  // namespace

std::span<const NameRule> NameRules() { return kRules; }

const NameFamily& FamilyOf(std::string_view model_type) {
  for (const NameFamily& f : kFamilies) {
    if (internal::WordListHolds(f.model_types, model_type)) return f;
  }
  return kFamilies[std::size(kFamilies) - 1];
}

}  // namespace reshard::megatron
