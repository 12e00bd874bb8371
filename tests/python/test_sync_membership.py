"""Engines that come and go in a live weight sync (DESIGN 18), the trainer's side without vLLM:
a membership change refuses what is not an engine of its own, or an engine the sync has
already, before any engine is touched; it is refused at once while a push runs on another
thread (and refuses a push asked for while it runs); processes making different calls of the
sync at once are refused on every one of them; an engine added whose model the plan refuses
leaves the others joined; a closed sync refuses everything; an engine that never answers an
RPC is given up after the sync's timeout."""

import threading
import time

import pytest

import conftest  # noqa: F401  (the build's package on the path)

torch = pytest.importorskip("torch")


class FakeLLM:
    """What the sync reads of a vllm.LLM before an engine joins: its RPCs, which here never
    return when ``hang`` is set (an engine whose worker is stopped)."""

    def __init__(self, hang=None):
        self.hang = hang
        self.calls = []

    def init_weight_transfer_engine(self, body):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")
        if self.hang is not None:
            self.hang.wait()


def _sync(monkeypatch, handles, joins=None):
    """A WeightSync of one trainer process over the engines ``handles`` (by number), its
    group's joins recorded in ``joins`` (each the engine numbers joined) instead of made; a
    join raises what ``joins`` holds as an exception at that position."""
    from reshard.vllm.sync import WeightSync
    sync = WeightSync.__new__(WeightSync)
    sync._guard, sync._in_push, sync._overlapped = threading.Lock(), False, False
    sync._busy, sync._lost = "a push", None
    sync._rank, sync._trainers = 0, 1
    sync._ids = sorted(handles)
    sync._handles = dict(handles)
    sync._driver_by_id = {i: 0 for i in handles}
    sync._next_id = max(handles) + 1
    sync._added_targets, sync._topology = {}, "given"
    sync._comms, sync._comm, sync._clients = [], None, {}
    sync._source, sync._options, sync._stages = None, {"quantize": None}, []
    sync._overlap = None
    made = [] if joins is None else joins

    def join(problem=None, drop=False):
        made.append(list(sync._ids))
        if len(made) <= len(outcomes) and isinstance(outcomes[len(made) - 1], Exception):
            raise outcomes[len(made) - 1]
        return []
    outcomes = []
    monkeypatch.setattr(sync, "_join", join)
    return sync, made, outcomes


def test_an_engine_the_sync_has_or_not_an_engine_is_refused_before_any_join(monkeypatch):
    from reshard.vllm import WeightSyncError
    llm = FakeLLM()
    sync, joins, _ = _sync(monkeypatch, {0: llm, 1: "http://127.0.0.1:8000/"})
    with pytest.raises(WeightSyncError, match="add_engine\\(\\) was given engine 0, which the "
                                              "sync has already \\(trainer process 0\\)"):
        sync.add_engine(llm)
    with pytest.raises(WeightSyncError, match="was given engine 1, which the sync has already"):
        sync.add_engine("http://127.0.0.1:8000")
    for wrong, kind in ((42, "int"), ({}, "dict"), (b"http://x", "bytes")):
        with pytest.raises(WeightSyncError, match="add_engine\\(\\) takes the engine's vllm.LLM, "
                                                  f"a server's URL or None, got {kind} "):
            sync.add_engine(wrong)
    with pytest.raises(WeightSyncError, match="was given no engine on any trainer process"):
        sync.add_engine(None)
    assert joins == [] and llm.calls == []
    assert sync.engine_ids == [0, 1] and sync._next_id == 2
    assert not sync._in_push  # the sync is free again
    other = FakeLLM()
    assert sync.add_engine(other) == 2 and sync.engine_ids == [0, 1, 2] and joins == [[0, 1, 2]]


