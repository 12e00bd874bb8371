"""LoRA adapters pushed live into vLLM engines (WeightSync.push_lora): a toy Llama with a rank-8
adapter on q, k, v, o, gate, up and down (random A and B, PEFT's format), pushed into an engine
started with enable_lora at TP 1 and at TP 2. After the push, vLLM's greedy tokens for the
adapter's LoRARequest are PEFT's (computed in the main venv, which has PEFT); a second push under
the same name gives the new adapter's tokens; the bytes moved are the adapter's plan minimum,
each worker receiving its own part; a push refused or failing on one worker leaves the adapter
served before served on every worker."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [17, 3, 240, 99, 1], [(7 * i + 3) % 250 for i in range(40)]]
NEW_TOKENS = 8
R = toy.LORA_R
ADAPTER_CONFIG = toy.LORA_CONFIG


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model, adapters 1 and 2 (PEFT directories), and PEFT's tokens for each."""
    root = tmp_path_factory.mktemp("lora_push")
    config = toy.llama_config()
    base = toy.write(str(root / "base"), config, toy.weights(config, 1))
    made = toy.peft_adapters(str(root), base, config, {"one": 11, "two": 12}, PROMPTS,
                             NEW_TOKENS)
    return {"base": base, "config": config, **made, "state": toy.weights(config, 1),
            "root": root}


def _generate(llm, request=None):
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False, lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=[1, 2], ids=["engine_tp1", "engine_tp2"])
def live(request, models, tmp_path_factory):
    """An engine with enable_lora at TP 1 or 2, and a WeightSync into it from this process."""
    from vllm import LLM

    from reshard.vllm import WeightSync
    extra = toy.plugin_path(tmp_path_factory.mktemp("plugin"))
    sys.path.extend(extra)
    os.environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    llm = LLM(model=models["base"], tensor_parallel_size=request.param, enforce_eager=True,
              dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20,
              max_model_len=128, max_num_seqs=4, enable_lora=True, max_lora_rank=R,
              max_loras=2, weight_transfer_config={"backend": "reshard"})
    sync = WeightSync(llm, source=models["state"])
    try:
        yield {"llm": llm, "sync": sync, "tp": request.param}
    finally:
        sync.close()
        llm.llm_engine.engine_core.shutdown()


def test_pushed_adapters_serve_peft_tokens(live, models):
    llm, sync = live["llm"], live["sync"]
    expected = models["expected"]
    assert _generate(llm) == expected["base"]
    stats = sync.push_lora("policy", models["adapters"]["one"], config=ADAPTER_CONFIG)
    request = sync.lora_request("policy")

    assert _generate(llm, request) == expected["one"]
    assert _generate(llm) == expected["base"]  # the base model is served as it was
    # The adapter's plan minimum, once out of the trainer: each worker its part.
    assert stats.bytes_sent == stats.plan_minimum > 0
    whole = sum(t.numel() * 4 for t in models["adapters"]["one"].values())
    if live["tp"] == 1:
        assert stats.bytes_sent == whole
    else:
        assert whole < stats.bytes_sent < 2 * whole
    # A second push under the same name: the new adapter, nothing of the old one cached.
    sync.push(models["adapters"]["two"], lora="policy", config=ADAPTER_CONFIG)
    assert _generate(llm, request) == expected["two"]
    assert sync.adapter_names == ["policy"]


def test_failed_adapter_pushes_leave_the_served_adapter_everywhere(live, models):
    """A refused push (a B whose rows do not match its layer), then one whose staging fails on
    the last worker after every byte arrived: each raises naming why, and every worker still
    serves the adapter pushed before; the next push serves its own. A push of the base weights
    keeps the pushed adapter served."""
    from reshard.vllm import WeightSyncError
    llm, sync = live["llm"], live["sync"]
    expected = models["expected"]
    sync.push_lora("policy", models["adapters"]["two"], config=ADAPTER_CONFIG)
    request = sync.lora_request("policy")
    bad = dict(models["adapters"]["one"])
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    bad[name] = bad[name][:-1]
    with pytest.raises(WeightSyncError, match="up_proj.lora_B.weight"):
        sync.push_lora("policy", bad, config=ADAPTER_CONFIG)
    assert _generate(llm, request) == expected["two"]
    assert any(llm.collective_rpc(toy.fail_adapter_staging_once, args=(live["tp"] - 1,)))
    with pytest.raises(WeightSyncError, match="staging fails on purpose"):
        sync.push_lora("policy", models["adapters"]["one"], config=ADAPTER_CONFIG)
    assert _generate(llm, request) == expected["two"]
    # A new name refused the same way is served nowhere.
    assert any(llm.collective_rpc(toy.fail_adapter_staging_once, args=(0,)))
    with pytest.raises(WeightSyncError, match="staging fails on purpose"):
        sync.push_lora("other", models["adapters"]["one"], config=ADAPTER_CONFIG)
    from reshard.vllm import lora_id
    held = llm.collective_rpc(toy.adapter_ids)
    assert all(lora_id("policy") in ids and lora_id("other") not in ids for ids in held), held
    sync.push_lora("policy", models["adapters"]["one"], config=ADAPTER_CONFIG)
    assert _generate(llm, request) == expected["one"]
    sync.push()  # the base weights again: the adapter stays served
    assert _generate(llm, request) == expected["one"]
    assert _generate(llm) == expected["base"]


def test_a_pushed_adapter_answers_under_an_id_of_another_numbering(live, models):
    """What a ``vllm serve`` server sends for ``"model": "policy"``: the adapter's placeholder
    path under an id of the server's own numbering. The workers answer it with the adapter
    pushed under the name, the new one after the next push; a name never pushed is refused
    naming it, and the engine goes on serving."""
    from vllm.lora.request import LoRARequest
    llm, sync = live["llm"], live["sync"]
    expected = models["expected"]
    sync.push_lora("policy", models["adapters"]["one"], config=ADAPTER_CONFIG)
    path = sync.lora_request("policy").lora_path
    served = LoRARequest("policy", 7, path)
    assert served.lora_int_id != sync.lora_request("policy").lora_int_id
    assert _generate(llm, served) == expected["one"]
    sync.push_lora("policy", models["adapters"]["two"], config=ADAPTER_CONFIG)
    assert _generate(llm, served) == expected["two"]
    assert _generate(llm, sync.lora_request("policy")) == expected["two"]
    held = llm.collective_rpc(toy.adapter_ids)
    assert all(7 in ids for ids in held), held
    never = LoRARequest("never-pushed", 8, path.replace("policy", "never-pushed"))
    with pytest.raises(Exception, match="no LoRA adapter was pushed under the name "
                                        "'never-pushed'"):
        llm.llm_engine.add_lora(never)
    assert _generate(llm, served) == expected["two"]
    assert _generate(llm) == expected["base"]
