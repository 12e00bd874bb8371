"""reshard and vLLM (DESIGN 18): vLLM's layouts learned from vLLM itself, checkpoints that vLLM's
sharded-state loader reads, and live weight sync into a running engine.

- :func:`layout` (``python -m reshard.vllm layout MODEL_DIR --tp N -o MAPS.json``): the maps of
  every checkpoint tensor onto vLLM's parameters at a tensor parallel degree, a version-2 map
  document whose buffers are vLLM's parameters. ``reshard scatter HF_DIR --maps MAPS.json -o
  OUT`` then writes files that ``LLM(model=OUT, load_format="sharded_state",
  tensor_parallel_size=N)`` loads.

Importing this package does not import vLLM; :func:`layout` does.
"""

from .layout import LayoutError, cache_dir, check_engine, layout

__all__ = ["LayoutError", "cache_dir", "check_engine", "layout"]
