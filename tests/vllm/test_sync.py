"""Live weight sync into a running vLLM engine (DESIGN 18): trainer processes at TP 2 (and 1)
push weights B into an engine serving A, at TP 1 and TP 2; after each push the engine's
greedy tokens are transformers' for the weights pushed; failures raise on every trainer
process and leave the engine serving what it had. A Qwen3-MoE model takes pushes too (its
experts land in vLLM's fused w13/w2 parameters, which the CPU kernel repacks)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# The last prompt fills a KV block (the engine's blocks are 32 tokens), which the engine's
# prefix cache keeps for the next request of that prompt.
PROMPTS = [[5, 6, 7, 8], [17, 3, 240, 99, 1], [(7 * i + 3) % 250 for i in range(40)]]
NEW_TOKENS = 8
# The first WeightSync processes each layer as it arrives (overlap_processing=True), the
# later ones (the default on CPU) after the transfer.
STEPS = [
    {"name": "push B", "kind": "push", "weights": "B", "overlap": True},
    {"name": "push A", "kind": "push", "weights": "A"},
    {"name": "push B again", "kind": "push", "weights": "B"},
    {"name": "a name the engine lacks", "kind": "extra_name", "weights": "A"},
    {"name": "a shape that disagrees", "kind": "bad_shape", "weights": "A"},
    {"name": "a trainer process failing", "kind": "failing_process", "weights": "A"},
    {"name": "trainer at TP 1 pushes A", "kind": "single", "weights": "A"},
    {"name": "trainer at TP 2 pushes B after", "kind": "push", "weights": "B"},
    {"name": "processing fails on one worker", "kind": "processing_fails", "weights": "A"},
    {"name": "push A after", "kind": "push", "weights": "A"},
    {"name": "processing fails on one worker, overlapped", "kind": "processing_fails",
     "weights": "B", "overlap": True},
    {"name": "push B after, overlapped", "kind": "push", "weights": "B"},
    {"name": "push NaN", "kind": "nan", "weights": "A"},
    {"name": "push A after NaN", "kind": "push", "weights": "A"},
    {"name": "push B, and A from another thread mid-push", "kind": "two_at_once",
     "weights": "B", "second": "A"},
    {"name": "push A after two at once", "kind": "push", "weights": "A"},
    {"name": "process 0 pushes B, process 1 A", "kind": "pushes_differ", "weights": "B",
     "other": "A"},
    {"name": "two threads push B and A at once, in opposite orders", "kind": "two_threads",
     "weights": "B", "other": "A"},
    {"name": "push B after the threads", "kind": "push", "weights": "B"},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return toy.llama_a_and_b(str(tmp_path_factory.mktemp("models")), (2, 1), PROMPTS,
                             NEW_TOKENS)


MOE_STEPS = [{"name": "push B", "kind": "push", "weights": "B"},
             {"name": "push A", "kind": "push", "weights": "A"},
             {"name": "push B again", "kind": "push", "weights": "B"}]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Qwen3-MoE weights A and B as transformers saves them (per-expert tensors), each
    scattered at TP 2."""
    import reshard
    root = tmp_path_factory.mktemp("moe_models")
    config = toy.qwen3_moe_config()
    sharded, expected = {}, {}
    for key, seed in (("A", 1), ("B", 2)):
        full = toy.write_pretrained(str(root / key), config, seed)
        sharded[key] = str(root / f"{key}-tp2")
        reshard.checkpoint.scatter(full, sharded[key], config=os.path.join(full, "config.json"),
                                   tp=2)
        expected[key] = toy.greedy_of_dir(full, PROMPTS, NEW_TOKENS)
    assert expected["A"] != expected["B"]
    return {"root": root, "model": str(root / "A"), "sharded": sharded, "expected": expected}


def run_trainers(script, spec, tmp_path, timeout_s):
    """Two trainer processes running ``script`` on ``spec`` (written to tmp_path), each
    engine's core and workers in processes of their own, as in production (the conftest puts
    the engine core in the test process for the other tests); failing the test with their
    logs unless both exit 0. (VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc of a test's
    function, which makes a worker's post-load processing fail.)"""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               PYTHONPATH=os.pathsep.join(sys.path + toy.plugin_path(tmp_path)))
    logs = [tmp_path / f"trainer{r}.log" for r in range(2)]
    codes = toy.run_processes(os.path.join(HERE, script), str(path), 2, env, logs, timeout_s)
    if any(c != 0 for c in codes):
        tail = "\n".join(log.read_text()[-6000:] for log in logs)
        pytest.fail(f"trainer processes failed ({codes}):\n{tail}")


