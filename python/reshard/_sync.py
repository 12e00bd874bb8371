"""reshard.plan_sync: the schedule of a weight sync from a trainer into many inference engines
on a cluster, and its simulation (the report `reshard sync-plan --json` prints)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from . import _core
from ._degree import _json_text

JsonSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]


def _grid(trainer: Union[str, Mapping[str, int]]) -> str:
    if isinstance(trainer, str):
        return trainer
    return ",".join(f"{k}={v}" for k, v in trainer.items())


def plan_sync(topology: JsonSource, *, config: Optional[JsonSource] = None,
              trainer: Union[None, str, Mapping[str, int]] = None,
              engines: Optional[int] = None,
              engine_tp: Union[None, int, Sequence[int]] = None,
              source: Optional[JsonSource] = None,
              targets: Optional[Sequence[JsonSource]] = None,
              dtype: str = "BF16", transfers: bool = False) -> dict[str, Any]:
    """Plan the sync of a trainer's weights into inference engines on the machines of
    ``topology`` (a topology JSON path or dict: hosts, GPUs, NVLink and NIC bandwidths,
    placement; see docs/user-guide.md) and simulate it.

    The layouts come either from a model's ``config`` (a config.json path or dict) with the
    trainer's grid ``trainer`` ("tp=8,pp=8,ep=8" or ``{"tp": 8, "pp": 8, "ep": 8}``) and the
    engines' tensor-parallel degree ``engine_tp`` (one for all ``engines``, or one per engine),
    or from map documents: ``source`` over the trainer's ranks and one of ``targets`` per
    engine. ``dtype`` is the element type on the wire (with a config, "BF16" or "F8_E4M3" for
    block-quantized FP8 with its scales).

    Returns the report `reshard sync-plan --json` prints: bytes out of the trainer and one
    copy of the model, bytes per link, the busiest link, the lower bound (its bytes over its
    bandwidth), the predicted seconds, rounds; with ``transfers``, the schedule a runtime
    executes: every transfer as ``[round, from, to, bytes, tensor, step, move, [dependencies]]``,
    the processes' slots, the tensor names and each tensor's steps and plans
    (``tensor_plans``). Raises MapError for a malformed topology (naming the JSON path), layouts that do not
    fit it, or a model that cannot be split as asked; FileNotFoundError for a missing file."""
    topology_json = _json_text(topology)
    if config is not None:
        if source is not None or targets is not None:
            raise ValueError("config lays out both sides: give no source or targets with it")
        if trainer is None or engine_tp is None:
            raise ValueError("a config needs trainer and engine_tp")
        tps = [engine_tp] if isinstance(engine_tp, int) else list(engine_tp)
        if engines is not None:
            if len(tps) == 1:
                tps = tps * engines
            elif len(tps) != engines:
                raise ValueError(f"engine_tp gives {len(tps)} degrees for {engines} engines")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
            raise ValueError(f"engine_tp must be positive integers, not {engine_tp!r}")
        text = _core.plan_sync(topology_json, _json_text(config), _grid(trainer), tps, None, [],
                               dtype, transfers)
    else:
        if source is None or not targets:
            raise ValueError("give a config, or a source and one target per engine")
        if trainer is not None or engine_tp is not None or engines is not None:
            raise ValueError("trainer, engines and engine_tp go with a config")
        text = _core.plan_sync(topology_json, None, None, [], _json_text(source),
                               [_json_text(t) for t in targets], dtype, transfers)
    report: dict[str, Any] = json.loads(text)
    return report
