"""vLLM's layout of a dense Llama-family model at tensor-parallel degree N, from its
config.json: q, k, v stacked per rank in ``qkv_proj`` and gate, up in ``gate_up_proj``
(buffers named by vLLM's parameters), ``o_proj`` / ``down_proj`` split by columns, the
embedding and ``lm_head`` split by rows over the vocabulary padded to a multiple of 64 · N,
norms replicated. Used for the models whose layout is not learned from vLLM itself."""

from __future__ import annotations

from typing import Any, Mapping

Json = dict[str, Any]


def _rows_into(rows: int, cols: int, tp: int, buffer: str, shard_rows: int, at_rows: int,
               replicated: bool = False) -> Json:
    """A [rows, cols] tensor split by rows over tp ranks (or whole on each when
    ``replicated``), rank r's rows at row ``at_rows`` of buffer [shard_rows, cols]."""
    per = rows if replicated else rows // tp
    return {"logical_shape": [rows, cols], "ranks": {str(r): {
        "buffer": buffer, "shard_shape": [shard_rows, cols],
        "pieces": [{"shape": [per, cols], "source": [0 if replicated else r * per * cols,
                                                     [cols, 1]],
                    "dest": [at_rows * cols, [cols, 1]], "locations": [r]}]}
        for r in range(tp)}}


def _cols(rows: int, cols: int, tp: int) -> Json:
    per = cols // tp
    return {"logical_shape": [rows, cols], "ranks": {str(r): {
        "shard_shape": [rows, per],
        "pieces": [{"shape": [rows, per], "source": [r * per, [cols, 1]],
                    "dest": [0, [per, 1]], "locations": [r]}]} for r in range(tp)}}


def _whole(shape: list[int], tp: int) -> Json:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return {"logical_shape": list(shape), "ranks": {str(r): {
        "shard_shape": list(shape),
        "pieces": [{"shape": list(shape), "source": [0, strides], "dest": [0, strides],
                    "locations": [r]}]} for r in range(tp)}}


def _vocab(vocab: int, hidden: int, tp: int) -> Json:
    padded = -(-vocab // (64 * tp)) * 64 * tp
    per = padded // tp
    return {"logical_shape": [padded, hidden], "valid_shape": [vocab, hidden],
            "ranks": {str(r): {"shard_shape": [per, hidden],
                               "pieces": [{"shape": [per, hidden],
                                           "source": [r * per * hidden, [hidden, 1]],
                                           "dest": [0, [hidden, 1]], "locations": [r]}]}
                      for r in range(tp)}}


def llama_maps(config: Mapping[str, Any], tp: int) -> dict[str, Json]:
    """``{checkpoint name: map}`` of vLLM's workers at ``tp`` ranks."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    if heads % tp or (kv % tp and tp % kv) or inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's attention "
                         f"heads ({heads}), key/value heads ({kv}) or intermediate size "
                         f"({inter})")
    q_rows = heads // tp * head_dim
    kv_replicated = kv < tp
    kv_rows = (1 if kv_replicated else kv // tp) * head_dim
    maps: dict[str, Json] = {
        "model.embed_tokens.weight": _vocab(vocab, hidden, tp),
        "model.norm.weight": _whole([hidden], tp),
    }
    if not config.get("tie_word_embeddings", False):
        maps["lm_head.weight"] = _vocab(vocab, hidden, tp)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        qkv = p + "self_attn.qkv_proj.weight"
        rows = q_rows + 2 * kv_rows
        maps[p + "self_attn.q_proj.weight"] = _rows_into(heads * head_dim, hidden, tp, qkv,
                                                         rows, 0)
        for j, name in enumerate(("k_proj", "v_proj")):
            if kv_replicated:  # rank r holds kv head r * kv // tp
                m = {"logical_shape": [kv * head_dim, hidden], "ranks": {str(r): {
                    "buffer": qkv, "shard_shape": [rows, hidden],
                    "pieces": [{"shape": [head_dim, hidden],
                                "source": [r * kv // tp * head_dim * hidden, [hidden, 1]],
                                "dest": [(q_rows + j * kv_rows) * hidden, [hidden, 1]],
                                "locations": [r]}]} for r in range(tp)}}
            else:
                m = _rows_into(kv * head_dim, hidden, tp, qkv, rows, q_rows + j * kv_rows)
            maps[p + f"self_attn.{name}.weight"] = m
        maps[p + "self_attn.o_proj.weight"] = _cols(hidden, heads * head_dim, tp)
        gate_up = p + "mlp.gate_up_proj.weight"
        maps[p + "mlp.gate_proj.weight"] = _rows_into(inter, hidden, tp, gate_up,
                                                      2 * inter // tp, 0)
        maps[p + "mlp.up_proj.weight"] = _rows_into(inter, hidden, tp, gate_up,
                                                    2 * inter // tp, inter // tp)
        maps[p + "mlp.down_proj.weight"] = _cols(hidden, inter, tp)
        maps[p + "input_layernorm.weight"] = _whole([hidden], tp)
        maps[p + "post_attention_layernorm.weight"] = _whole([hidden], tp)
    return maps
