"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every one of its
processes (a server's API process, the engine core and each worker), which makes the
weight-transfer backend ``"reshard"`` known there, and the LoRA resolver ``"reshard"`` that
lets a ``vllm serve`` server serve a pushed adapter by its name. Nothing else is imported until
an engine or a server asks for it."""

from __future__ import annotations

BACKEND = "reshard"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.lora.resolver import LoRAResolverRegistry
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "reshard.vllm.engine",
                                                    "ReshardWeightTransferEngine")
    except ValueError:  # registered already (the plugin ran twice in this process)
        pass
    if BACKEND not in LoRAResolverRegistry.get_supported_resolvers():
        from ._lora import resolver
        LoRAResolverRegistry.register_resolver(BACKEND, resolver())
