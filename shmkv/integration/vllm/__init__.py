"""vLLM integration: `kv_connector_module_path="shmkv.integration.vllm"`,
`kv_connector="ShmKVConnector"`.

The connector (and vLLM with it) is imported on first access, so the planner
and worker modules stay importable without loading vLLM.
"""

from typing import Any

__all__ = ["ShmKVConnector", "ShmKVMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shmkv.integration.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
