"""vLLM's weight-transfer backend ``"reshard"``, run inside every worker of the engine.

Registered in every vLLM process by the ``vllm.general_plugins`` entry point
(:func:`reshard.vllm.plugin.register`); chosen with ``weight_transfer_config={"backend":
"reshard"}`` (``vllm serve --weight-transfer-config '{"backend": "reshard"}'``). The trainer
side is :class:`reshard.vllm.WeightSync`, which drives ``init_weight_transfer_engine`` (join
the group, agree on one plan) and, per push, ``start_weight_update`` → ``update_weights``
(receive the bytes this worker lacks straight into its parameters, then vLLM's post-load
processing) → ``finish_weight_update``.

An update is all or nothing. vLLM's layer-wise reload puts the layers back in their loading
form (on the meta device; on CPU the live linear weights are repacked for oneDNN and cannot be
written); the layers the maps write are materialized and handed to the transfer as its
``out``, while the old (kernel) tensors stay untouched. Each layer runs vLLM's post-load
processing as soon as its last tensor has arrived, while the next ones travel, short of
copying into the kernel tensors; what that processing sets on the layer (on CPU, the handle of
its packed weight) is recorded. Only when every byte has arrived and been processed, on every
worker, are the kernel tensors written. Any failure before that (a check on any process, a
peer lost mid-transfer, a layer whose processing fails on one worker) puts the old tensors and
the recorded state back, on every worker: the engine serves the weights it had. The workers
agree over vLLM's own group of the workers (which a lost trainer process does not break).

No RPC of this backend fails for a refusal or a lost peer: when an RPC fails on more than one
worker, vLLM's executor reads the first failed reply and leaves the others unread, and every
later RPC then reads a stale reply. An update abandoned that way is left open in vLLM (its
``finish_weight_update`` not called); the workers report it to the next ``WeightSync``, whose
driving process finishes it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional, cast

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from vllm.logger import init_logger

from .._maps import as_map as _as_map
from ..distributed import RedistributeError
from ._group import StoreGroup, join_store
from ._exchange import lane_groups, raw_exchange, run_stages, verify_engines
from ._schedule import (AnyRedistributor, Stage, carry_delta, engine_ranks, identities,
                        plan_stages)

logger = init_logger(__name__)


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """Where the trainer's store is, and the group's shape (sent by WeightSync)."""

    host: str
    port: int
    prefix: str
    trainers: int
    backend: str = "gloo"
    timeout_s: float = 600.0
    engine: int = 0  # this engine's index among the sync's engines
    engines: int = 1
    sync: str = ""  # the sync's own prefix, the same through every join of its group


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One push: ``mode`` "plan" (the plan's bytes), "verify" (no bytes: what the worker serves
    proven against the trainer's shards), or for measuring against other paths "full" (full
    tensors from trainer process 0, loaded by vLLM's loaders) and "raw" (the plan's bytes
    received and dropped)."""

    step: int = 0
    mode: str = "plan"
    # "plan": each layer processed as soon as it has arrived (True), or every layer after the
    # transfer (False); None: overlapped on a GPU, after on CPU (see _Layers).
    overlap: Optional[bool] = None
    tensors: list[list[Any]] = field(default_factory=list)  # "full": [name, dtype, shape]
    # "plan": only what changed since the last delta push travels (targets rewritten whole).
    delta: bool = False
    # "plan": every exchange's targets verified (fingerprints) before any layer is processed.
    verify: bool = False
    # "lora": the adapter pushed (WeightSync.push_lora): its name, id, config, the plan of its
    # tensors and each rank's region of them.
    lora: dict[str, Any] = field(default_factory=dict)


def _served_name(module_name: str) -> str:
    """A module's name as the checkpoint names its layer: vLLM's LoRA layers wrap the layer
    they adapt as ``base_layer`` (``qkv_proj.base_layer.weight`` is ``qkv_proj.weight``)."""
    return module_name.replace(".base_layer", "")


