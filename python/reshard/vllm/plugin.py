"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every one of its
processes (the engine core and each worker), which makes the weight-transfer backend
``"reshard"`` known there. Nothing else is imported until an engine asks for it."""

from __future__ import annotations

BACKEND = "reshard"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "reshard.vllm.engine",
                                                    "ReshardWeightTransferEngine")
    except ValueError:  # registered already (the plugin ran twice in this process)
        pass