def run_session(models, engine_tp, tmp_path, steps=STEPS, **extra):
    spec = {"model": models["model"], "engine_tp": engine_tp, "trainers": 2,
            "sharded": models["sharded"], "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
            "full": {k: os.path.join(models["root"], k) for k in ("A", "B")},
            "steps": steps, "rendezvous": str(tmp_path / "rendezvous"),
            "out": str(tmp_path / "result.json"), **extra}
    run_trainers("sync_trainer.py", spec, tmp_path, 480)
    main = json.loads((tmp_path / "result.json").read_text())["steps"]
    other = json.loads((tmp_path / "result.json.1").read_text())["steps"]
    return main, other


# RESHARD_VLLM_ENGINE_TPS="1" for a machine with one GPU (bench/gpu_check.sh).
ENGINE_TPS = [int(t) for t in os.environ.get("RESHARD_VLLM_ENGINE_TPS", "1,2").split(",")]
# RESHARD_TRAINER_DEVICE=cuda (bench/gpu_check.sh): the trainer's DTensors on the GPU.
TRAINER_DEVICE = os.environ.get("RESHARD_TRAINER_DEVICE", "cpu")


@pytest.fixture(scope="module", params=ENGINE_TPS, ids=[f"engine_tp{t}" for t in ENGINE_TPS])
def session(request, models, tmp_path_factory):
    return run_session(models, request.param, tmp_path_factory.mktemp(f"tp{request.param}"))


def test_engine_starts_with_weights_a(session, models):
    main, _ = session
    assert main[0]["tokens"] == models["expected"]["A"]


@pytest.mark.parametrize("index", [1, 2, 3], ids=["B", "A", "B_again"])
def test_push_gives_transformers_tokens_of_the_weights_pushed(session, models, index):
    main, other = session
    step = main[index]
    assert "error" not in step, step
    assert step["tokens"] == models["expected"][STEPS[index - 1]["weights"]]
    stats = step["stats"]
    assert stats["bytes_sent"] == stats["plan_minimum"] > 0
    # Both trainer processes sent (each holds half of every split tensor).
    assert 0 < stats["bytes_sent_here"] < stats["bytes_sent"]
    assert other[index - 1]["stats"]["bytes_sent"] == stats["bytes_sent"]
    # The layers were processed within the transfer (overlapped), then committed.
    seconds = stats["worker_seconds"]
    assert sorted(seconds) == ["commit", "prepare", "process", "transfer"], seconds
    assert 0 < seconds["process"] < seconds["transfer"], seconds


@pytest.mark.parametrize("index,words", [(4, "no parameter"), (5, "shape"),
                                         (6, "no shard given")],
                         ids=["extra_name", "bad_shape", "failing_process"])
def test_failures_raise_on_every_trainer_and_keep_the_old_weights(session, models, index,
                                                                   words):
    main, other = session
    assert words in main[index]["error"], main[index]
    assert words in other[index - 1]["error"], other[index - 1]
    assert main[index]["tokens"] == models["expected"]["B"]  # still what the last push gave


def test_trainer_at_tp1_then_tp2_again(session, models):
    main, _ = session
    assert "error" not in main[7], main[7]
    assert main[7]["tokens"] == models["expected"]["A"]
    assert main[7]["stats"]["bytes_sent"] == main[7]["stats"]["plan_minimum"]
    assert main[8]["tokens"] == models["expected"]["B"]


@pytest.mark.parametrize("engine_tp", ENGINE_TPS, ids=[f"engine_tp{t}" for t in ENGINE_TPS])
def test_moe_pushes_give_transformers_tokens(moe_models, engine_tp, tmp_path):
    """B, then A, then B again, each equal to transformers' tokens for the weights pushed
    (at engine TP 2 both workers hold every expert, each its slice of the intermediate
    dimension, which the CPU kernel pads)."""
    main, other = run_session(moe_models, engine_tp, tmp_path, MOE_STEPS)
    assert main[0]["tokens"] == moe_models["expected"]["A"]
    for index, step in enumerate(MOE_STEPS, 1):
        assert "error" not in main[index], main[index]
        assert main[index]["tokens"] == moe_models["expected"][step["weights"]], step["name"]
        stats = main[index]["stats"]
        assert stats["bytes_sent"] == stats["plan_minimum"] > 0
        assert 0 < stats["bytes_sent_here"] < stats["bytes_sent"]


