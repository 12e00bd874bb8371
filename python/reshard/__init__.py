"""reshard: affine maps of tensor-parallel shards.

The compiled core works on raw buffers (any object with the buffer protocol, C-contiguous)
and param maps given as JSON text (DESIGN 6.1); see ``reshard._core`` for the functions.
"""

from ._core import (  # noqa: F401
    MapError,
    canonical_json,
    canonicalize,
    compose,
    extract,
    infer,
    read_safetensors,
    rebuild,
    safetensors_metadata,
    transfer,
    validate,
    write_safetensors,
)

__all__ = ["MapError", "canonical_json", "canonicalize", "compose", "extract", "infer",
           "read_safetensors", "rebuild", "safetensors_metadata", "transfer", "validate",
           "write_safetensors"]
