#include "reshard/checkpoint/orbax/maxtext_names.h"

namespace reshard::maxtext {
namespace {

using enum Scope;

// MaxText's Llama (decoder_block llama2) and Qwen3 (dense) parameters, as MaxText's checkpoint
// conversion maps them to transformers' LlamaForCausalLM and Qwen3ForCausalLM: kernels are
// [in, out] (DenseGeneral), attention's per head; Llama's query and key kernels hold their
// head_dim in the interleaved rotary order of MaxText's LLaMARotaryEmbedding and its query
// kernel the factor 1/sqrt(head_dim) that MaxText's attention does not apply; Qwen3's (with
// query and key norms) hold neither. Norm scales are the values themselves (no offset).
constexpr LayoutRule kRules[] = {
    {"llama qwen3", kModel, "token_embedder.embedding", "V,H", "V,H", "model.embed_tokens.weight",
     ""},
    {"llama qwen3", kModel, "decoder.decoder_norm.scale", "H", "H", "model.norm.weight", ""},
    {"llama qwen3", kModel, "decoder.logits_dense.kernel", "H,V", "V,H", "lm_head.weight", "",
     When::kUntied},

    {"llama qwen3", kLayer, "pre_self_attention_layer_norm.scale", "H", "H",
     "input_layernorm.weight", ""},
    {"llama", kLayer, "self_attention.query.kernel", "H,N,P*R", "N*R*P,H",
     "self_attn.q_proj.weight", "1/sqrt(D)"},
    {"qwen3", kLayer, "self_attention.query.kernel", "H,N,D", "N*D,H", "self_attn.q_proj.weight",
     ""},
    {"llama", kLayer, "self_attention.key.kernel", "H,K,P*R", "K*R*P,H", "self_attn.k_proj.weight",
     ""},
    {"qwen3", kLayer, "self_attention.key.kernel", "H,K,D", "K*D,H", "self_attn.k_proj.weight", ""},
    {"llama qwen3", kLayer, "self_attention.value.kernel", "H,K,D", "K*D,H",
     "self_attn.v_proj.weight", ""},
    {"llama qwen3", kLayer, "self_attention.out.kernel", "N,D,H", "H,N*D",
     "self_attn.o_proj.weight", ""},
    {"qwen3", kLayer, "self_attention.query_norm.scale", "D", "D", "self_attn.q_norm.weight", ""},
    {"qwen3", kLayer, "self_attention.key_norm.scale", "D", "D", "self_attn.k_norm.weight", ""},
    {"llama qwen3", kLayer, "post_self_attention_layer_norm.scale", "H", "H",
     "post_attention_layernorm.weight", ""},
    {"llama qwen3", kLayer, "mlp.wi_0.kernel", "H,F", "F,H", "mlp.gate_proj.weight", ""},
    {"llama qwen3", kLayer, "mlp.wi_1.kernel", "H,F", "F,H", "mlp.up_proj.weight", ""},
    {"llama qwen3", kLayer, "mlp.wo.kernel", "F,H", "H,F", "mlp.down_proj.weight", ""},
};

}  // namespace

std::span<const LayoutRule> LayoutRules() { return kRules; }

std::string_view KnownFamilies() { return "llama, qwen3"; }

}  // namespace reshard::maxtext