def test_processing_failing_on_one_worker_keeps_the_old_weights_on_all(session, models):
    """The last worker's post-load processing of layer 1's MLP raises, after other layers
    were processed (at engine TP 2 every layer of the other worker too): every trainer
    process raises it, every worker keeps its old weights, and the next push works; with
    every layer processed after the transfer, then with each processed as it arrived."""
    main, other = session
    for failed, kept, after in ((9, "B", "A"), (11, "A", "B")):  # after, then overlapped
        for step in (main[failed], other[failed - 1]):
            assert "processing the new weights" in step["error"], step
            assert "model.layers.1.mlp.down_proj" in step["error"], step
            assert "fails on purpose" in step["error"], step
        assert main[failed]["tokens"] == models["expected"][kept]
        assert "error" not in main[failed + 1], main[failed + 1]
        assert main[failed + 1]["tokens"] == models["expected"][after]
        seconds = main[failed + 1]["stats"]["worker_seconds"]
        assert seconds["process"] > 0 and seconds["commit"] > 0, seconds


def test_nothing_computed_with_the_old_weights_answers_after_a_push(session, models):
    """Every push above was followed by generating the same prompts, one of which fills a KV
    block the prefix cache keeps: each gave the tokens of the weights pushed, not of the
    blocks cached under the weights before. Weights of NaN leave NaN in the KV blocks their
    requests used; the next push's tokens are still its own (the blocks were cleared)."""
    main, other = session
    nan = main[13]
    assert "error" not in nan, nan
    assert nan["tokens"] != models["expected"]["B"]
    assert "error" not in main[14] and "error" not in other[13], (main[14], other[13])
    assert main[14]["tokens"] == models["expected"]["A"]


def test_a_second_push_mid_push_is_refused_on_every_process(session, models):
    """Each trainer process starts a push of A from another thread while its push of B is
    under way: refused at once with WeightSyncError on both processes; B's push completes and
    the engine serves B; the next push works."""
    main, other = session
    for step in (main[15], other[14]):
        assert "error" not in step, step
        assert step["second"].get("error", "").startswith("WeightSyncError: a push of this "
                                                          "WeightSync is in progress"), step
    assert main[15]["tokens"] == models["expected"]["B"]
    assert "error" not in main[16], main[16]
    assert main[16]["tokens"] == models["expected"]["A"]


def test_processes_pushing_different_weights_are_refused_on_every_process(session, models):
    """Process 0 pushes B while process 1 pushes A (what two threads racing on each process can
    amount to): refused on both before any byte moves, naming a tensor both hold whole; the
    engine keeps A, never a mix of the two."""
    main, other = session
    for step in (main[17], other[16]):
        assert step.get("error", "").startswith("trainer processes 0 and 1 push different "
                                                "weights: tensor "), step
    assert main[17]["tokens"] == models["expected"]["A"]


def test_two_threads_pushing_at_once_never_leave_a_mix(session, models):
    """Each process starts two threads pushing at once, B then A on process 0 and A then B on
    process 1: whichever way the race goes, each process makes the same push or none, the
    engine serves B or A (what it had), never a mix; the next push works."""
    main, other = session
    won = [sorted(t["weights"] for t in step["threads"] if "error" not in t)
           for step in (main[18], other[17])]
    assert won[0] == won[1], (main[18], other[17])  # the same pushes made on both processes
    for step in (main[18], other[17]):
        for t in step["threads"]:
            assert "error" not in t or t["error"].startswith("WeightSyncError: "), t
    # A push made on both (or, had the threads not overlapped, both pushes), or none: A kept.
    served = [k for k in ("A", "B") if main[18]["tokens"] == models["expected"][k]]
    assert served and (served[0] in won[0] or (not won[0] and served == ["A"])), \
        (main[18], won)
    assert "error" not in main[19] and main[19]["tokens"] == models["expected"]["B"]


