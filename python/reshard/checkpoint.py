"""Checkpoints on disk, as the CLI's scatter, gather, convert and inspect (DESIGN 6.5, 7).

Outputs appear atomically; an existing output is replaced only with ``overwrite=True`` (the
CLI's ``--force``). They are flushed to disk before they appear; ``sync=False`` (the CLI's
``--no-sync``) leaves them in the page cache, still appearing by one rename.
``progress(done_bytes, total_bytes)`` is called after each tensor.
Errors raise :class:`reshard.CheckpointError` with the CLI's message (FileNotFoundError for a
missing input).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional, Union

from . import _core
from ._maps import MapLike, as_map, read_maps

PathLike = Union[str, "os.PathLike[str]"]
Progress = Callable[[int, int], None]
Warn = Callable[[str, str], None]


def _options(overwrite: bool, max_shard_size: Union[None, int, str], verify_replicas: bool,
             allow_scaled_optimizer_state: bool, allow_lossy_scale: bool,
             progress: Optional[Progress], warn: Optional[Warn],
             sync: bool) -> _core.CheckpointOptions:
    o = _core.CheckpointOptions()
    o.overwrite = overwrite
    o.sync = sync
    if isinstance(max_shard_size, str):
        o.max_shard_bytes = _core.parse_byte_size(max_shard_size)
    elif max_shard_size is not None:
        o.max_shard_bytes = int(max_shard_size)
    o.verify_replicas = verify_replicas
    o.allow_scaled_optimizer_state = allow_scaled_optimizer_state
    o.allow_lossy_scale = allow_lossy_scale
    o.progress = progress
    o.warn = warn
    return o


def _map_list(maps: Union[PathLike, Mapping[str, MapLike]]) -> list[tuple[str, Any]]:
    if isinstance(maps, Mapping):
        return [(name, as_map(m)._handle) for name, m in maps.items()]
    return [(name, m._handle) for name, m in read_maps(maps).items()]


def _read_text(source: Union[PathLike, Mapping[str, Any]]) -> str:
    if isinstance(source, Mapping):
        return json.dumps(source)
    with open(source, encoding="utf-8") as f:
        return f.read()


def scatter(full_dir: PathLike, out_dir: PathLike, *,
            maps: Union[None, PathLike, Mapping[str, MapLike]] = None,
            layouts: Union[None, PathLike, Mapping[str, Any]] = None,
            config: Union[None, PathLike, Mapping[str, Any]] = None, tp: Optional[int] = None,
            overwrite: bool = False, max_shard_size: Union[None, int, str] = None,
            allow_scaled_optimizer_state: bool = False, allow_lossy_scale: bool = False,
            progress: Optional[Progress] = None, warn: Optional[Warn] = None,
            sync: bool = True) -> None:
    """Full checkpoint -> sharded checkpoint, by ``maps`` ({name: ParamMap} or a map document
    path), by ``layouts`` (a layouts document: path or dict) at ``tp`` ranks, or by a model's
    ``config`` (config.json path or dict) at ``tp`` ranks."""
    given = [k for k, v in (("maps", maps), ("layouts", layouts), ("config", config)) if v is not None]
    if len(given) != 1:
        raise ValueError("scatter needs exactly one of maps=, layouts= (with tp=) or config= "
                         f"(with tp=); given: {given or 'none'}")
    o = _options(overwrite, max_shard_size, True, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    src, dst = os.fspath(full_dir), os.fspath(out_dir)
    if maps is not None:
        _core.scatter_with_maps(src, dst, _map_list(maps), o)
        return
    if tp is None or tp < 1:
        raise ValueError(f"scatter with {given[0]}= needs tp= (a world size of at least 1)")
    if layouts is not None:
        _core.scatter_with_layouts(src, dst, _read_text(layouts), tp, o)
    else:
        assert config is not None
        _core.scatter_with_config(src, dst, _read_text(config), tp, o)


def gather(sharded_dir: PathLike, out_dir: PathLike, *, overwrite: bool = False,
           max_shard_size: Union[None, int, str] = None, verify_replicas: bool = True,
           allow_scaled_optimizer_state: bool = False, allow_lossy_scale: bool = False,
           progress: Optional[Progress] = None, warn: Optional[Warn] = None,
           sync: bool = True) -> None:
    """Sharded checkpoint -> full checkpoint (model.safetensors, or parts of at most
    ``max_shard_size`` and an index), checking that replicas agree, dropping padding."""
    o = _options(overwrite, max_shard_size, verify_replicas, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    _core.gather(os.fspath(sharded_dir), os.fspath(out_dir), o)


def convert(sharded_dir: PathLike, out_dir: PathLike, *, tp: int,
            target_maps: Union[None, PathLike, Mapping[str, MapLike]] = None,
            overwrite: bool = False, max_shard_size: Union[None, int, str] = None,
            verify_replicas: bool = True, allow_scaled_optimizer_state: bool = False,
            allow_lossy_scale: bool = False, progress: Optional[Progress] = None,
            warn: Optional[Warn] = None, sync: bool = True) -> None:
    """Sharded checkpoint -> sharded checkpoint at ``tp`` ranks through transfer plans, never
    building a full tensor. Target maps come from ``target_maps`` or from the layouts the
    manifest records."""
    o = _options(overwrite, max_shard_size, verify_replicas, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    targets = None if target_maps is None else _map_list(target_maps)
    _core.convert(os.fspath(sharded_dir), tp, os.fspath(out_dir), targets, o)


def inspect(path: PathLike) -> dict[str, Any]:
    """What ``reshard inspect --json`` reports: the tensors (name, dtype, shape) and structure
    of a .pt, .safetensors, reshard or DeepSpeed checkpoint. Nothing is loaded: only headers,
    manifests and pickles are read. Raises FileNotFoundError for a missing path and
    CheckpointError (the CLI's message) for a file that is corrupt or of no known format."""
    result: dict[str, Any] = json.loads(_core.inspect(os.fspath(path), True))
    return result


__all__ = ["convert", "gather", "inspect", "scatter"]
