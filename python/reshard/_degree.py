"""The degree planner (DESIGN 8): which tensor-parallel degrees a model's config.json allows."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from . import _core


@dataclass(frozen=True)
class DegreeConstraint:
    """A plan entry that splits something the degree must divide: ``count`` ``meaning``
    (e.g. 32 "attention heads") of ``module``, split in ``style``."""

    module: str
    style: str
    count: int
    meaning: str


@dataclass(frozen=True)
class DegreeReport:
    """The answer (the fields of ``reshard degree --json``). ``refusal`` (a reason such as
    ``"degree_does_not_divide"`` and a message naming the constraint) is set when the model
    cannot be split as asked; ``ok`` is then False."""

    max_tp_degree: Optional[int]
    degrees: list[int]
    requested: Optional[int]
    chosen: Optional[int]
    constraints: list[DegreeConstraint]
    refusal_reason: Optional[str] = None
    refusal: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.refusal is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``reshard degree --json`` prints."""
        return {
            "max_tp_degree": self.max_tp_degree, "degrees": list(self.degrees),
            "requested": self.requested, "chosen": self.chosen,
            "constraints": [vars(c).copy() for c in self.constraints],
            "refusal": None if self.refusal is None
            else {"reason": self.refusal_reason, "message": self.refusal},
        }


def _json_text(source: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> str:
    """A dict as JSON, or the text of the JSON file at a path."""
    if isinstance(source, Mapping):
        return json.dumps(source)
    with open(source, encoding="utf-8") as f:
        return f.read()


def degree(config_or_path: Union[str, os.PathLike[str], Mapping[str, Any]],
           tp: Optional[int] = None, engine: str = "transformers", *,
           transformers_version: Optional[str] = None,
           distributed_config: Union[None, str, os.PathLike[str], Mapping[str, Any]] = None
           ) -> DegreeReport:
    """The degrees a model supports, decided from its config (a config.json path, or the
    config as a dict) before any weight is read. With ``tp``, the verdict on that degree.
    ``engine`` is "transformers" or "vllm".

    ``distributed_config`` is transformers' ``DistributedConfig`` (the object itself, its
    ``to_dict()``, or a path to it as JSON): its ``tp_size`` is the degree asked for when
    ``tp`` is not given (the two must agree when both are), expert parallelism
    (``enable_expert_parallel``, ``ep_size`` > 1) answers for the model's expert-parallel
    plan, and ``tp_plan`` / ``ep_plan`` override the model's entries. Unknown keys are refused.

    Raises DegreeError for a config or distributed config the planner cannot read,
    FileNotFoundError for a missing file."""
    text = _json_text(config_or_path)
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"tp must be a positive integer, not {tp!r}")
    distributed = None
    if distributed_config is not None:
        to_dict = getattr(distributed_config, "to_dict", None)
        distributed = _json_text(to_dict() if callable(to_dict) else distributed_config)
    d = _core.degree(text, tp, engine, transformers_version, distributed)
    refusal = d["refusal"]
    return DegreeReport(
        max_tp_degree=d["max_tp_degree"], degrees=list(d["degrees"]), requested=d["requested"],
        chosen=d["chosen"], constraints=[DegreeConstraint(**c) for c in d["constraints"]],
        refusal_reason=refusal[0] if refusal else None, refusal=refusal[1] if refusal else None,
        notes=list(d["notes"]))