def test_trainer_dtensors_push_without_maps(models, tmp_path):
    """WeightSync(llm, source=state) over the trainer processes' DTensors (row and column
    splits, uneven ones included, and replicated vectors): each push gives transformers' tokens
    of the weights the DTensors hold, at the plan's minimum bytes; changing the DTensors in place
    and pushing again (no arguments) sends the new weights. On a GPU machine the DTensors live
    on the trainer processes' GPU (RESHARD_TRAINER_DEVICE=cuda)."""
    steps = [{"name": "DTensors B then A", "kind": "dtensors", "weights": "B", "then": "A"}]
    main, other = run_session(models, max(ENGINE_TPS), tmp_path, steps,
                              trainer_device=TRAINER_DEVICE)
    step = main[1]
    assert "error" not in step, step
    assert step["trainer_devices"] == [TRAINER_DEVICE], step
    assert step["tokens_first"] == models["expected"]["B"]
    assert step["tokens"] == models["expected"]["A"]
    for stats in (step["stats"], step["stats_then"]):
        assert stats["bytes_sent"] == stats["plan_minimum"] > 0
        assert 0 < stats["bytes_sent_here"] < stats["bytes_sent"]
    assert other[0]["stats"]["bytes_sent"] == step["stats"]["bytes_sent"]


FLEET_STEPS = [
    {"name": "B", "kind": "push", "weights": "B", "delta": True},
    {"name": "processing fails", "kind": "processing_fails", "weights": "A", "engine": 1,
     "delta": True},
    {"name": "A", "kind": "push", "weights": "A", "delta": True},
    {"name": "B verified", "kind": "push", "weights": "B", "delta": True, "verify": True},
    {"name": "adapter one, FSDP2", "kind": "lora_push", "adapter": "one", "parallel": "fsdp2",
     "lora_name": "policy"},
    {"name": "adapter two, TP", "kind": "lora_push", "adapter": "two", "parallel": "tp",
     "lora_name": "policy"},
    {"name": "adapter one, staging fails on engine 1", "kind": "lora_push", "adapter": "one",
     "parallel": "fsdp2", "lora_name": "policy", "fail_engine": 1},
    {"name": "lost, dropped", "kind": "engine_lost", "weights": "A", "engine": 1,
     "delta": True},
    {"name": "B to one", "kind": "push", "weights": "B", "delta": True},
    {"name": "add", "kind": "add_engine", "owner": 1},
    {"name": "A after the add", "kind": "push", "weights": "A", "delta": True},
    {"name": "B after the add", "kind": "push", "weights": "B", "delta": True},
    {"name": "B unchanged", "kind": "push", "weights": "B", "delta": True},
    {"name": "ten AdamW steps", "kind": "adamw", "steps": 10, "lr": 5e-6, "then": "B",
     "compare_every": False},
    {"name": "verify", "kind": "verify"},
    {"name": "verify altered", "kind": "corrupt_verify", "engine": 0, "worker": 1,
     "tensor": "model.norm.weight"},
    {"name": "add again", "kind": "add_engine", "owner": 1, "again": True},
    {"name": "add another model", "kind": "add_other_model", "owner": 0},
    {"name": "B after the refused adds", "kind": "push", "weights": "B", "delta": True},
    {"name": "fail on loss", "kind": "new_sync", "on_engine_lost": "fail"},
    {"name": "B again", "kind": "push", "weights": "B"},
    {"name": "lost, failing", "kind": "engine_lost", "weights": "A", "engine": 1}]
FLEET_TIMEOUT_S = 20  # how long a lost engine can hold the others' commit


def _step(steps, name):
    return next(s for s in steps if s.get("name") == name)


