"""vLLM integration: `kv_connector="ShmKVConnector"` (registered with vLLM's
connector factory by the `vllm.general_plugins` entry point `register`, so no
module path is needed), or explicitly `kv_connector_module_path="shmkv.integration.vllm"`.

The connector (and vLLM with it) is imported on first access, so the planner
and worker modules stay importable without loading vLLM.
"""

from typing import Any

__all__ = ["ShmKVConnector", "ShmKVMetadata"]


def register() -> None:
    """vLLM general plugin (entry point `vllm.general_plugins: shmkv`): make
    `kv_connector="ShmKVConnector"` work without kv_connector_module_path, and
    `{"type": "shmkv"}` a secondary tier of vLLM's native offloading.
    vLLM calls it in every process it starts, before a worker loads its model;
    it imports vLLM's model loader (to hook it) and nothing of shmkv's data path."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "ShmKVConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("ShmKVConnector", "shmkv.integration.vllm.connector",
                                              "ShmKVConnector")
    # the weights' identity: the tensors as loaded (before kernel processing), and every call from the
    # engine to its workers that may change them (loaded_weights.py)
    from shmkv.integration.vllm.loaded_weights import install_hooks, when_imported

    install_hooks(native_watch=_native_watch)
    # vLLM's native offloading: the tier's keys name the engine's configuration (native_identity.py)
    when_imported("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", _native_config_hook)
    try:  # vLLM's native offloading: {"type": "shmkv"} in secondary_tiers (native_tier.py)
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:
        return
    if "shmkv" not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier("shmkv", "shmkv.integration.vllm.native_tier", "ShmkvSecondaryTier")


def _native_watch(model: Any, vllm_config: Any) -> None:
    from shmkv.integration.vllm.native_identity import watch_loaded

    watch_loaded(model, vllm_config)


def _native_config_hook(module: Any) -> None:
    from shmkv.integration.vllm.native_identity import install_config_hook

    install_config_hook(module)


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shmkv.integration.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
