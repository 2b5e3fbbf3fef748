"""The transfer engine and what it moves (no vLLM import anywhere here):
items.py (units as windows of block ids), streams.py (CPU and CUDA copy
streams and events), engine.py (loads, stores and their bookkeeping)."""

from shmkv.transfer.engine import LoadJob, RequestTally, TransferEngine
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

__all__ = ["GroupWindow", "LoadItem", "LoadJob", "RequestTally", "StoreItem", "TransferEngine"]