@pytest.fixture(scope="module")
def fleet_adapters(models, tmp_path_factory):
    """Two LoRA adapters of the toy Llama in PEFT's format, and PEFT's greedy tokens of weights
    B (what the engines serve when the fleet pushes them) with each."""
    return toy.peft_adapters(str(tmp_path_factory.mktemp("fleet_adapters")),
                             os.path.join(models["root"], "B"), toy.llama_config(),
                             {"one": 11, "two": 12}, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def fleet(models, fleet_adapters, tmp_path_factory):
    """Each trainer process's steps of FLEET_STEPS (its own engine's tokens)."""
    tmp = tmp_path_factory.mktemp("fleet")
    # Engine TPs 2 and 1 on the CPU; on a GPU machine (RESHARD_VLLM_ENGINE_TPS=1, one GPU per
    # engine: RESHARD_FLEET_GPU_EACH=1) both at TP 1.
    spec = {"model": models["model"], "engine_tps": [max(ENGINE_TPS), min(ENGINE_TPS)],
            "gpu_each": os.environ.get("RESHARD_FLEET_GPU_EACH") == "1",
            "sharded": models["sharded"], "on_engine_lost": "drop",
            "full": {k: os.path.join(models["root"], k) for k in ("A", "B")},
            "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "steps": FLEET_STEPS,
            "lora_dirs": fleet_adapters["dirs"],
            "timeout_s": FLEET_TIMEOUT_S,
            "rendezvous": str(tmp / "rendezvous"), "out": str(tmp / "result.json")}
    run_trainers("fleet_trainer.py", spec, tmp, 900)
    return [json.loads((tmp / f"result.json.{r}").read_text())["steps"] for r in range(2)]


def test_one_sync_into_two_engines_sends_each_byte_once(fleet, models):
    """WeightSync(engines=[engine at TP 2, engine at TP 1], on_engine_lost="drop") from two
    trainer processes (each owning one engine): after a push both engines give transformers'
    tokens for the weights pushed; the trainer processes send one copy (the sync schedule roots
    each tensor at one engine) and the engines' workers relay the rest to each other. A worker
    of the second engine failing its processing fails the push on every trainer process and
    both engines keep serving what the last push gave them; the next push lands on both. The
    pushes are deltas (the first whole, the one after the failure whole, then a verified delta
    relayed between the engines). The second engine's worker 0 lost mid-push (SIGKILL): the
    push completes on the first engine, which serves the new weights, the lost one is dropped
    (reported in the stats and by a warning) and the next push goes to the first alone. A fresh
    engine added: both serve what is pushed, deltas included. verify() passes, and catches a
    parameter a worker serves altered behind the sync's back, naming engine, worker, tensor and
    element. Adding an engine the sync has already is refused at once, and adding an engine of
    a model the trainer's tensors do not fit is refused with the others still joined. With on_engine_lost="fail" (the default), a lost engine fails the push on every
    trainer process, and the first engine keeps serving the weights it had."""
    runs = fleet
    expected = models["expected"]
    for steps in runs:  # each process: its own engine's tokens
        assert steps[0]["tokens"] == expected["A"]
        assert "different numbers of engines (2, 3)" in steps[0]["mismatched"], steps[0]
        assert 'placement.engines[1][0]: no host named "elsewhere"' in steps[0]["bad_topology"]
        assert "error" not in steps[1], steps[1]
        assert steps[1]["tokens"] == expected["B"]
        assert "engine 1 worker 0: processing the new weights" in steps[2]["error"], steps[2]
        assert steps[2]["tokens"] == expected["B"]  # neither engine took A
        assert "error" not in steps[3], steps[3]
        assert steps[3]["tokens"] == expected["A"]
        # A delta through the schedule (the engines relaying the changes), verified on every
        # worker of both engines.
        assert "error" not in steps[4], steps[4]
        assert steps[4]["tokens"] == expected["B"]
    # Engine 1's worker 0 dies in the push of A: with "drop" the push completes on engine 0,
    # engine 1 is dropped and reported, and the next push goes to engine 0 alone.
    for steps in runs:
        lost = _step(steps, "lost, dropped")
        assert "error" not in lost, lost
        assert lost["stats"]["dropped"][0].startswith("engine 1 ("), lost
        assert any("dropped engine 1 (" in w and "engines [0]" in w
                   for w in lost["warnings"]), lost
        assert lost["last_stats"] == lost["stats"] and lost["engine_ids"] == [0], lost
        # The push's seconds count the loss and the push made again, not the latter alone.
        assert lost["stats"]["seconds"] > 0.8 * lost["seconds"] > 1, lost
        alone = _step(steps, "B to one")
        assert "error" not in alone and alone["engine_ids"] == [0], alone
        assert not alone["stats"]["dropped"], alone
        assert all("engine 1" not in k for k in alone["stats"]["links"]), alone
        assert alone["stats"]["bytes_sent"] == alone["stats"]["plan_minimum"] > 0, alone
    assert _step(runs[0], "lost, dropped")["tokens"] == expected["A"]
    assert _step(runs[1], "lost, dropped")["tokens"] is None
    assert _step(runs[0], "B to one")["tokens"] == expected["B"]
    # A fresh engine (number 2, in process 1) added: both serve every push after it.
    for steps in runs:
        added = _step(steps, "add")
        assert "error" not in added and added["number"] == 2, added
        assert added["engine_ids"] == [0, 2], added
        for name, weights in (("A after the add", "A"), ("B after the add", "B"),
                              ("B unchanged", "B")):
            step = _step(steps, name)
            assert "error" not in step, step
            assert step["tokens"] == expected[weights], name
        whole = _step(steps, "A after the add")["stats"]
        assert whole["bytes_sent"] == whole["plan_minimum"] > 0
        assert whole["bytes_relayed"] > 0  # the new engine takes part in the schedule
        same = _step(steps, "B unchanged")["stats"]
        assert same["bytes_sent_here"] < whole["bytes_sent_here"] // 50, (same, whole)
        # verify(): every (tensor, worker) the engines serve as loaded is proven; a norm
        # weight altered on engine 0's worker 1 is caught on every trainer process.
        verified = _step(steps, "verify")
        assert "error" not in verified, verified
        assert verified["verified"]["pairs"] > 0, verified
        assert "model.norm.weight" not in verified["verified"]["unverified"], verified
        altered = _step(steps, "verify altered")
        assert "the targets do not hold what the sources have" in altered["error"], altered
        assert '"model.norm.weight" on target engine 0 worker 1' in altered["error"], altered
        assert "first differing element [0]" in altered["error"], altered
        # An engine the sync has already is refused at once; one whose model the trainer's
        # tensors do not fit is refused, and the others stay joined: the next push lands.
        again = _step(steps, "add again")
        assert "add_engine() was given engine 2, which the sync has already (trainer process " \
            "1)" in again["error"], again
        assert again["seconds"] < 5 and again["engine_ids"] == [0, 2], again
        other = _step(steps, "add another model")
        assert other["error"].startswith("the engine added could not join: "), other
        assert other["error"].endswith("the sync goes on with engines [0, 2]"), other
        assert other["engine_ids"] == [0, 2], other
        after = _step(steps, "B after the refused adds")
        assert "error" not in after and not after["stats"]["dropped"], after
        assert after["engine_ids"] == [0, 2] and after["tokens"] == expected["B"], after
    # With on_engine_lost="fail": the new engine's worker 0 dies in a push of A; both trainer
    # processes raise, within the sync's timeout, and engine 0 still serves B.
    for steps in runs:
        again = _step(steps, "B again")
        assert "error" not in again, again
        failed = _step(steps, "lost, failing")
        assert failed["error"].startswith("a push failed in the transfer"), failed
        assert failed["seconds"] < 1.5 * FLEET_TIMEOUT_S, failed
    assert _step(runs[0], "B again")["tokens"] == expected["B"]
    assert _step(runs[0], "lost, failing")["tokens"] == expected["B"]
    stats = runs[0][1]["stats"]
    assert stats == {**runs[1][1]["stats"], "bytes_sent_here": stats["bytes_sent_here"],
                     "seconds": stats["seconds"]}
    # One copy out of the trainer processes (each tensor to the engine the schedule roots it
    # at, each replicated piece to one holder); the rest is relayed between the engines and
    # handed on within them.
    assert stats["bytes_sent"] == stats["plan_minimum"] > 0
    assert stats["bytes_relayed"] > 0
    links = stats["links"]
    relays = [k for k in links if k.startswith("engine") and
              k.split(" ")[1] != k.split(" -> ")[1].split(" ")[1]]
    assert relays, links
    assert sum(v for k, v in links.items() if k.startswith("trainer")) == stats["bytes_sent"]
    assert sum(v for k, v in links.items() if k.startswith("engine")) == stats["bytes_relayed"]
    assert links[stats["busiest_link"]] == max(links.values())


def test_adapters_of_fsdp2_and_tp_peft_models_pushed_into_two_engines(fleet, fleet_adapters,
                                                                     models):
    """push_lora from the two trainer processes into both engines of the fleet (TP 2 and TP 1,
    started with enable_lora) through the sync schedule: adapter one from a live PEFT model
    under FSDP2 (each process holding rows of every adapter tensor, DTensors), then, under the
    same name, adapter two from PEFT over a model parallelized by torch's tensor parallelism
    (B of q, k, v, gate, up split by rows, A of o, down by columns, the others whole on both).
    After each, both engines give PEFT's greedy tokens of the served weights B with the
    adapter for ``sync.lora_request("policy")``, and transformers' tokens of B without it: the
    second push swapped the adapter on both. Each byte leaves the trainer processes once (the
    whole adapter: its plan minimum); the engines' workers relay the rest. A third push whose
    staging fails on the second engine's worker, after every byte arrived, raises on both
    trainer processes, and neither engine commits it: both still serve adapter two."""
    reference = fleet_adapters["expected"]
    assert reference["base"] == models["expected"]["B"]  # PEFT's base model is transformers'
    whole = sum(t.numel() * 4 for t in fleet_adapters["adapters"]["one"].values())
    for steps in fleet:  # each process: its own engine's tokens
        for name, key in (("adapter one, FSDP2", "one"), ("adapter two, TP", "two")):
            step = _step(steps, name)
            assert "error" not in step, step
            assert step["adapter_names"] == ["policy"], step
            assert step["lora_tokens"] == reference[key], name
            assert step["tokens"] == models["expected"]["B"], name
            stats = step["stats"]
            assert stats["bytes_sent"] == stats["plan_minimum"] == whole, (stats, whole)
            assert stats["bytes_relayed"] > 0, stats
        failed = _step(steps, "adapter one, staging fails on engine 1")
        # The worker named with its engine (of two, "worker 0" alone names none).
        assert failed["error"].startswith(
            "engine 1 worker 0: staging adapter 'policy': RuntimeError: staging fails on "
            "purpose"), failed
        assert failed["lora_tokens"] == reference["two"], failed
        assert failed["tokens"] == models["expected"]["B"], failed
    # Under FSDP2 every adapter tensor is split between the trainer processes: both send.
    sent = [_step(steps, "adapter one, FSDP2")["stats"] for steps in fleet]
    assert all(0 < s["bytes_sent_here"] < s["bytes_sent"] for s in sent), sent
    assert sum(s["bytes_sent_here"] for s in sent) == sent[0]["bytes_sent"], sent


DELTA_STEPS = [
    {"name": "delta push B (the first: whole)", "kind": "push", "weights": "B", "delta": True},
    {"name": "delta push A", "kind": "push", "weights": "A", "delta": True},
    {"name": "delta push A again (nothing changed)", "kind": "push", "weights": "A",
     "delta": True},
    {"name": "processing fails on one worker, delta B", "kind": "processing_fails",
     "weights": "B", "delta": True},
    {"name": "delta push B after the failure", "kind": "push", "weights": "B", "delta": True},
    {"name": "full push A", "kind": "push", "weights": "A"},
    {"name": "delta push B after a full push", "kind": "push", "weights": "B", "delta": True},
    {"name": "delta push A, verified", "kind": "push", "weights": "A", "delta": True,
     "verify": True},
    {"name": "delta push B, a worker's tensor altered before the verify", "kind": "corrupted",
     "weights": "B", "delta": True, "tensor": "model.layers.1.mlp.down_proj.weight"},
    {"name": "delta push B after the failed verify, verified", "kind": "push", "weights": "B",
     "delta": True, "verify": True},
]


# Ten AdamW steps of the toy model trained as bf16 weights (fp32 masters; learning rate 5e-6:
# 4.5 % of the bf16 elements change in the first step, 1.66 % in the tenth), each delta-pushed
# and verified; before the seventh push a worker's delta copy is altered behind the sync's back.
ADAMW = {"kind": "adamw", "steps": 10, "lr": 5e-6}
ALTERED_AT = 6


@pytest.fixture(scope="module")
def delta_session(models, tmp_path_factory):
    return run_session(models, 2, tmp_path_factory.mktemp("delta"), steps=DELTA_STEPS + [
        {"name": "ten AdamW steps, delta-pushed", **ADAMW, "alter_at": ALTERED_AT,
         "alter_process": 0, "alter_worker": 1}])


def test_delta_pushes_give_transformers_tokens(delta_session, models):
    """push(delta=True) into an engine at TP 2: after every push, failed ones included, the
    engine serves transformers' tokens of the weights it should hold; a push of unchanged
    weights sends only headers; the push after a failed one, and after a full one, sends
    everything again. push(verify=True) passes, and fails on every trainer process, the old
    weights kept, when a worker's received tensor is altered before its verify, naming the
    tensor and its element."""
    main, other = delta_session
    want = [models["expected"][k] for k in ("B", "A", "A", "A", "B", "A", "B", "A", "A", "B")]
    for entry, tokens in zip(main[1:], want):
        assert entry["tokens"] == tokens, entry["step"]
    sent = [e.get("stats", {}).get("bytes_sent_here") for e in main[1:]]
    assert main[4].get("error") and "processing" in main[4]["error"], main[4]
    whole = sent[0]
    assert sent[2] < whole // 100, sent  # nothing changed: headers only
    assert sent[4] == whole and sent[6] == whole, sent  # after a failure, after a full push
    corrupted = [main[9], other[8]]
    for e in corrupted:
        assert "the targets do not hold what the sources have" in e.get("error", ""), e
        assert "model.layers.1.mlp.down_proj.weight" in e["error"], e
        assert "first differing element [0, 0]" in e["error"], e
        assert "on target engine 0 worker 1 (target rank 1" in e["error"], e
    assert "error" not in main[8] and "error" not in main[10], (main[8], main[10])


def check_adamw_steps(entries, whole, compared, altered_at=None):
    """The AdamW steps' results of every trainer process (``entries``; those owning an engine
    hold its tokens and digests): each push a verified delta that sends a small part of
    ``whole`` (the push of step 0, and the one after a failed push, whole), the engines serving
    transformers' tokens of the last weights pushed and every worker bit-equal to a full push
    of them after each of the ``compared`` steps compared; the push after ``altered_at`` caught
    by its verify on every process."""
    changed = entries[0]["changed"]
    print("bf16 elements changed per AdamW step (%):", [round(100 * c, 2) for c in changed])
    assert all(0 < c < 0.1 for c in changed), changed
    for entry in entries:
        assert entry["changed"] == changed
        for k, (error, sent) in enumerate(zip(entry["errors"], entry["sent"])):
            if k == altered_at:
                assert "the targets do not hold what the sources have" in error, error
                assert "on target engine 0 worker 1 (target rank 1" in error, error
                continue
            assert error is None, (k, error)
            if k > 0 and k - 1 != altered_at:  # a delta against the last push
                assert sent < whole[entry is not entries[0]] // 4, (k, sent, whole)
        assert entry["step_tokens"] == entry["expected"]
        if entry["step_tokens"]:  # a process owning an engine
            assert entry["differ"] == [[]] * compared, entry["differ"]
    assert any(entry["step_tokens"] for entry in entries)


def test_ten_adamw_steps_delta_pushed_equal_full_pushes(delta_session):
    """Ten AdamW steps of a bf16 model, each delta-pushed with verify: after every step each
    worker of the engine holds bit-for-bit what a full push of the same weights leaves (digests
    of every served tensor) and each delta sent under a quarter of a whole push (the changed
    elements); after the last the engine gives transformers' greedy tokens of the trained
    weights. A
    worker's delta copy altered behind the sync's back (the state the next delta applies to)
    fails that push's verify on every trainer process, naming the worker; the next push is
    whole by itself and lands."""
    main, other = delta_session
    whole = (main[1]["stats"]["bytes_sent_here"], other[0]["stats"]["bytes_sent_here"])
    check_adamw_steps([main[-1], other[-1]], whole, 10, ALTERED_AT)
    # The push after the caught one was whole on both processes.
    for entry, w in zip((main[-1], other[-1]), whole):
        assert entry["sent"][ALTERED_AT + 1] == w, entry["sent"]


def test_ten_adamw_steps_delta_pushed_into_two_engines(fleet):
    """The ten AdamW steps delta-pushed with verify into two engines (at TP 2 and TP 1, one
    owned by each trainer process) through the sync schedule, the engines relaying the changes:
    every push proven on every worker of both engines by its verify; after the last, every
    worker holds bit-for-bit what a full push leaves, and each engine gives transformers' tokens
    of the trained weights."""
    steps = [_step(run, "ten AdamW steps") for run in fleet]
    whole = tuple(_step(run, "A after the add")["stats"]["bytes_sent_here"] for run in fleet)
    check_adamw_steps(steps, whole, 1)
    assert all(step["step_tokens"] for step in steps)  # each process owns an engine
