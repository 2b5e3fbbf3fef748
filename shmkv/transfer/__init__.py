"""The transfer path between vLLM's paged KV cache and the store (no vLLM
import anywhere here):

    layout.py         a KV cache's layout (KVLayout) and its copies
    copy_backends.py  the CPU and CUDA gather/scatter backends, the copy engine choice
    gpu.py            the segment registered with CUDA (pinned, mapped)
    items.py          units as windows of block ids
    streams.py        CPU and CUDA copy streams and events
    engine.py         the façade (TransferEngine): what both directions share, loads after stores
    loads.py          loads: leases, issue-ahead by layer, compressed decode, completion
    stores.py         stores: reservations, gathers, commit or abort, ordering the compute after them

May import the store, the chunk format (shmkv.tiers.format) and
shmkv._C/_C_cuda; never the tier chain, the services or the integrations.
"""

from shmkv.transfer.engine import LoadJob, RequestTally, TransferEngine
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

__all__ = ["GroupWindow", "LoadItem", "LoadJob", "RequestTally", "StoreItem", "TransferEngine"]
