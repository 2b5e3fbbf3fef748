"""What the scheduler half ships to the workers each step (pickled by vLLM
with the SchedulerOutput): the step's loads and stores, and per request what
the logs say about it."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from shmkv.transfer.items import LoadItem, StoreItem


@dataclass
class RequestSummary:
    req_id: str
    prompt_tokens: int
    local_tokens: int
    hit_tokens: int


@dataclass
class ShmKVMetadata(KVConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    stores: list[StoreItem] = field(default_factory=list)
    summaries: dict[str, RequestSummary] = field(default_factory=dict)
    # blocks promised to vLLM whose loads could not be planned: the worker reports them as load errors
    failed_blocks: set[int] = field(default_factory=set)
    # requests vLLM preempted this step: their blocks may be reused by this step's forward
    preempted: set[str] = field(default_factory=set)
    # engines of several KV-cache groups load asynchronously (vLLM takes a failed load back
    # only per request there): these requests' loads are reported in finished_recving, and
    # failed_recving if they fail; failed_loads could not even be planned
    async_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
