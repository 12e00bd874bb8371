"""reshard.diff: two checkpoints compared tensor by tensor, as ``reshard diff`` compares them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from . import _core
from .checkpoint import _path

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TensorDifference:
    """One tensor that differs between A and B.

    ``kind`` is ``"missing"`` (A holds it, B does not), ``"extra"`` (B holds it, A does not),
    ``"dtype"``, ``"shape"`` (valid shapes) or ``"value"``. For ``"value"``, ``index`` is the
    first differing element in the full tensor's row-major order (a flat index), ``multi_index``
    the same as one index per dimension, and ``value_a`` / ``value_b`` the two elements as text
    (``"0.25"``; FP8 as its bit pattern). What a side lacks is None."""

    name: str
    kind: str
    dtype_a: Optional[str]
    dtype_b: Optional[str]
    shape_a: Optional[tuple[int, ...]]
    shape_b: Optional[tuple[int, ...]]
    index: Optional[int] = None
    multi_index: Optional[tuple[int, ...]] = None
    value_a: Optional[str] = None
    value_b: Optional[str] = None


@dataclass(frozen=True)
class DiffReport:
    """What :func:`reshard.diff` found: every difference (A's tensors in A's order, then B's
    extras), and how many tensors both hold and how many of their elements were compared."""

    differences: tuple[TensorDifference, ...]
    tensors_compared: int
    elements_compared: int

    @property
    def equal(self) -> bool:
        """No difference: the same tensors, bit for bit (or within the tolerance)."""
        return not self.differences


def _shape(shape: Optional[list[int]]) -> Optional[tuple[int, ...]]:
    return None if shape is None else tuple(shape)


def _tolerance(value: Optional[float], what: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


def diff(a: PathLike, b: PathLike, *, atol: Optional[float] = None,
         rtol: Optional[float] = None, dequantize: Union[bool, str] = False,
         config: Optional[PathLike] = None) -> DiffReport:
    """Compare checkpoint ``a`` with checkpoint ``b`` tensor by tensor, in any formats reshard
    reads and any layouts, without building any full tensor (``reshard diff``).

    Without ``atol`` / ``rtol`` every element must be bit-identical and dtypes equal; with
    either, elements agree when ``|a - b| <= atol + rtol * |b|`` (two NaNs, or equal
    infinities, agree) and tensors of different dtypes are compared by value. ``dequantize``
    (True for bf16, or ``"bf16"``, ``"fp16"``, ``"fp32"``) reads each side's block-quantized
    tensors as numbers, as ``gather(dequantize=...)`` writes them; a side without any is read
    as it is. ``config`` (a model's config.json) is given to a side whose format needs one (a
    Megatron-Core dist-ckpt). Raises :class:`reshard.CheckpointError` (or FileNotFoundError) for an input that
    cannot be read, ValueError for a negative tolerance or an unknown dtype."""
    if dequantize is True:
        mode: Optional[str] = "bf16"
    elif dequantize is False or dequantize is None:
        mode = None
    elif isinstance(dequantize, str):
        mode = dequantize
    else:
        raise TypeError(f"dequantize must be a bool or a dtype name, got {dequantize!r}")
    tensors, elements, found = _core.diff(
        _path(a, "a"), _path(b, "b"), _tolerance(atol, "atol"),
        _tolerance(rtol, "rtol"), mode, None if config is None else _path(config, "config"))
    differences = tuple(
        TensorDifference(name, kind, dtype_a, dtype_b, _shape(shape_a), _shape(shape_b), index,
                         _shape(multi_index), value_a, value_b)
        for (name, kind, dtype_a, dtype_b, shape_a, shape_b, index, multi_index, value_a,
             value_b) in found)
    return DiffReport(differences, tensors, elements)


__all__ = ["DiffReport", "TensorDifference", "diff"]
