"""shmkv: one shared-memory KV-cache tier for every vLLM process on a host.

Public API:
    Store, PutResult         the shared-memory chunk store (shmkv.store)
    chunk_keys, Namespace    prefix-chained chunk keys (shmkv.keys)
    KVLayout                 vLLM KV-cache layout descriptor and copies (shmkv.transfer.layout)
    errors                   the exception hierarchy (shmkv.errors)
"""

from shmkv.errors import ShmkvError
from shmkv.store import PutResult, Store

__version__ = "0.1.0"

__all__ = ["PutResult", "ShmkvError", "Store", "__version__"]
