"""reshard and vLLM (DESIGN 18): live weight sync from trainer processes into a running
engine (:class:`WeightSync`; the engine side is the weight-transfer backend ``"reshard"``,
:mod:`reshard.vllm.engine`, registered by the package's ``vllm.general_plugins`` entry
point). Importing this module does not import vLLM."""

from .sync import SyncStats, WeightSync, WeightSyncError, engine_maps

__all__ = ["SyncStats", "WeightSync", "WeightSyncError", "engine_maps"]