def test_an_engine_added_after_adapter_pushes_is_said_to_lack_them(monkeypatch):
    """A request naming a pushed adapter on an engine that never received it ends that engine
    (vLLM reads the placeholder path): add_engine says which adapters it lacks."""
    sync, _, _ = _sync(monkeypatch, {0: FakeLLM()})
    assert sync.add_engine(FakeLLM()) == 1  # no adapter pushed: nothing said
    sync._adapters = {"policy": None, "ref": None}
    with pytest.warns(RuntimeWarning, match="engine 2 serves none of the adapters pushed before "
                                            r"it joined \('policy', 'ref'\)"):
        assert sync.add_engine(FakeLLM()) == 2


def test_an_engine_whose_model_the_plan_refuses_leaves_the_others_joined(monkeypatch):
    """The plan of the new membership fails (the engine's model lacks the trainer's tensors,
    or shapes differ): the engine added is left out and the others join again, under the
    topology they had."""
    from reshard.vllm import WeightSyncError
    sync, joins, outcomes = _sync(monkeypatch, {0: FakeLLM(), 1: FakeLLM()})
    outcomes.append(WeightSyncError("engine 2 has no parameter for ['model.norm.weight']"))
    with pytest.raises(WeightSyncError, match="the engine added could not join: engine 2 has no "
                                              "parameter for .*; the sync goes on with engines "
                                              "\\[0, 1\\]"):
        sync.add_engine(FakeLLM(), topology={"hosts": []})
    assert joins == [[0, 1, 2], [0, 1]]
    assert sync.engine_ids == [0, 1] and sync._topology == "given" and sync._lost is None
    assert sync.add_engine(FakeLLM()) == 3  # numbers are never reused


def test_a_topology_that_does_not_hold_the_engines_left_leaves_them_joined(monkeypatch):
    """remove_engine(topology=...) whose topology the plan refuses: the engine has left, and
    the others join again placed by their host names; a join that fails without a topology
    makes the sync unusable, said at once rather than at the next push."""
    from reshard.vllm import WeightSyncError
    sync, joins, outcomes = _sync(monkeypatch, {0: FakeLLM(), 1: FakeLLM(), 2: FakeLLM()})
    outcomes.append(WeightSyncError("topology: placement.engines[1][0]: no host named \"x\""))
    with pytest.raises(WeightSyncError, match="engine 1 left the sync, but the topology given "
                                              r"does not hold the engines left \(topology: .*\); "
                                              "they joined again, placed by their host names: "
                                              r"engines \[0, 2\]"):
        sync.remove_engine(1, topology={"hosts": []})
    assert joins == [[0, 2], [0, 2]] and sync._topology is None and sync._lost is None
    outcomes += [None, WeightSyncError("the store is gone")]  # joins 2 and 3
    with pytest.raises(WeightSyncError, match="the engines left could not join again: the store "
                                              "is gone; build a new WeightSync"):
        sync.remove_engine(2)
    with pytest.raises(WeightSyncError, match="the engines left could not join again"):
        sync.push({})


def test_membership_changes_and_pushes_from_two_threads_refuse_each_other(monkeypatch):
    from reshard.vllm import WeightSyncError
    sync, _, _ = _sync(monkeypatch, {0: FakeLLM(), 1: FakeLLM()})
    sync._in_push = True  # a push running on another thread
    with pytest.raises(WeightSyncError, match="add_engine\\(\\) while a push of this WeightSync "
                                              "is in progress"):
        sync.add_engine(FakeLLM())
    with pytest.raises(WeightSyncError, match="remove_engine\\(\\) while a push"):
        sync.remove_engine(1)
    assert sync._overlapped  # the push, not agreed yet, is refused on every process
    sync._in_push, sync._overlapped = False, False
    seen = []

    def join(problem=None, drop=False):  # a push asked for while the membership changes
        try:
            sync.push({})
        except WeightSyncError as e:
            seen.append(str(e))
        return []
    monkeypatch.setattr(sync, "_join", join)
    sync.remove_engine(1)
    assert seen and seen[0].startswith("remove_engine() of this WeightSync is in progress (in "
                                       "another thread)"), seen
    assert sync.engine_ids == [0] and not sync._in_push


