"""vLLM integration: `kv_connector_module_path="shmkv.integration.vllm"`,
`kv_connector="ShmKVConnector"`."""

from shmkv.integration.vllm.connector import ShmKVConnector, ShmKVMetadata

__all__ = ["ShmKVConnector", "ShmKVMetadata"]
