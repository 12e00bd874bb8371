"""Live re-sharding between processes over torch.distributed (DESIGN 14).

Processes that hold a model's weights laid out by one set of maps (a trainer at TP 4) hand
them to processes that need them laid out by another (an inference engine at TP 2) without
any process building a full tensor: every process of the group calls :func:`redistribute`
(or :meth:`Redistributor.run` to plan once and sync many times) with the source shards it
holds, and gets back the target shards it holds.

How the bytes move:

- the maps of every parameter are composed once into a plan; a replicated source block is
  read from a holder in the target's own process when there is one, otherwise from the holder
  whose process has been given the fewest bytes to send so far over the whole model;
- moves inside one process are copies; every other move joins the byte stream of its
  (source process, target process) pair. Streams are cut into chunks so that each process
  stages about ``bucket_bytes`` of outgoing and of incoming data per round; the strided-copy
  engine packs a chunk from the shards (applying scale factors) and unpacks it into the
  targets, with the GIL released;
- round k sends chunk k of every stream with ``torch.distributed.batch_isend_irecv`` while
  the process packs round k + 1 (and, in round 0, makes its local copies);
- padding is never sent: a target's padding is zero-filled where it lies.

Before any byte moves, the processes agree: the constructor checks every argument (maps, rank
lists, dtypes, bucket size, options) on every process and compares them between processes,
and every run checks each process's shards and ``out`` (type, shape, dtype, device, writable,
no negative bit, no grad) and runs the moves that carry a scale factor into scratch memory on
the process that holds their data, so that a scale that would lose values is found there
before anything is sent. A failure anywhere, whatever the exception, raises
:class:`RedistributeError` on every process, naming the process and the values, instead of
leaving the others waiting. An ``out`` that overlaps the process's own source shards is
handled by reading those shards from a copy.

Tensors are packed in host memory. Shards on another device (CUDA with NCCL) are staged
through host memory explicitly: copied to the CPU to be packed, the chunks copied to the
device the group's backend communicates from, and the results copied to the device of
``out`` (or of the shards).
"""

# The modules depend one way: _quantize (FP8 blocks quantized at the source) builds on
# _redistributor (the re-sharding and its transport), which knows nothing of it.
from ._quantize import QuantizingRedistributor as QuantizingRedistributor
from ._quantize import quantize_fp8_blocks as quantize_fp8_blocks
from ._redistributor import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from ._redistributor import RedistributeError as RedistributeError
from ._redistributor import Redistributor as Redistributor
from ._redistributor import Transport as Transport
from ._redistributor import _megatron_dtypes as _megatron_dtypes
from ._redistributor import _message as _message
from ._redistributor import _torch_dtype as _torch_dtype
from ._redistributor import _TorchGroup as _TorchGroup
from ._redistributor import redistribute as redistribute

__all__ = ["DEFAULT_BUCKET_BYTES", "QuantizingRedistributor", "RedistributeError",
           "Redistributor", "Transport", "quantize_fp8_blocks", "redistribute"]