def test_processes_making_different_calls_are_refused_on_each():
    """One process removes an engine while the other pushes: the trainer group pairs their
    gathers; each sees the other's call and refuses, and their next calls pair up again."""
    from reshard.vllm.sync import PushClaim, _calls_differ
    claim = PushClaim(None, 3, {}, False)
    assert _calls_differ("push", [("push", (claim, {})), ("push", (claim, {}))]) is None
    text = ("the trainer processes made different calls of this WeightSync at once (process 0: "
            "remove_engine(), process 1: push()); nothing was changed")
    assert _calls_differ("remove_engine", [("remove_engine", 1), ("push", (claim, {}))]
                         ).startswith(text)
    assert _calls_differ("push", [("remove_engine", 1), ("push", (claim, {}))]).startswith(text)
    assert "process 1: another call" in _calls_differ("add_engine", [("add_engine", (True, None)),
                                                                     (None, "x", {})])


def test_an_adapter_push_and_an_engine_added_at_once_are_refused_on_each(monkeypatch):
    """push_lora() on one trainer process while the other adds an engine: push_lora's first
    gather is tagged as add_engine's is, so each process refuses with the same message and
    nothing is joined or planned (the other process's value is never read as its own)."""
    from reshard.vllm import WeightSyncError
    text = (r"the trainer processes made different calls of this WeightSync at once \(process "
            r"0: {}\(\), process 1: {}\(\)\); nothing was changed")
    sync, joins, _ = _sync(monkeypatch, {0: FakeLLM()})
    sync._trainers = 2
    monkeypatch.setattr(sync, "_trainer_gather",
                        lambda value: [value, ("add_engine", (True, None, None))])
    with pytest.raises(WeightSyncError, match=text.format("push_lora", "add_engine")):
        sync.push_lora("a", {"base_model.model.w.lora_A.weight": torch.ones(2, 4)},
                       config={"r": 2, "lora_alpha": 2, "target_modules": ["w"]})
    monkeypatch.setattr(sync, "_trainer_gather",
                        lambda value: [value, ("push_lora", (None, "a", {"r": 2}))])
    with pytest.raises(WeightSyncError, match=text.format("add_engine", "push_lora")):
        sync.add_engine(FakeLLM())
    assert joins == [] and sync.engine_ids == [0]


def test_a_closed_sync_refuses_every_call(monkeypatch):
    from reshard.vllm import WeightSyncError
    sync, joins, _ = _sync(monkeypatch, {0: FakeLLM(), 1: FakeLLM()})
    sync.close()
    for call in (lambda: sync.push({}), lambda: sync.verify({}),
                 lambda: sync.add_engine(FakeLLM()), lambda: sync.remove_engine(1)):
        with pytest.raises(WeightSyncError, match="this WeightSync was closed; build a new "
                                                  "WeightSync"):
            call()
    assert joins == [] and sync.engine_ids == [0, 1]
    sync.close()


def test_an_engine_that_never_answers_is_given_up_after_the_timeout():
    """vLLM's LLM RPCs have no timeout: an engine whose worker is stopped never answers. The
    sync's calls wait at most its timeout, then raise."""
    from reshard.vllm import WeightSyncError
    from reshard.vllm._client import _Client
    hang = threading.Event()
    llm = FakeLLM(hang)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="the engine did not answer start_weight_update "
                                              "within 0.3 s"):
        _Client(llm, 0.3).call("start_weight_update")
    assert time.monotonic() - start < 5
    hang.set()
    _Client(FakeLLM(), 0.3).call("start_weight_update")  # one that answers
    with pytest.raises(AttributeError):  # what the engine raises, as it raised it
        _Client(FakeLLM(), 0.3).call("no_such_rpc")
