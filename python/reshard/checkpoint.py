"""Checkpoints on disk, as the CLI's scatter, gather, convert and inspect (DESIGN 6.5, 7).

gather and convert read what the CLI's commands read: a reshard sharded checkpoint, or a
DeepSpeed checkpoint (a save dir with ``latest``, or a tag dir); convert also writes DeepSpeed's
universal checkpoint (``to="universal"``, the CLI's ``convert --to universal``).

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
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from . import _core
from ._buffers import BufferSet, read_buffers
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


def _map_list(maps: Union[PathLike, Mapping[str, MapLike], BufferSet]
              ) -> tuple[list[tuple[str, Any]], str]:
    """The maps as (name, handle) pairs, and their buffers' declarations as JSON ("" for none):
    from a BufferSet, a {name: map} mapping, or a map document's path (version 2: with its
    buffers)."""
    if isinstance(maps, BufferSet):
        return ([(name, m._handle) for name, m in maps.maps.items()],
                json.dumps(maps.to_dict()))
    if isinstance(maps, Mapping):
        return [(name, as_map(m)._handle) for name, m in maps.items()], ""
    buffers = read_buffers(maps)
    if buffers is not None:
        return _map_list(buffers)
    return [(name, m._handle) for name, m in read_maps(maps).items()], ""


def _dc_text(dc: Union[None, str, Mapping[str, Any]]) -> Optional[str]:
    """A distributed config (dict or JSON text) as JSON text."""
    if dc is None:
        return None
    if isinstance(dc, Mapping):
        return json.dumps(dict(dc))
    if not isinstance(dc, str):
        raise TypeError(f"distributed_config must be a dict or JSON text, got {type(dc).__name__}")
    return dc


def _path(path: PathLike, what: str) -> str:
    """The path as a str, refusing an embedded NUL as os does (the C library would stop at it
    and read another file)."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str or os.PathLike[str], got {type(text).__name__}")
    if "\0" in text:
        raise ValueError(f"{what}: embedded null byte in path {text!r}")
    return text


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
            sync: bool = True,
            distributed_config: Union[None, str, Mapping[str, Any]] = None) -> None:
    """Full checkpoint -> sharded checkpoint, by ``maps`` ({name: ParamMap}, a
    :class:`reshard.BufferSet`, or a map document path), by ``layouts`` (a layouts document:
    path or dict) at ``tp`` ranks, or by a model's ``config`` (config.json path or dict) at
    ``tp`` processes as transformers holds it there under ``distributed_config``
    (transformers' DistributedConfig as a dict or JSON text: ``{"tp_plan": "auto", "ep_size":
    tp}`` for expert parallelism; MoE experts are stacked into buffers as transformers
    stacks them)."""
    if distributed_config is not None and config is None:
        raise ValueError("distributed_config= goes with config=")
    given = [k for k, v in (("maps", maps), ("layouts", layouts), ("config", config)) if v is not None]
    if len(given) != 1:
        raise ValueError("scatter needs exactly one of maps=, layouts= (with tp=) or config= "
                         f"(with tp=); given: {given or 'none'}")
    o = _options(overwrite, max_shard_size, True, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    src, dst = _path(full_dir, "full_dir"), _path(out_dir, "out_dir")
    if maps is not None:
        _core.scatter_with_maps(src, dst, *_map_list(maps), o)
        return
    if tp is None or tp < 1:
        raise ValueError(f"scatter with {given[0]}= needs tp= (a world size of at least 1)")
    if layouts is not None:
        _core.scatter_with_layouts(src, dst, _read_text(layouts), tp, o)
    else:
        assert config is not None
        _core.scatter_with_config(src, dst, _read_text(config), tp,
                                  _dc_text(distributed_config), o)


def gather(sharded_dir: PathLike, out_dir: PathLike, *, fp32: bool = False,
           optimizer_state: bool = False, config: Optional[PathLike] = None,
           overwrite: bool = False, max_shard_size: Union[None, int, str] = None,
           verify_replicas: bool = True, allow_scaled_optimizer_state: bool = False,
           allow_lossy_scale: bool = False, progress: Optional[Progress] = None,
           warn: Optional[Warn] = None, sync: bool = True,
           dequantize: Optional[str] = None, names: Optional[str] = None) -> None:
    """Sharded checkpoint -> full checkpoint (model.safetensors, or parts of at most
    ``max_shard_size`` and an index), checking that replicas agree, dropping padding.
    ``sharded_dir`` may be a DeepSpeed checkpoint (as for ``reshard gather``): its module
    weights are written, or with ``fp32=True`` the optimizer's fp32 master weights (the CLI's
    ``--fp32``), with the save dir's config.json copied. Any format of docs/formats.md is
    read; ``config`` is the model's config.json for a format that needs one (Megatron). From a
    PyTorch Distributed Checkpoint or an Orbax checkpoint (docs/jax.md), the optimizer's state
    is left out unless ``optimizer_state=True`` (``--optimizer-state``), which writes it by its
    keys (an Orbax leaf's pytree path joined with "."); from a
    Megatron-Core checkpoint it writes the distributed optimizer's state as "<name>.fp32",
    "<name>.exp_avg" and "<name>.exp_avg_sq" beside each Hugging Face tensor.

    ``dequantize="bf16"`` (or ``"fp16"``, ``"fp32"``; the CLI's ``--dequantize --dtype``)
    writes block-quantized tensors (FP8, MXFP4, NVFP4) as numbers without their scales, and
    config.json without quantization_config (docs/quantization.md); ``sharded_dir`` may then
    be a Hugging Face directory too.

    ``names="maxtext"`` (``--names maxtext``) reads an Orbax checkpoint's arrays as MaxText's
    model, with ``config`` its config.json, and writes the Hugging Face tensors they hold
    (docs/jax.md)."""
    o = _options(overwrite, max_shard_size, verify_replicas, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    _core.gather(_path(sharded_dir, "sharded_dir"), _path(out_dir, "out_dir"), bool(fp32),
                 bool(optimizer_state), None if config is None else _path(config, "config"),
                 dequantize, names, o)


def _given(**options: Any) -> list[str]:
    """The names of the options given (not None), in order."""
    return [k for k, v in options.items() if v is not None]


def _drop_list(drop: Optional[Sequence[str]]) -> list[str]:
    """`drop=` as the tensor names it lists (a str is one name, not its characters)."""
    if drop is None:
        return []
    names = [drop] if isinstance(drop, str) else list(drop)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"drop= must list tensor names (non-empty str); got {drop!r}")
    return names


def convert(sharded_dir: PathLike, out_dir: PathLike, *, tp: Optional[int] = None,
            to: Optional[str] = None, world: Optional[int] = None,
            target_maps: Union[None, PathLike, Mapping[str, MapLike]] = None,
            weights_only: bool = False, overwrite: bool = False,
            max_shard_size: Union[None, int, str] = None, verify_replicas: bool = True,
            allow_scaled_optimizer_state: bool = False, allow_lossy_scale: bool = False,
            progress: Optional[Progress] = None, warn: Optional[Warn] = None,
            sync: bool = True,
            distributed_config: Union[None, str, Mapping[str, Any]] = None,
            config: Optional[PathLike] = None, dequantize: Optional[str] = None,
            pp: Optional[int] = None, dp: Optional[int] = None,
            pp_stages: Optional[Sequence[int]] = None,
            drop: Optional[Sequence[str]] = None, names: Optional[str] = None,
            mesh: Union[None, str, Mapping[str, int]] = None,
            partition_specs: Union[None, PathLike, Mapping[str, Any]] = None,
            orbax_storage: Optional[str] = None) -> None:
    """Sharded checkpoint -> sharded checkpoint at ``tp`` ranks through transfer plans, never
    building a full tensor. Target maps come from ``target_maps`` (maps, a BufferSet, or a map
    document path), from the model's plans when the checkpoint was scattered from a config
    (at ``tp`` processes under ``distributed_config``: TP <-> EP, buffer to buffer), or from the
    layouts the manifest records.

    ``sharded_dir`` may be a DeepSpeed checkpoint (as for ``reshard convert``): the module
    weights and, unless ``weights_only``, the fp32 master weights and Adam's moments
    ("<param>.fp32", ".exp_avg", ".exp_avg_sq") are written as a reshard sharded checkpoint
    at ``tp``; parameters without a recorded layout take their maps from the save dir's
    config.json. With ``to="universal"`` (and no ``tp``, ``target_maps``, ``weights_only`` or
    ``max_shard_size``) it writes DeepSpeed's universal checkpoint instead, which DeepSpeed
    resumes from at any TP x DP (``reshard convert --to universal``). A PyTorch Distributed
    Checkpoint with Adam's state (FSDP2, TorchTitan) converts to the universal checkpoint's
    per-parameter files too, and so do a Megatron-Core dist-ckpt with its distributed
    optimizer's state (with ``config``, its model's config.json; docs/formats.md) and an Orbax
    checkpoint with optax's Adam moments (docs/jax.md). What the universal checkpoint has no
    place for (a module buffer; DCP state other than Adam's; an Orbax integer array) is refused
    unless ``drop`` names it (``reshard convert --drop KEY``).

    With ``to="dcp"`` and ``world`` (no ``tp``, ``target_maps``, ``max_shard_size`` or
    ``distributed_config``) it writes a PyTorch Distributed Checkpoint saved for ``world``
    ranks, each tensor in FSDP2's dim-0 chunks, which ``torch.distributed.checkpoint.load``
    reads at any world size (``reshard convert --to dcp --world N``; keys in
    docs/formats.md). From a DCP checkpoint it keeps the source's keys, their nesting and every
    non-tensor value, so the trainer loads its whole state dict back.

    ``dequantize="bf16"`` (or ``"fp16"``, ``"fp32"``; ``--dequantize --dtype``) writes
    block-quantized tensors as numbers without their scales, and config.json without
    quantization_config; ``target_maps`` then name the dequantized tensors, and a checkpoint
    scattered from a config is laid out from that config unquantized (docs/quantization.md).
    ``sharded_dir`` may be a Hugging Face directory (a one-rank source).

    With ``pp`` (and ``tp``, default the source's; ``dp``, default 1; ``pp_stages``, each
    stage's layer count) a DeepSpeed PipelineModule checkpoint becomes one of ``pp`` stages x
    TP x DP that DeepSpeed's ``load_checkpoint`` resumes from (``reshard convert --pp``;
    docs/deepspeed_checkpoints.md); the resuming model must partition its layers alike.

    ``names="maxtext"`` (with ``config``, the model's config.json) reads an Orbax checkpoint's
    arrays as the Hugging Face tensors of MaxText's model, for ``tp`` or ``to="dcp"``
    (docs/jax.md).

    With ``to="orbax"`` and ``mesh`` (``"fsdp=2,tensor=4"`` or ``{"fsdp": 2, "tensor": 4}``) it
    writes an Orbax checkpoint that ``orbax.checkpoint`` restores into jax arrays on that mesh
    (``reshard convert --to orbax``; docs/jax.md): ``partition_specs`` (a JSON file, or its
    mapping of array name patterns to specs) says how each array is split, replicated when none
    matches; ``orbax_storage`` is ``"zarr3"`` (the default: an OCDBT database of zarr v3
    arrays), ``"zarr2"`` (OCDBT + zarr v2) or ``"plain"`` (a zarr v2 directory per array);
    ``names="maxtext"`` writes a Hugging Face model as MaxText's tree."""
    src, dst = _path(sharded_dir, "sharded_dir"), _path(out_dir, "out_dir")
    o = _options(overwrite, max_shard_size, verify_replicas, allow_scaled_optimizer_state,
                 allow_lossy_scale, progress, warn, sync)
    if to == "orbax":
        given = _given(tp=tp, world=world, target_maps=target_maps, max_shard_size=max_shard_size,
                       distributed_config=distributed_config, dequantize=dequantize, pp=pp,
                       dp=dp, pp_stages=pp_stages, drop=drop)
        if given:
            raise ValueError(f"to=\"orbax\" takes no {', '.join(given)}: the mesh and the "
                             "partition specs say how each array is split")
        if isinstance(mesh, Mapping):
            mesh = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        if not isinstance(mesh, str) or not mesh:
            raise ValueError(f"to=\"orbax\" needs mesh= (e.g. \"fsdp=2,tensor=4\"); got {mesh!r}")
        if partition_specs is None:
            specs = ""
        elif isinstance(partition_specs, Mapping):
            specs = json.dumps(dict(partition_specs))
        else:
            with open(_path(partition_specs, "partition_specs"), encoding="utf-8") as f:
                specs = f.read()
        storage = "zarr3" if orbax_storage is None else orbax_storage
        if storage not in ("zarr3", "zarr2", "plain"):
            raise ValueError(f"orbax_storage={orbax_storage!r}: expected \"zarr3\" (OCDBT + zarr "
                             "v3, the default), \"zarr2\" (OCDBT + zarr v2) or \"plain\"")
        _core.convert_to_orbax(src, mesh, specs, storage, dst, bool(weights_only),
                               None if config is None else _path(config, "config"), names, o)
        return
    if mesh is not None or partition_specs is not None or orbax_storage is not None:
        raise ValueError("mesh=, partition_specs= and orbax_storage= apply to to=\"orbax\"")
    if names is not None and (pp is not None or to == "universal"):
        raise ValueError("names= applies to a convert with tp= or to=\"dcp\"")
    if drop is not None and to != "universal":
        raise ValueError("drop= applies to to=\"universal\" (which cannot hold every tensor of "
                         "a checkpoint)")
    if pp is not None or dp is not None or pp_stages is not None:
        given = _given(to=to, world=world, target_maps=target_maps,
                       max_shard_size=max_shard_size, config=config,
                       distributed_config=distributed_config, dequantize=dequantize)
        if weights_only:
            given.append("weights_only")
        if given:
            raise ValueError(f"pp= takes no {', '.join(given)}: it writes a DeepSpeed pipeline "
                             "checkpoint with its optimizer state")
        for key, value in (("pp", pp), ("tp", tp), ("dp", dp)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{key}= must be a positive int; got {value!r}")
        if pp is None:
            raise ValueError("dp= and pp_stages= apply to pp= (a DeepSpeed pipeline output)")
        stages = [] if pp_stages is None else list(pp_stages)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages):
            raise ValueError(f"pp_stages= must list positive ints; got {pp_stages!r}")
        _core.convert_to_pipeline(src, pp, tp or 0, dp or 1, stages, dst, o)
        return
    if dequantize is not None and to is not None:
        raise ValueError(f"dequantize= converts to a reshard sharded checkpoint, not to={to!r}")
    if to == "dcp":
        given = _given(tp=tp, target_maps=target_maps, max_shard_size=max_shard_size,
                       distributed_config=distributed_config)
        if given:
            raise ValueError(f"to=\"dcp\" takes no {', '.join(given)}: a DCP checkpoint holds "
                             "each tensor in dim-0 chunks, one file per rank")
        if world is None or isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"to=\"dcp\" needs world= (the ranks it is saved for, at least 1; "
                             f"got {world!r})")
        _core.convert_to_dcp(src, world, dst, bool(weights_only),
                             None if config is None else _path(config, "config"), names, o)
        return
    if world is not None:
        raise ValueError("world= applies to to=\"dcp\"; give tp= for a sharded checkpoint")
    if to is not None:
        if to != "universal":
            raise ValueError(f"to={to!r}: the other outputs convert writes are "
                             "to=\"universal\" (DeepSpeed's universal checkpoint), to=\"dcp\" "
                             "and to=\"orbax\"")
        given = _given(tp=tp, target_maps=target_maps, max_shard_size=max_shard_size)
        if weights_only:
            given.append("weights_only")
        if given:
            raise ValueError(f"to=\"universal\" takes no {', '.join(given)}: the universal "
                             "checkpoint holds full tensors of every optimizer state")
        _core.convert_to_universal(src, dst, None if config is None else _path(config, "config"),
                                   _drop_list(drop), o)
        return
    if tp is None or isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"convert needs tp= (a world size of at least 1; got {tp!r}) or "
                         "to=\"universal\"")
    targets, buffers = (None, "") if target_maps is None else _map_list(target_maps)
    _core.convert(src, tp, dst, targets, buffers, bool(weights_only),
                  _dc_text(distributed_config),
                  None if config is None else _path(config, "config"), dequantize, names, o)