def _layer(model: torch.nn.Module, module_name: str) -> torch.nn.Module:
    """The module of ``module_name`` (a checkpoint's name), the layer inside a LoRA wrapper."""
    module = model.get_submodule(module_name)
    inner = getattr(module, "base_layer", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def _tensor_info(model: torch.nn.Module) -> dict[str, tuple[list[int], str]]:
    """The worker's parameters in their loading form: {name: (shape, dtype)}. A module
    registered under two names (Qwen3-MoE's router, ``mlp.gate`` and ``mlp.experts.gate``) is
    named by the smaller, as the layout names it."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS
    names: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        module_name = _served_name(module_name)
        names[id(module)] = min(names.get(id(module), module_name), module_name)
    live = SKIP_TENSORS - SKIP_LOAD_TENSORS  # loaded, but kept as they are through a reload
    out: dict[str, tuple[list[int], str]] = {}
    for module in model.modules():
        module_name = names[id(module)]
        params, _ = get_layerwise_info(module).restore_metadata
        params = {**{n: t for n, t in module.named_parameters(recurse=False) if n in live},
                  **params}
        for name, t in params.items():
            out[f"{module_name}.{name}" if module_name else name] = (list(t.shape),
                                                                     str(t.dtype))
    return out


@contextlib.contextmanager
def _experts_processed_again(layers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """vLLM runs an unquantized MoE layer's experts' own post-load step only on the first
    load: on a reload it copies the new weights into the kernel tensors as they are. On CPU
    that step pads the experts' intermediate dimension and prepacks w13/w2 for the grouped
    GEMM, so a reload without it fails (padded shapes) or serves wrong tokens. Inside this
    block the layers' post-load processing runs that step after its own."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod)
    patched = []
    for layer in layers:
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or experts is None or \
                type(experts).process_weights_after_loading is \
                FusedMoEExperts.process_weights_after_loading:
            continue

        def process(module: torch.nn.Module, first: Any = method.process_weights_after_loading,
                    experts: Any = experts) -> None:
            first(module)
            experts.process_weights_after_loading(module)
        cast(Any, method).process_weights_after_loading = process  # on the instance, removed below
        patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


def _clear_kv_caches(vllm_config: Any) -> None:
    """Zeroes the KV cache of every attention layer of the worker. Blocks computed with the old
    weights must not reach a request served by the new ones: the trainer's driving process
    drops the prefix cache (requests in flight computed again), and the blocks' memory is
    cleared here, since a freed block is handed to new requests as it is and a NaN left in it
    by the old weights survives the attention's masking (0 * NaN)."""
    seen: set[int] = set()
    for layer in vllm_config.compilation_config.static_forward_context.values():
        caches = getattr(layer, "kv_cache", None)
        for t in caches if isinstance(caches, (list, tuple)) else (caches,):
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.zero_()


# The outcome of a push's transfer on one worker, agreed as the worst on any worker.
_READY, _UNPROCESSED, _LOST = 0, 1, 2


class _Layers:
    """The layers a push writes on one worker, in vLLM's layer-wise reload: each put in its
    loading form (materialized) for the transfer to write, and processed (vLLM's post-load
    step: on CPU the oneDNN repack) as soon as its last tensor has arrived, while later ones
    travel (on a GPU engine, or when the trainer asks; on a CPU engine the processing and the
    transport compete for the same cores, and overlapping them made pushes no faster, so there
    every layer is processed after the transfer). Nothing of the old weights is changed
    before commit: the kernel tensors stay aside (vLLM's reload keeps them), a tensor the
    reload keeps live (a bias) is replaced by a fresh one, and what processing sets on a
    layer (the handle of its packed weight) is recorded so that :meth:`restore_state` can put
    it back."""

    def __init__(self, overlap: bool = True) -> None:
        self._overlap = overlap  # process layers during the transfer, or all after it
        self._by_name: dict[str, torch.nn.Module] = {}
        self._waiting: dict[str, set[str]] = {}
        self._state: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self._processed: set[str] = set()
        self.problem: Optional[str] = None  # the first layer that could not be processed
        self.seconds = 0.0  # spent processing

    def modules(self) -> list[torch.nn.Module]:
        return list(self._by_name.values())

    def materialize(self, model: torch.nn.Module, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors the transfer writes, ``{key: tensor}``, of the layers of ``keys``."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import (
            materialize_layer, materialize_meta_tensor, to_meta_tensor)
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            module_name, _, name = key.rpartition(".")
            module = _layer(model, module_name)
            info = get_layerwise_info(module)
            if module_name not in self._by_name:
                materialize_layer(module, info)
                self._by_name[module_name] = module
                self._waiting[module_name] = set()
            self._waiting[module_name].add(key)
            t = getattr(module, name)
            if info.kernel_tensors is not None and info.kernel_tensors[0].get(name) is t and \
                    t is not None:
                with info.restore_device:  # live through the reload: the old weights' own
                    setattr(module, name, materialize_meta_tensor(to_meta_tensor(t)))
            out[key] = getattr(module, name).data
        return out

    def arrived(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """(Redistributor's on_ready) Process each layer whose tensors have all arrived. A
        failure is kept in :attr:`problem`, never raised: the transfer goes on."""
        for key in tensors:
            module_name = key.rpartition(".")[0]
            waiting = self._waiting[module_name]
            waiting.discard(key)
            if not waiting and self._overlap:
                self._process(module_name)

    def process_the_rest(self) -> None:
        """Every layer not processed yet (without overlap, all of them)."""
        for module_name in self._by_name:
            if module_name not in self._processed:
                self._process(module_name)

    def _process(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (_layerwise_process,
                                                                       get_layerwise_info)
        if self.problem is not None or module_name in self._processed:
            return
        self._processed.add(module_name)
        module = self._by_name[module_name]
        info = get_layerwise_info(module)
        start = time.perf_counter()
        self._state.append((module, dict(vars(module))))
        # vLLM's own processing of a reloaded layer, short of copying into the kernel tensors
        # (done at commit, when every worker has processed every layer).
        kernel = info.kernel_tensors
        non_persistent, total = info.kernel_non_persistent_buffers, info.load_numel_total
        info.kernel_tensors = None
        try:
            _layerwise_process(module, info)
        except Exception as e:
            self.problem = f"{module_name}: {type(e).__name__}: {e}"
        finally:
            info.kernel_tensors = kernel
            info.kernel_non_persistent_buffers, info.load_numel_total = non_persistent, total
            self.seconds += time.perf_counter() - start

    def restore_state(self) -> None:
        """Each processed layer's attributes as they were before it was processed."""
        for module, state in reversed(self._state):
            module.__dict__.clear()
            module.__dict__.update(state)
        self._state = []


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._comm: Optional[StoreGroup] = None
        self._sync: Optional[AnyRedistributor] = None  # the first exchange (one engine: the only)
        self._stages: list[Stage] = []
        self._comms: list[StoreGroup] = []  # the sync's group, then its other lanes' groups
        self._trainers = 0
        self._engine, self._engines, self._first = 0, 1, 0  # this engine, of how many; rank 0's
        self._timeout = 600.0
        self._backend = "gloo"
        self._open = False  # an update started and not finished (its trainer may be gone)
        self._plan: dict[str, Any] = {}  # the agreed plan of the sync's group
        self._sync_id = ""  # the sync this worker last joined (ReshardInitInfo.sync)
        self._who: list[tuple[int, int]] = []  # the group's processes (identities())
        self._who_me = -1  # this worker's rank among them
        self._verifiers: dict[Any, Any] = {}  # verify_engines' exchanges
        self._adapter_stages: dict[str, list[Stage]] = {}  # push_lora's exchanges, by plan
        if getattr(vllm_config, "lora_config", None) is not None:
            from . import _lora
            _lora.serve_pushed_paths()  # requests that name a pushed adapter by its path

    # -- init: join the group, agree on one plan ---------------------------------------------

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import datetime
        import socket

        import torch.distributed as dist
        # A group joined again by the same sync (engines came or went) keeps the delta state
        # of the exchanges that stay as they were (carry_delta).
        same = bool(init_info.sync) and init_info.sync == self._sync_id
        old_stages, old_who = (self._stages, self._who) if same else ([], [])
        old_me = self._who_me if same else -1
        self.shutdown()
        self._verifiers = {}
        self._sync_id = init_info.sync
        workers = self.parallel_config.world_size
        rank = dist.get_rank() if dist.is_initialized() else 0
        store = join_store(init_info.host, init_info.port, init_info.timeout_s)
        engine, engines = init_info.engine, init_info.engines
        keys = [f"{init_info.prefix}/workers/{e}" for e in range(engines)]
        if rank == 0:  # the trainer processes (and the other engines) learn its size here;
            # set once: the trainer may have marked the engine refused (too late) already
            store.compare_set(keys[engine], "", str(workers))
        # The group's ranks: the trainer processes, then each engine's workers in turn. The
        # trainer marks an engine that does not join in time, so this wait outlasts its own.
        store.wait(keys, datetime.timedelta(seconds=2 * init_info.timeout_s))
        counts = [store.get(k).decode() for k in keys]
        if not counts[engine].isdigit():  # refused, or dropped for joining late: stay out
            logger.warning("reshard weight sync: this engine was left out of the sync's group "
                           "(%s)", counts[engine])
            return
        sizes = [int(c) if c.isdigit() else 0 for c in counts]
        self._trainers, self._engine, self._engines = init_info.trainers, engine, engines
        self._timeout = init_info.timeout_s
        self._backend = init_info.backend
        self._first = engine_ranks(init_info.trainers, sizes, engine).start
        comm = StoreGroup(store, init_info.prefix + "/pg", self._first + rank,
                          init_info.trainers + sum(sizes), init_info.backend,
                          init_info.timeout_s)
        self._comm = comm
        # 1: tell the trainer what this worker holds; 2: hear the maps of both sides.
        report = {"model": self.model_config.model, "engine": engine,
                  "host": socket.gethostname(),
                  "tp": self.parallel_config.tensor_parallel_size, "rank": rank,
                  "dtype": str(self.model_config.dtype).replace("torch.", ""),
                  "params": _tensor_info(self.model), "open": self._open}
        comm.gather_object(report)
        plan = comm.gather_object(None)[0]
        self._plan = plan
        error = plan.get("error") or self._check_targets(plan["targets"][engine], rank)
        # A refusal is agreed: every trainer process raises it. The RPC itself succeeds on
        # every worker (one failing worker's reply would be left unread by vLLM's executor).
        try:
            self._comms = [comm]
            self._stages = plan_stages(
                plan["source"], plan, init_info.trainers,
                lane_groups(store, init_info.prefix, comm.rank, comm, init_info.backend,
                            init_info.timeout_s, self._comms), error)
            self._sync = self._stages[0].redistributor
            who = identities(init_info.trainers, sizes, plan.get("ids") or range(engines))
            carry_delta(old_stages, old_who, old_me, self._stages, who, comm.rank,
                        fresh=not old_who)
            self._who, self._who_me = who, comm.rank
        except RedistributeError as e:
            logger.warning("reshard weight sync refused: %s", e)

    def _check_targets(self, target: dict[str, Any], rank: int) -> Optional[str]:
        """Every tensor the maps write on this worker is a parameter of its model, of the
        shape vLLM loads it with; every parameter of a layer the maps write is written."""
        from .._maps import as_map
        params = _tensor_info(self.model)
        keys: dict[str, tuple[int, ...]] = {}
        for name, m in target.items():
            pm = as_map(m)
            keys[pm.buffer(rank) or name] = pm.shard_shape(rank)
        for key, shape in sorted(keys.items()):
            if key not in params:
                return (f"the engine has no parameter \"{key}\" (worker {rank}); its "
                        f"parameters are {sorted(params)[:6]}...")
            if tuple(params[key][0]) != tuple(shape):
                return (f"parameter \"{key}\": the maps write a shard of shape {list(shape)}, "
                        f"worker {rank} holds {params[key][0]}")
        modules = {k.rpartition(".")[0] for k in keys}
        unwritten = sorted(k for k in params if k.rpartition(".")[0] in modules and k not in keys)
        if unwritten:
            return (f"parameters {unwritten[:4]} of layers the maps write are not written "
                    f"by them (worker {rank})")
        return None

    # -- one update -----------------------------------------------------------------------

    def start_weight_update(self) -> None:
        if self._sync is None:
            raise RuntimeError("the reshard weight transfer is not initialized: create a "
                               "reshard.vllm.WeightSync first")
        self._open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator, which raises on CPU.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._open = False  # vLLM closes the update of a worker whose RPC fails
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _worst_of_workers(self, mine: int) -> int:
        """The worst outcome of the transfer on any worker (_READY < _UNPROCESSED < _LOST),
        agreed over vLLM's own group of the workers (a trainer process lost mid-transfer
        breaks the sync's group, not this one)."""
        if self.parallel_config.world_size == 1:
            return mine
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group
        flag = torch.tensor([mine], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return int(flag.item())

    def _worst_of_engines(self, worst: int, step: Any) -> int:
        """The worst outcome on any engine of the sync: one WeightSync into several engines
        commits on every engine or on none. Agreed through the sync's store: each engine's
        first worker posts its engine's outcome and every worker reads them all (one that
        cannot, its store or another engine gone, reads the push as lost), then agreed again
        among the engine's workers."""
        if self._engines == 1:
            return worst
        import datetime
        comm = self._comm
        assert comm is not None
        keys = [f"outcome/{step}/{e}" for e in range(self._engines)]
        try:
            if comm.rank == self._first:
                comm.store.set(keys[self._engine], str(worst))
            if worst == _READY:  # an engine that is not ready keeps its weights whatever the rest
                comm.store.wait(keys, datetime.timedelta(seconds=self._timeout))
                worst = max(worst, *(int(comm.store.get(k)) for k in keys))
        except Exception as e:  # the store's process or another engine lost
            logger.warning("reshard weight update: the engines' outcomes unread: %s", e)
            worst = _LOST
        return self._worst_of_workers(worst)

    def _transfer(self, out: dict[str, torch.Tensor], layers: "_Layers",
                  error: Optional[str], delta: bool = False, verify: bool = False) -> None:
        """Every exchange of the push (:func:`reshard.vllm._exchange.run_stages`): the workers
        receive in their engine's own, send what they received on in those where their engine
        relays to another, and take part in the others."""
        comm = self._comm
        assert comm is not None
        run_stages(self._stages, self._engine, comm.rank - self._first, {}, out,
                   layers.arrived, error, delta, verify)

    def _abandon(self, what: str) -> None:
        """A peer was lost mid-transfer: the group is unusable. Shut down, so that the trainer
        processes still waiting on this worker hear of it at once."""
        logger.warning("reshard weight update: %s; the sync's group is shut down (a new "
                       "WeightSync joins again)", what)
        self.shutdown()

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if update_info.mode == "raw":
            return self._receive_raw()
        if update_info.mode == "verify":
            return self._verify_served()
        if update_info.mode == "full":
            return self._receive_full(update_info.tensors)
        if update_info.mode == "lora":
            return self._receive_lora(update_info.lora, update_info.step)
        from vllm.model_executor.model_loader.reload.layerwise import (
            _copy_and_restore_kernel_tensors, finalize_layerwise_reload, get_layerwise_info,
            initialize_layerwise_reload)
        comm = self._comm
        assert self._sync is not None and comm is not None
        model = self.model
        rank = comm.rank - self._first
        # A verified push checks what arrived before any layer is processed.
        overlap = False if update_info.verify else update_info.overlap
        # A layer is processed once each of its tensors has arrived whole and every exchange
        # that sends from it on this worker (a relay to another engine, a replicated piece to
        # another holder) is done (run_stages).
        layers = _Layers(self.device.type != "cpu" if overlap is None else overlap)
        times = [time.perf_counter()]
        refused: Optional[RedistributeError] = None
        lost: Optional[Exception] = None
        try:
            error = None
            out: dict[str, torch.Tensor] = {}
            try:
                initialize_layerwise_reload(model)
                keys = sorted({m.buffer(rank) or n for st in self._stages
                               if st.engine == self._engine
                               for n, m in zip(st.redistributor._names, st.redistributor._dst)})
                out = layers.materialize(model, keys)
            except Exception as e:
                error = f"worker {rank}: {type(e).__name__}: {e}"
            times.append(time.perf_counter())
            with _experts_processed_again(layers.modules()):
                self._transfer(out, layers, error, update_info.delta, update_info.verify)
                times.append(time.perf_counter())
                layers.process_the_rest()
        except RedistributeError as e:  # agreed: every trainer process raises it
            refused = e
        except Exception as e:  # a peer lost mid-transfer (the transport raised)
            lost = e
        except BaseException:
            self._restore(model, layers)
            raise
        # Every worker commits, or none: one that lacks bytes (a trainer process lost after
        # sending to some workers) or could not process them makes all keep their old weights.
        mine = _LOST if refused is not None or lost is not None else \
            _UNPROCESSED if layers.problem is not None else _READY
        worst = self._worst_of_engines(self._worst_of_workers(mine), update_info.step)
        if worst != _READY:
            self._restore(model, layers)
            if refused is not None:
                logger.warning("reshard weight update refused, old weights kept: %s", refused)
                return
            if worst == _LOST:
                why = f"{type(lost).__name__}: {lost}" if lost else \
                    "another worker lost a peer mid-transfer"
                self._abandon(f"worker {rank} kept its old weights: {why}")
                return
            # Every byte arrived everywhere, and some worker could not process its own.
            problem = None
            if layers.problem is not None:
                problem = f"worker {rank}: processing the new weights: {layers.problem}"
                logger.error("reshard weight update failed, old weights kept: %s", problem)
            self._report(comm, rank, problem, times, layers.seconds)
            return
        # Every byte is here and processed on every worker: into the kernel tensors.
        problem = None
        times.append(time.perf_counter())
        try:
            for module in layers.modules():
                _copy_and_restore_kernel_tensors(module, get_layerwise_info(module))
                get_layerwise_info(module).reset()  # type: ignore[no-untyped-call]
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[no-untyped-call]
            _clear_kv_caches(self.vllm_config)
            times.append(time.perf_counter())
        except BaseException as e:
            self._restore(model, layers)
            problem = f"worker {rank}: committing the new weights: {type(e).__name__}: {e}"
            logger.error("reshard weight update failed, old weights kept: %s", problem)
        self._report(comm, rank, problem, times, layers.seconds)

    def _report(self, comm: StoreGroup, rank: int, problem: Optional[str], times: list[float],
                processing: float = 0.0) -> None:
        """Tell the trainer processes this worker is done (they raise any worker's problem)
        and how long its parts took: prepare (the layers in loading form), transfer (receive
        and unpack; with overlap, each layer's post-load processing as it completes), process
        (that processing alone, during the transfer or after it) and commit (into the kernel
        tensors). The call itself returns either way, so that the engine's next update starts
        clean."""
        parts = dict(zip(("prepare", "transfer"), (b - a for a, b in zip(times, times[1:]))))
        if len(times) == 5:  # [start, prepared, transferred, committing, committed]
            parts["commit"] = times[4] - times[3]
        parts["process"] = processing
        try:
            comm.gather_object({"error": problem, "seconds": parts})
        except Exception as e:  # a trainer process lost once every byte had arrived
            self._abandon(f"worker {rank}: then {type(e).__name__}: {e}")

    def _restore(self, model: torch.nn.Module, layers: Optional["_Layers"] = None) -> None:
        """Put every layer's kernel tensors back as they were (the old weights), and the
        state a layer's post-load processing set on it (on CPU, the oneDNN handle of its
        packed weight)."""
        from vllm.model_executor.model_loader.reload.layerwise import (_place_kernel_tensors,
                                                                       get_layerwise_info)
        for module in model.modules():
            info = get_layerwise_info(module)
            if info.can_load():
                if info.kernel_tensors is not None:
                    _place_kernel_tensors(module, info)
                info.reset()  # type: ignore[no-untyped-call]
        if layers is not None:
            layers.restore_state()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload

    def _served(self, wanted: Mapping[str, tuple[tuple[int, ...], str]]
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The parameters this worker serves that are still in their loading form (the shape
        and dtype ``wanted`` gives each key), and the keys of those that are not (replaced or
        repacked by vLLM's post-load processing)."""
        held: dict[str, torch.Tensor] = {}
        hidden = []
        for key, (shape, dtype) in wanted.items():
            module_name, _, name = key.rpartition(".")
            try:
                t = getattr(_layer(self.model, module_name), name, None)
            except AttributeError:
                t = None
            if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and \
                    str(t.dtype).replace("torch.", "") == dtype and t.device.type != "meta":
                held[key] = t.data
            else:
                hidden.append(key)
        return held, hidden

    def _verify_served(self) -> None:
        """(update mode "verify") What this worker serves now, proven against the trainer
        processes' shards (:func:`reshard.vllm._exchange.verify_engines`); nothing changes."""
        comm = self._comm
        assert comm is not None
        rank = comm.rank - self._first
        start = time.perf_counter()
        try:
            verify_engines(comm, self._plan, self._trainers, self._engine, rank, {},
                           self._served, self._verifiers, None)
        except RedistributeError as e:  # agreed: every trainer process raises it
            logger.warning("reshard verify: %s", e)
            return
        except Exception as e:  # a peer lost
            self._abandon(f"worker {rank} lost a peer while verifying: {type(e).__name__}: {e}")
            return
        self._report(comm, rank, None, [start, time.perf_counter()])

    def _receive_full(self, tensors: list[list[Any]]) -> None:
        """Full tensors from trainer process 0, one after another, through vLLM's own loaders
        and layer-wise reload (what a full-tensor weight sync does)."""
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
        comm = self._comm
        assert comm is not None
        initialize_layerwise_reload(self.model)
        for name, dtype, shape in tensors:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=comm.device())
            comm.recv(t, 0)
            cast(Any, self.model).load_weights([(name, t)])
        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
        _clear_kv_caches(self.vllm_config)
        comm.gather_object(None)

    def _receive_raw(self) -> None:
        """The plan's bytes, received into scratch memory and dropped (the transport alone)."""
        sync, comm = self._sync, self._comm
        assert sync is not None and comm is not None
        ex = sync._exchange
        assert ex is not None
        raw_exchange(comm, ex.receives(comm.rank), sending=False)
        comm.gather_object(None)

    def _adapter_exchanges(self, lora: Mapping[str, Any]) -> list[Stage]:
        """The exchanges of an adapter's plan (a collective with the trainer processes, which
        build them in the same order), kept for the next push of the same plan."""
        stages = self._adapter_stages.get(lora["key"])
        if stages is not None:
            return stages
        comm = self._comm
        assert comm is not None
        plan = lora["plan"]
        made = len(self._comms)

        def group_of(lane: int) -> StoreGroup:
            if lane < made:  # the sync's own lanes, idle between pushes
                return self._comms[lane]
            group = StoreGroup(comm.store, f"{lora['prefix']}/lane{lane}", comm.rank,
                               len(comm.members), self._backend, self._timeout)
            self._comms.append(group)
            return group
        stages = plan_stages(plan["source"], plan, self._trainers, group_of, plan.get("error"))
        self._adapter_stages[lora["key"]] = stages
        return stages

    def _receive_lora(self, lora: Mapping[str, Any], step: int) -> None:
        """(update mode "lora") The adapter's tensors this worker lacks, received at its
        layout; then, in two phases, made servable under the adapter's id: every worker of
        every engine stages it (vLLM's LoRAModel built and checked, nothing served changes),
        they agree, and only if all staged it does each commit it (the adapter it replaces,
        if any, served until then and put back if a commit fails)."""
        from . import _lora
        comm = self._comm
        assert comm is not None
        rank = comm.rank - self._first
        times = [time.perf_counter()]
        try:
            stages = self._adapter_exchanges(lora)
        except RedistributeError as e:  # agreed: every trainer process raises it
            logger.warning("reshard adapter push refused: %s", e)
            return
        plan = lora["plan"]
        target = plan["targets"][self._engine]
        types = plan["dtypes"][self._engine]
        out: dict[str, torch.Tensor] = {}
        error = None
        try:
            for name, m in target.items():
                pm = _as_map(m)
                out[name] = torch.empty(pm.shard_shape(rank), dtype=getattr(torch, types[name]))
        except Exception as e:
            error = f"worker {rank}: {type(e).__name__}: {e}"
        times.append(time.perf_counter())
        lost: Optional[Exception] = None
        try:
            run_stages(stages, self._engine, rank, {}, out, None, error)
        except RedistributeError as e:
            logger.warning("reshard adapter push refused: %s", e)
            return
        except Exception as e:  # a peer lost mid-transfer
            lost = e
        times.append(time.perf_counter())
        staged, problem = None, None
        if lost is None:
            try:
                shapes = {n: _as_map(m).logical_shape for n, m in target.items()}
                whole = _lora.whole_tensors(out, lora["regions"][self._engine], shapes, rank)
                vllm_config = self.vllm_config
                staged = _lora.stage(self.model, vllm_config.lora_config, whole,
                                     lora["config"], int(lora["id"]),
                                     vllm_config.model_config.get_vocab_size(),
                                     getattr(vllm_config.model_config.hf_config.get_text_config(),
                                             "max_position_embeddings", None))
            except Exception as e:
                problem = f"worker {rank}: staging adapter {lora['name']!r}: " \
                          f"{type(e).__name__}: {e}"
        mine = _LOST if lost is not None else _UNPROCESSED if problem is not None else _READY
        worst = self._worst_of_engines(self._worst_of_workers(mine), step)
        if worst == _LOST:
            why = f"{type(lost).__name__}: {lost}" if lost else \
                "another worker lost a peer mid-transfer"
            self._abandon(f"worker {rank} kept the adapters it served: {why}")
            return
        if worst != _READY:  # staged nowhere, or not everywhere: nothing served changes
            if problem is not None:
                logger.error("reshard adapter push failed, nothing served changed: %s", problem)
            self._report(comm, rank, problem, times)
            return
        times.append(time.perf_counter())
        committed, old = False, None
        try:
            old = _lora.commit(self.model, staged)
            committed = True
        except Exception as e:
            problem = f"worker {rank}: committing adapter {lora['name']!r}: " \
                      f"{type(e).__name__}: {e}"
        # A commit that failed anywhere puts the replaced adapter back everywhere.
        if self._worst_of_engines(self._worst_of_workers(
                _READY if problem is None else _UNPROCESSED), f"{step}/commit") != _READY:
            if committed:
                _lora.uncommit(self.model, int(lora["id"]), old)
            if problem is not None:
                logger.error("reshard adapter push failed, the adapter it replaced is served: "
                             "%s", problem)
        times.append(time.perf_counter())
        self._report(comm, rank, problem, times)

    def finish_weight_update(self) -> None:
        self._open = False  # update_weights has committed (or restored) already

    def shutdown(self) -> None:
        for group in self._comms:
            group.shutdown()
        self._comms = []
        self._comm = None
        self._sync = None
        self._adapter_stages = {}

