"""reshard and vLLM (DESIGN 18): vLLM's layouts learned from vLLM itself, checkpoints that vLLM's
sharded-state loader reads, and live weight sync into a running engine.

- :func:`layout` (``python -m reshard.vllm layout MODEL_DIR --tp N -o MAPS.json``): the maps of
  every checkpoint tensor onto vLLM's parameters at a tensor parallel degree, a version-2 map
  document whose buffers are vLLM's parameters. ``reshard scatter HF_DIR --maps MAPS.json -o
  OUT`` then writes files that ``LLM(model=OUT, load_format="sharded_state",
  tensor_parallel_size=N)`` loads.
- :class:`WeightSync`: trainer processes push their shards into a running engine, each worker
  receiving only the bytes it lacks (the engine side is the weight-transfer backend
  ``"reshard"``, :mod:`reshard.vllm.engine`, registered by the package's
  ``vllm.general_plugins`` entry point). :meth:`WeightSync.push_lora` pushes a LoRA adapter
  into engines started with ``enable_lora=True``, served under a name
  (:meth:`WeightSync.lora_request`, its id :func:`lora_id`).

Importing this package does not import vLLM; :func:`layout` does, and so do the engine's side
and a :class:`WeightSync` that learns the engine's layout.
"""

from .layout import LayoutError, cache_dir, check_engine, layout
from ._lora import lora_id
from .sync import SyncStats, VerifyStats, WeightSync, WeightSyncError

__all__ = ["LayoutError", "SyncStats", "VerifyStats", "WeightSync", "WeightSyncError",
           "cache_dir", "check_engine", "layout", "lora_id"]
