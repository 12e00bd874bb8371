"""reshard.plan_sync: the schedule of a weight sync from a trainer into many inference engines
on a cluster, and its simulation (the report `reshard sync-plan --json` prints)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from . import _core
from ._errors import MapError

JsonSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]


@dataclass(frozen=True)
class SyncLink:
    """One direction of one link of the topology (``"n0:3 nvlink out"``, ``"n1 nic in"``) and
    what the sync puts on it: ``bytes`` at ``bandwidth_gbps`` GB/s take ``seconds``."""

    name: str
    bandwidth_gbps: float
    bytes: int
    seconds: float

    @classmethod
    def _of(cls, d: Mapping[str, Any]) -> SyncLink:
        return cls(str(d["name"]), float(d["bandwidth_gbps"]), int(d["bytes"]),
                   float(d["seconds"]))


@dataclass(frozen=True)
class SyncPlan:
    """The plan of one weight sync and its simulation, as :func:`plan_sync` returns it.

    ``one_copy_bytes`` is one copy of the model on the wire, ``trainer_egress_bytes`` what
    leaves the trainer's processes (one copy when each byte leaves once), ``total_bytes`` what
    all links carry. ``links`` maps each used link's name to its bytes, the busiest first (its
    bytes over its bandwidth); ``link_details`` gives the same links with bandwidth and
    seconds, ``busiest_link`` the first of them (None when nothing moves). ``lower_bound_s`` is
    the busiest link's seconds, ``predicted_s`` the simulated time of the schedule, in
    ``rounds`` rounds of ``num_transfers`` transfers; ``planning_s`` what planning took.

    With ``transfers=True`` the schedule a runtime executes is set too: ``transfers`` (each
    ``[round, from, to, bytes, tensor, step, move, [dependencies]]``), ``processes`` (each
    process's ``host:gpu``), ``tensor_names`` and ``tensor_plans``; otherwise they are None.

    :meth:`json` is the report ``reshard sync-plan --json`` prints, :meth:`to_dict` that
    report parsed."""

    trainer_ranks: int
    engines: tuple[int, ...]
    hosts: int
    tensors: int
    one_copy_bytes: int
    trainer_egress_bytes: int
    total_bytes: int
    num_transfers: int
    rounds: int
    lower_bound_s: float
    predicted_s: float
    predicted_over_lower_bound: float
    planning_s: float
    busiest_link: Optional[SyncLink]
    links: Mapping[str, int]
    link_details: tuple[SyncLink, ...]
    transfers: Optional[list[list[Any]]] = None
    processes: Optional[list[str]] = None
    tensor_names: Optional[list[str]] = None
    tensor_plans: Optional[list[dict[str, Any]]] = None
    _text: str = field(default="", repr=False, compare=False)
    _report: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, text: str) -> SyncPlan:
        """A plan from the text ``reshard sync-plan --json`` prints."""
        r: dict[str, Any] = json.loads(text)
        details = tuple(SyncLink._of(link) for link in r["links"])
        busiest = r["busiest_link"]
        return cls(
            trainer_ranks=int(r["trainer_ranks"]), engines=tuple(int(e) for e in r["engines"]),
            hosts=int(r["hosts"]), tensors=int(r["tensors"]),
            one_copy_bytes=int(r["one_copy_bytes"]),
            trainer_egress_bytes=int(r["trainer_egress_bytes"]),
            total_bytes=int(r["total_bytes"]), num_transfers=int(r["num_transfers"]),
            rounds=int(r["rounds"]), lower_bound_s=float(r["lower_bound_s"]),
            predicted_s=float(r["predicted_s"]),
            predicted_over_lower_bound=float(r["predicted_over_lower_bound"]),
            planning_s=float(r["planning_s"]),
            busiest_link=None if busiest is None else SyncLink._of(busiest),
            links={link.name: link.bytes for link in details}, link_details=details,
            transfers=r.get("transfers"), processes=r.get("processes"),
            tensor_names=r.get("tensor_names"), tensor_plans=r.get("tensor_plans"),
            _text=text, _report=r)

    def json(self) -> str:
        """The report as JSON text, as ``reshard sync-plan --json`` prints it."""
        return self._text

    def to_dict(self) -> dict[str, Any]:
        """The report as a dict (a copy: changing it leaves the plan as it is)."""
        return copy.deepcopy(dict(self._report))


# The most engines one plan takes, as `reshard sync-plan --engines` (and any degree).
_MAX_ENGINES = 1 << 16


def _json_text(source: JsonSource, what: str) -> str:
    """A dict as JSON, or the text of the file at a path, read as the CLI reads it (a FIFO
    nobody writes is refused at once, never waited on)."""
    if isinstance(source, Mapping):
        return json.dumps(source)
    if not isinstance(source, (str, os.PathLike)):
        raise MapError(f"{what}: expected a path or a dict, got {type(source).__name__}")
    path = os.fspath(source)
    if not isinstance(path, str):
        raise MapError(f"{what}: expected a path or a dict, got {type(path).__name__}")
    if "\0" in path:
        raise MapError(f"{what}: embedded null byte in path {path!r}")
    data: bytes = _core.read_text_file(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MapError(f"{what} \"{path}\": not UTF-8 text ({e.reason} at byte {e.start})") from None


def _count(value: object, what: str) -> int:
    """An integer from 1 to 65536 (a bool is no count), or MapError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_ENGINES:
        raise MapError(f"{what}: expected an integer from 1 to {_MAX_ENGINES}, got {value!r}")
    return value


def _grid(trainer: Union[str, Mapping[str, int]]) -> str:
    if isinstance(trainer, str):
        return trainer
    if not isinstance(trainer, Mapping):
        raise MapError(f"trainer: expected \"tp=..,pp=..,ep=..\" or a dict, got {trainer!r}")
    for k, v in trainer.items():
        _count(v, f"trainer[{k!r}]")
    return ",".join(f"{k}={v}" for k, v in trainer.items())


def plan_sync(topology: JsonSource, *, config: Optional[JsonSource] = None,
              trainer: Union[None, str, Mapping[str, int]] = None,
              engines: Optional[int] = None,
              engine_tp: Union[None, int, Sequence[int]] = None,
              source: Optional[JsonSource] = None,
              targets: Optional[Sequence[JsonSource]] = None,
              dtype: str = "BF16", transfers: bool = False) -> SyncPlan:
    """Plan the sync of a trainer's weights into inference engines on the machines of
    ``topology`` (a topology JSON path or dict: hosts, GPUs, NVLink and NIC bandwidths,
    placement; see docs/user-guide.md) and simulate it.

    The layouts come either from a model's ``config`` (a config.json path or dict) with the
    trainer's grid ``trainer`` ("tp=8,pp=8,ep=8" or ``{"tp": 8, "pp": 8, "ep": 8}``) and the
    engines' tensor-parallel degree ``engine_tp`` (one for all ``engines``, or one per engine),
    or from map documents: ``source`` over the trainer's ranks and one of ``targets`` per
    engine. ``dtype`` is the element type on the wire (with a config, "BF16" or "F8_E4M3" for
    block-quantized FP8 with its scales).

    Returns a :class:`SyncPlan`: bytes out of the trainer and one copy of the model, bytes per
    link, the busiest link, the lower bound (its bytes over its bandwidth), the predicted
    seconds, rounds; with ``transfers``, the schedule a runtime executes: every transfer as
    ``[round, from, to, bytes, tensor, step, move, [dependencies]]``, the processes' slots, the
    tensor names and each tensor's steps and plans (``tensor_plans``). Its :meth:`SyncPlan.json`
    is the report `reshard sync-plan --json` prints, :meth:`SyncPlan.to_dict` that report as a
    dict. Raises MapError for a malformed topology (naming the JSON path), layouts that do not
    fit it, a model that cannot be split as asked, or an argument of the wrong kind (naming it:
    ``engines`` and each degree are integers from 1 to 65536, as the CLI takes them);
    FileNotFoundError for a missing file. Paths are read as the CLI reads them: a FIFO nobody
    writes is refused at once."""
    if config is not None:
        if source is not None or targets is not None:
            raise MapError("config lays out both sides: give no source or targets with it")
        if trainer is None or engine_tp is None:
            raise MapError("a config needs trainer and engine_tp")
        if engines is not None:
            _count(engines, "engines")
        if isinstance(engine_tp, (str, bytes)) or not isinstance(engine_tp, (int, Sequence)):
            raise MapError(f"engine_tp: expected an integer or a list of them, got {engine_tp!r}")
        tps = [engine_tp] if isinstance(engine_tp, int) else list(engine_tp)
        if not 1 <= len(tps) <= _MAX_ENGINES:
            raise MapError(f"engine_tp: expected 1 to {_MAX_ENGINES} degrees, got {len(tps)}")
        for i, t in enumerate(tps):
            _count(t, "engine_tp" if isinstance(engine_tp, int) else f"engine_tp[{i}]")
        if engines is not None:
            if len(tps) == 1:
                tps = tps * engines
            elif len(tps) != engines:
                raise MapError(f"engine_tp gives {len(tps)} degrees for {engines} engines")
        grid = _grid(trainer)
        topology_json = _json_text(topology, "topology")
        text = _core.plan_sync(topology_json, _json_text(config, "config"), grid, tps, None, [],
                               dtype, transfers)
    else:
        if source is None or not targets:
            raise MapError("give a config, or a source and one target per engine")
        if trainer is not None or engine_tp is not None or engines is not None:
            raise MapError("trainer, engines and engine_tp go with a config")
        if len(targets) > _MAX_ENGINES:
            raise MapError(f"targets: at most {_MAX_ENGINES} engines, got {len(targets)}")
        topology_json = _json_text(topology, "topology")
        text = _core.plan_sync(topology_json, None, None, [], _json_text(source, "source"),
                               [_json_text(t, f"targets[{i}]") for i, t in enumerate(targets)],
                               dtype, transfers)
    return SyncPlan.from_json(text)
