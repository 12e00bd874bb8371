"""One process group over trainer processes and an engine's workers, beside the default
groups each side already has (torch.distributed's world of the trainer, vLLM's own in its
workers): a TCPStore the first trainer process serves and a ProcessGroup object built over
it (gloo, or NCCL with every process on a GPU of its own), used through
:class:`reshard.distributed.Transport`. Ranks: the trainer processes first (0 .. T-1), then
the engine's workers (T .. T+W-1)."""

from __future__ import annotations

import atexit
import datetime
import pickle
import weakref
from typing import TYPE_CHECKING, Any

from ..distributed import Transport

if TYPE_CHECKING:
    import torch


def serve_store(host: str, timeout_s: float) -> Any:
    """A TCPStore served by this process on a free port of ``host`` (``store.port``)."""
    from torch._C._distributed_c10d import TCPStore
    return TCPStore(host, 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def join_store(host: str, port: int, timeout_s: float) -> Any:
    from torch._C._distributed_c10d import TCPStore
    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


# Groups still open when the interpreter exits are shut down first: torch 2.13's gloo can abort
# the process in C++ ("terminate called without an active exception") when a process group's
# threads meet interpreter finalization.
_OPEN: "weakref.WeakSet[StoreGroup]" = weakref.WeakSet()


@atexit.register
def _shut_down_open_groups() -> None:
    for group in list(_OPEN):
        group.shutdown()


class StoreGroup(Transport):
    """``size`` processes over ``store`` under ``prefix``; this one is ``rank``."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, backend: str,
                 timeout_s: float) -> None:
        import torch
        import torch.distributed as dist
        self.rank = rank
        self.members = list(range(size))
        self.backend = backend
        from torch._C._distributed_c10d import PrefixStore
        self.store = PrefixStore(prefix, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: Any
        if backend == "nccl":  # every process on a GPU of its own (NCCL refuses a shared one)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(self.store, rank, size, options)
        elif backend == "gloo":
            self._device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        else:
            raise ValueError(f"backend {backend!r}: reshard's weight sync runs over \"gloo\" "
                             "(CPU) or \"nccl\" (GPU)")
        _OPEN.add(self)

    def device(self) -> "torch.device":
        return self._device

    def gather_object(self, value: Any) -> list[Any]:
        import torch
        data = pickle.dumps(value)
        n = len(self.members)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        sizes = [torch.empty(1, dtype=torch.int64, device=self._device) for _ in range(n)]
        self.pg.allgather([sizes], [size]).wait()
        lengths = [int(s.item()) for s in sizes]
        top = max(lengths)
        mine = torch.zeros(top, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        payloads = [torch.empty(top, dtype=torch.uint8, device=self._device) for _ in range(n)]
        self.pg.allgather([payloads], [mine.to(self._device)]).wait()
        return [pickle.loads(p[:k].cpu().numpy().tobytes()) for p, k in zip(payloads, lengths)]

    def any_flag(self, flag: bool) -> bool:
        import torch
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device)
        self.pg.allreduce([t]).wait()
        return bool(int(t.item()))

    def exchange(self, sends: "list[tuple[torch.Tensor, int]]",
                 receives: "list[tuple[torch.Tensor, int]]") -> list[Any]:
        if self.backend == "nccl":  # one NCCL group call: no pair waits on the other's order
            self.pg._start_coalescing(self._device)
            for t, peer in sends:
                self.pg.send([t], peer, 0)
            for t, peer in receives:
                self.pg.recv([t], peer, 0)
            return [self.pg._end_coalescing(self._device)]
        works = [self.pg.send([t], peer, 0) for t, peer in sends]
        return works + [self.pg.recv([t], peer, 0) for t, peer in receives]

    def send(self, t: "torch.Tensor", peer: int) -> None:
        self.exchange([(t, peer)], [])[0].wait()

    def recv(self, t: "torch.Tensor", peer: int) -> None:
        self.exchange([], [(t, peer)])[0].wait()

    def shutdown(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # already broken: nothing left to release
                pass
