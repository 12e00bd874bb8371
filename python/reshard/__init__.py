"""reshard: re-shard tensor-parallel weights by affine maps.

A :class:`ParamMap` says which elements of a parameter's full tensor F each rank's shard
holds (DESIGN 6.1; DeepSpeed's ``ParamAffineMap.to_dict()`` form reads too). With it:

- :func:`extract` F -> one rank's shard, :func:`rebuild` shards -> F;
- :func:`compose` two maps -> a :class:`Plan`, and :func:`transfer` runs it shard -> shard
  without building F;
- a :class:`BufferSet` declares rank tensors that hold pieces of many checkpoint tensors (an
  MoE layer's fused experts, a fused QKV: DESIGN 16) and checks them with the maps over them;
- :mod:`reshard.checkpoint` does the same for whole checkpoints on disk (the CLI's scatter,
  gather, convert, inspect), :func:`diff` compares two checkpoints in any formats and layouts
  tensor by tensor, and :func:`degree` answers which tensor-parallel degrees a model's
  config.json allows; :func:`plan_sync` plans and simulates a weight sync from a trainer into
  many inference engines on a cluster.

Tensors are ``torch.Tensor`` or ``numpy.ndarray`` in host memory, of any dtype reshard knows
(bf16 and fp8 included), with any strides; results are of the kind given, and ``out=`` writes
in place. Copies release the GIL. The ``reshard`` command (also ``python -m reshard``) is the
CLI.
"""

from ._errors import CheckpointError, DegreeError, LayoutError, MapError, ReshardError
from . import _core

_core.register_errors(MapError, CheckpointError, DegreeError)

from ._maps import Move, ParamMap, Piece, Plan, compose, infer, maps_to_json, read_maps  # noqa: E402
from ._tensors import extract, rebuild, transfer  # noqa: E402
from ._buffers import Block, Buffer, BufferSet, read_buffers  # noqa: E402
from ._degree import DegreeConstraint, DegreeReport, degree  # noqa: E402
from ._sync import SyncLink, SyncPlan, plan_sync  # noqa: E402
from ._diff import DiffReport, TensorDifference, diff  # noqa: E402
from . import checkpoint  # noqa: E402

__version__: str = _core.__version__

__all__ = [
    "Block", "Buffer", "BufferSet", "read_buffers",
    "CheckpointError", "DegreeConstraint", "DiffReport", "DegreeError", "DegreeReport", "LayoutError",
    "MapError", "Move",
    "ParamMap", "Piece", "Plan", "ReshardError", "SyncLink", "SyncPlan", "__version__", "checkpoint",
    "TensorDifference", "compose", "degree", "diff",
    "extract", "infer", "maps_to_json", "plan_sync", "read_maps", "rebuild", "transfer",
]
