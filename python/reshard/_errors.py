"""The exceptions reshard raises. Their messages are the library's, as the CLI prints them;
`code` is the status code's name (``"INVALID_ARGUMENT"``, ``"FAILED_PRECONDITION"``, ...).
A missing file is FileNotFoundError."""

from __future__ import annotations


class ReshardError(Exception):
    """Base of reshard's own exceptions."""

    code: str = "UNKNOWN"


class MapError(ReshardError, ValueError):
    """A param map, map document or plan that is malformed or breaks an invariant."""


class CheckpointError(ReshardError):
    """A checkpoint that cannot be read, written or converted as asked."""


class DegreeError(ReshardError, ValueError):
    """A model config the degree planner cannot read."""


class LayoutError(ReshardError, ValueError):
    """A trainer's tensor whose layout no param map can describe (a DTensor with a ``Partial``
    placement holds addends, not elements of F), or layouts that disagree between processes."""

    code = "INVALID_ARGUMENT"