def inspect(path: PathLike) -> dict[str, Any]:
    """What ``reshard inspect --json`` reports: the tensors (name, dtype, shape) and structure
    of a .pt, .safetensors, reshard or DeepSpeed checkpoint. Nothing is loaded: only headers,
    manifests and pickles are read. Raises FileNotFoundError for a missing path and
    CheckpointError (the CLI's message) for a file that is corrupt or of no known format."""
    result: dict[str, Any] = json.loads(_core.inspect(_path(path, "path"), True))
    return result


def load_rank(sharded_dir: PathLike, rank: int, *, weights_only: bool = True
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rank of a reshard sharded checkpoint, as a process that holds it would: ``(maps,
    shards)`` with ``maps`` every parameter's :class:`reshard.ParamMap` (over all ranks) and
    ``shards`` rank ``rank``'s torch tensors by name (a buffer's name for the parameters a
    buffer holds: DESIGN 16), exactly what :class:`reshard.distributed.Redistributor` and
    :class:`reshard.vllm.WeightSync` take. The checkpoint is opened as ``reshard gather``
    opens it, and refused alike (:class:`reshard.CheckpointError` with the CLI's message;
    FileNotFoundError for a missing one): the manifest read strictly, and every rank's files
    checked against it (each tensor present, of the manifest's dtype and shape, nothing else;
    files inside the checkpoint, each serving one rank) before any data is read.
    ``weights_only`` leaves out optimizer state (parameters with a ``scale_power`` other than
    1, and ``.fp32`` master weights)."""
    from ._maps import ParamMap
    from ._tensors import zeros_of
    directory = _path(sharded_dir, "sharded_dir")
    ckpt = _core.ShardedCheckpoint.open(directory)
    world = ckpt.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r}: {directory} has ranks 0 .. {world - 1}")
    params = ckpt.params()
    kept = [not (weights_only and (scale_power != 1 or name.endswith(".fp32")))
            for name, _, _, scale_power in params]
    maps = {name: ParamMap(handle)
            for (name, _, handle, _), keep in zip(params, kept) if keep}
    shards: dict[str, Any] = {}
    for index, (name, dtype, shape, holders) in enumerate(ckpt.rank_tensors(rank)):
        if not any(kept[i] for i in holders):
            continue  # optimizer state only, or a buffer that is all padding
        t = zeros_of(dtype, tuple(shape), None)
        ckpt.copy_tensor(rank, index, t.data_ptr(), t.numel() * t.element_size())
        shards[name] = t
    return maps, shards


__all__ = ["convert", "gather", "inspect", "load_rank", "scatter"]
