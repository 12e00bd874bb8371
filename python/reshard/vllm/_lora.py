"""LoRA adapters pushed live into vLLM engines (:meth:`reshard.vllm.WeightSync.push_lora`).

The geometry (DESIGN 22): an adapter tensor is laid out on an engine's workers as its base
weight is. For a base weight ``M.weight`` [out, in] of which worker j holds rows R_j and
columns C_j, ``M.lora_A.weight`` [r, in] is held as all of r by C_j (a column-parallel layer:
A whole on every worker; a row-parallel one: A split like the weight's columns) and
``M.lora_B.weight`` [out, r] as R_j by all of r (B split like the weight's rows, whole for a
row-parallel layer). The fused ``qkv_proj`` / ``gate_up_proj`` of vLLM need nothing more:
each worker holds the rows of q, k and v that its base shard holds (the key/value heads it
serves, replicated where vLLM replicates them), which is what vLLM's LoRA layers slice out of
the whole adapter when they load one from disk. The trainer side derives these maps from the
engine's maps of the base weights (the plan of the sync); the worker side builds vLLM's
``LoRAModel`` from what it received, keeps it and registers it in the worker's LoRA manager, so
that a request with :meth:`WeightSync.lora_request` finds it loaded, or, once vLLM has evicted
it, has it registered again from what the worker keeps: never read from its path.

A ``vllm serve`` server numbers the adapters it serves by name itself: a request naming a
pushed adapter (``"model": NAME``) reaches the workers with the placeholder path and the
server's id, not :func:`lora_id`. The worker answers such a request from the adapter pushed
under NAME, under the server's id (a copy sharing its tensors; vLLM drops it, with every
adapter, as each push finishes, and the next request loads the adapter pushed last); the server
learns the name through :func:`resolver`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Mapping, Optional, Sequence

from .._errors import LayoutError
from .._maps import ParamMap, as_map

# What a served adapter's LoRARequest names as its path: vLLM requires one, and asks the
# worker to load it when its cache lacks the request's id (serve_pushed_paths answers it).
PATH_PREFIX = "reshard-pushed://"

Runs = tuple[tuple[int, int], ...]  # (start, length) along one dimension
Region = tuple[Runs, Runs]  # rows, columns of a 2-D tensor


def lora_id(name: str) -> int:
    """The adapter id (vLLM's ``lora_int_id``) of the adapter pushed under ``name``: the same
    in every process and across syncs, from the name alone (positive, below 2**31)."""
    return 1 + zlib.crc32(name.encode()) % (2 ** 31 - 2)


def _runs(values: Sequence[int]) -> Runs:
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)


def _count(runs: Runs) -> int:
    return sum(n for _, n in runs)


def region_of(m: ParamMap, rank: int, name: str) -> Region:
    """The rows and columns of a 2-D tensor that rank ``rank`` of ``m`` holds, as runs: its
    pieces must cover a product of rows and columns (what a tensor-parallel split is)."""
    shape = m.logical_shape
    if len(shape) != 2:
        raise LayoutError(f"\"{name}\": an adapter's base weight must be 2-D, its map is over "
                          f"{list(shape)}")
    cols = shape[1]
    rows: set[int] = set()
    columns: set[int] = set()
    total = 0
    for piece in m.pieces(rank):
        offset, strides = piece.source
        if not piece.shape or strides[-1] != 1:
            raise LayoutError(f"\"{name}\": rank {rank}'s pieces are not runs of whole "
                              "elements along the columns")
        outer = piece.shape[:-1]
        length = piece.shape[-1]
        total += length * max(1, _prod(outer))
        for index in _indices(outer):
            start = offset + sum(i * s for i, s in zip(index, strides))
            end = start + length  # flat [start, end)
            first_row, last_row = start // cols, (end - 1) // cols
            if first_row == last_row:
                rows.add(first_row)
                columns.update(range(start % cols, start % cols + length))
            elif start % cols == 0 and end % cols == 0:  # whole rows
                rows.update(range(first_row, last_row + 1))
                columns.update(range(cols))
            else:
                raise LayoutError(f"\"{name}\": rank {rank} holds part-rows across rows")
    region = (_runs(sorted(rows)), _runs(sorted(columns)))
    if _count(region[0]) * _count(region[1]) != total:
        raise LayoutError(f"\"{name}\": rank {rank} holds no product of rows and columns "
                          "(not a tensor-parallel split)")
    return region


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _indices(shape: Sequence[int]) -> list[tuple[int, ...]]:
    import itertools
    return list(itertools.product(*(range(s) for s in shape)))


def _module_of(name: str) -> tuple[str, str]:
    """``base_model.model.M.lora_A.weight`` -> (M, "A"); refuses what is no Linear's LoRA."""
    stem = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if stem.endswith(suffix):
            return stem[: -len(suffix)], part
    raise LayoutError(f"\"{name}\" is not a LoRA A or B of a linear layer (PEFT's "
                      "base_model.model.M.lora_A.weight / lora_B.weight): embedding adapters, "
                      "biases and DoRA magnitudes are not pushed live")


def adapter_targets(shapes: Mapping[str, Sequence[int]], base: Mapping[str, Any],
                    base_dtypes: Mapping[str, str], workers: int
                    ) -> tuple[dict[str, Any], dict[str, str], dict[str, list[Any]]]:
    """One engine's maps (JSON) of the adapter tensors ``shapes`` ({PEFT name: shape}), their
    dtypes (the base weight's) and each rank's region ({name: [region per rank]}), from the
    engine's maps of the base weights ``base`` (JSON, checkpoint names)."""
    from ..torch import _build
    targets: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    regions: dict[str, list[Any]] = {}
    for name, shape in sorted(shapes.items()):
        module, part = _module_of(name)
        weight = f"{module}.weight"
        if weight not in base:
            raise LayoutError(f"\"{name}\": the engine has no base weight \"{weight}\" to "
                              "adapt")
        m = as_map(base[weight])
        out, inp = m.logical_shape
        if len(shape) != 2 or (part == "A" and shape[1] != inp) or \
                (part == "B" and shape[0] != out) or \
                (part == "A" and shapes.get(name.replace("lora_A", "lora_B"), [0, shape[0]])[1]
                 != shape[0]):
            raise LayoutError(f"\"{name}\" has shape {list(shape)}, which does not adapt "
                              f"\"{weight}\" {[out, inp]} (A: [r, {inp}], B: [{out}, r])")
        r = int(shape[0] if part == "A" else shape[1])
        by_rank: dict[int, tuple[Runs, ...]] = {}
        for rank in range(workers):
            rows, cols = region_of(m, rank, weight)
            by_rank[rank] = (((0, r),), cols) if part == "A" else (rows, ((0, r),))
        targets[name] = json.loads(_build(name, (tuple(int(s) for s in shape), by_rank, ""),
                                          list(range(workers))).to_json())
        dtypes[name] = base_dtypes[weight]
        regions[name] = [[list(map(list, d)) for d in by_rank[k]] for k in range(workers)]
    return targets, dtypes, regions


def adapter_state(adapter: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The adapter's tensors under PEFT's saved names and its config (adapter_config.json's
    fields): a PEFT model (its active adapter; plain, FSDP2 or TP: DTensors as they lie), or a
    mapping of tensors with ``config`` (a dict, JSON text or a path to adapter_config.json)."""
    if hasattr(adapter, "peft_config") and hasattr(adapter, "active_adapter"):
        from peft import get_peft_model_state_dict  # type: ignore[import-not-found,unused-ignore]
        active = adapter.active_adapter
        if not isinstance(active, str):
            raise LayoutError("a PEFT model with several active adapters: push one at a time")
        tensors = dict(get_peft_model_state_dict(adapter, adapter_name=active))
        if config is None:
            config = adapter.peft_config[active].to_dict()
    elif isinstance(adapter, Mapping):
        tensors = dict(adapter)
    else:
        raise LayoutError(f"an adapter is a PEFT model or a mapping of its tensors, got "
                          f"{type(adapter).__name__}")
    if config is None:
        raise LayoutError("an adapter given as tensors needs config= (its adapter_config.json: "
                          "a dict, its text or its path)")
    if isinstance(config, str) and not config.lstrip().startswith("{"):
        with open(config) as f:
            config = f.read()
    if isinstance(config, (str, bytes)):
        config = json.loads(config)
    if not isinstance(config, Mapping):
        raise LayoutError(f"config= is the adapter's config (a dict), got {type(config).__name__}")
    plain = json.loads(json.dumps(dict(config), default=_plain))
    if str(plain.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.") != "LORA":
        raise LayoutError(f"the adapter is {plain.get('peft_type')!r}, not LoRA")
    if plain.get("use_dora"):
        raise LayoutError("a DoRA adapter is not pushed live (vLLM does not serve DoRA)")
    if not tensors:
        raise LayoutError("the adapter has no tensors")
    return tensors, plain


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)


# -- the worker's side ---------------------------------------------------------------------

def whole_tensors(received: Mapping[str, Any], regions: Mapping[str, list[Any]],
                  shapes: Mapping[str, Sequence[int]], rank: int) -> dict[str, Any]:
    """Each adapter tensor at its full shape, with this worker's rows and columns where the
    base layer's LoRA slicing reads them (zeros elsewhere, never read): vLLM's LoRA layers
    take the whole adapter and slice out the worker's part, as when loading one from disk."""
    import torch
    out = {}
    for name, shard in received.items():
        rows, cols = regions[name][rank]
        full = torch.zeros(list(shapes[name]), dtype=shard.dtype)
        r = torch.cat([torch.arange(s, s + n) for s, n in rows])
        c = torch.cat([torch.arange(s, s + n) for s, n in cols])
        full[r[:, None], c[None, :]] = shard.reshape(len(r), len(c))
        out[name] = full
    return out


def stage(model: Any, lora_config: Any, tensors: Mapping[str, Any], config: Mapping[str, Any],
          adapter_id: int, vocab_size: int, max_position: Optional[int]) -> Any:
    """vLLM's LoRAModel of ``tensors`` (whole, PEFT names), checked as vLLM checks an adapter it
    loads from disk and packed for the fused layers; nothing the engine serves changes."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the engine serves no LoRA adapters: start it with enable_lora=True "
                           "(vllm serve --enable-lora)")
    fields = {k: v for k, v in config.items() if k in PEFTHelper.__dataclass_fields__}
    helper = PEFTHelper.from_dict({**fields, "vllm_max_position_embeddings": max_position})
    helper.validate_legal(lora_config)
    expected = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    unexpected = sorted({parse_fine_tuned_lora_name(n, mapper)[0].rpartition(".")[2]
                         for n in tensors} - expected)
    if unexpected:
        raise RuntimeError(f"the adapter adapts modules {unexpected} that the engine's LoRA "
                           f"layers do not (it adapts {sorted(expected)})")
    lora = LoRAModel.from_lora_tensors(
        adapter_id, dict(tensors), helper, device="cpu", dtype=lora_config.lora_dtype,
        model_vocab_size=vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager._validate_moe_lora_format(lora)
    manager._validate_modules_to_save(lora)
    manager._create_merged_loras_inplace(lora)
    cache = manager._registered_adapters
    if adapter_id not in cache and len(cache) >= manager.capacity and \
            all(k in cache.pinned_items for k in cache.order):
        raise RuntimeError(f"the engine holds {len(cache)} adapters, all pinned (max_cpu_loras "
                           f"{manager.capacity}): no room for another")
    return lora


def _pushed(manager: Any) -> dict[int, Any]:
    """The adapters pushed into this worker, by id: what the worker serves under each pushed
    name, whether or not vLLM's cache holds it now. vLLM removes every adapter after a weight
    update (its ``finish_weight_update``); a pushed adapter's tensors do not depend on the base
    weights, so it is registered again at once."""
    pushed: Optional[dict[int, Any]] = getattr(manager, "_reshard_pushed", None)
    if pushed is None:
        pushed = {}
        remove_all = manager.remove_all_adapters

        def remove_all_adapters() -> None:
            remove_all()
            for adapter_id, lora in pushed.items():
                manager._registered_adapters[adapter_id] = lora
        manager.remove_all_adapters = remove_all_adapters
        manager._reshard_pushed = pushed
    return pushed


def commit(model: Any, lora: Any) -> Any:
    """The staged adapter served under its id: kept, and registered in the worker's cache (an
    LRU cache: evicted, it is registered again from what the worker keeps, never loaded from
    its path); the adapter it replaces is returned (or None)."""
    manager = model.lora_manager
    pushed = _pushed(manager)
    old = pushed.get(lora.id)
    manager.remove_adapter(lora.id)  # out of its slot: the next step activates the new one
    manager._registered_adapters[lora.id] = lora
    pushed[lora.id] = lora
    return old


def uncommit(model: Any, adapter_id: int, old: Any) -> None:
    """The adapter ``old`` served again under ``adapter_id`` (None: none)."""
    manager = model.lora_manager
    pushed = _pushed(manager)
    manager.remove_adapter(adapter_id)
    pushed.pop(adapter_id, None)
    if old is not None:
        manager._registered_adapters[adapter_id] = old
        pushed[adapter_id] = old


def lora_request(name: str) -> Any:
    """vLLM's LoRARequest of the adapter pushed under ``name``."""
    from vllm.lora.request import LoRARequest
    return LoRARequest(name, lora_id(name), PATH_PREFIX + name)


# -- served by name (a vllm serve server) ----------------------------------------------------

def pushed_adapter(manager: Any, name: str, adapter_id: int) -> Any:
    """The adapter pushed under ``name`` as vLLM's LoRAModel of id ``adapter_id`` (a copy that
    shares its tensors where the id is not :func:`lora_id` ``(name)``), for the worker's LoRA
    manager to register as it registers an adapter read from disk."""
    own = lora_id(name)
    lora = _pushed(manager).get(own)
    if lora is None:
        raise LookupError(f"no LoRA adapter was pushed under the name {name!r} "
                          "(reshard.vllm.WeightSync.push_lora): nothing to serve")
    return lora if adapter_id == own else lora.clone(adapter_id)


def serve_pushed_paths() -> None:
    """vLLM's worker LoRA managers in this process answer a request whose path is the
    placeholder of a pushed adapter (:data:`PATH_PREFIX` + NAME) with :func:`pushed_adapter`
    instead of reading it from disk; other paths load as before. vLLM asks for it whenever a
    request's id is not in the worker's cache (a server's id for a pushed adapter, or an
    adapter evicted); installed once per process, by the reshard backend's engine."""
    import functools

    from vllm.lora.worker_manager import WorkerLoRAManager
    load = WorkerLoRAManager._load_adapter
    if getattr(load, "_reshard_pushed_paths", False):
        return

    @functools.wraps(load)
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = lora_request.lora_path or ""
        if not path.startswith(PATH_PREFIX):
            return load(self, lora_request)
        return pushed_adapter(self._adapter_manager, path[len(PATH_PREFIX):],
                              int(lora_request.lora_int_id))
    _load_adapter._reshard_pushed_paths = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]


def resolver() -> Any:
    """vLLM's LoRAResolver of pushed adapters (registered by the plugin; a ``vllm serve``
    server asks it, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, for a model name it does not
    serve): the name as a pushed adapter's :func:`lora_request`. The server gives the request
    an id of its own and has the workers load it, which answers from the adapter pushed under
    the name, or fails naming it if none was (the server replies 400)."""
    from vllm.lora.resolver import LoRAResolver

    class PushedAdapters(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            return lora_request(lora_name)
    return PushedAdapters()
