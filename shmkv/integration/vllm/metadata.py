"""What the two halves tell each other, pickled by vLLM: each step the
scheduler half ships the step's loads and stores to the workers (with the
SchedulerOutput), and once, at engine start, each worker reports whether it
can serve the connector and the shapes of its payload sections (vLLM's
handshake: get_handshake_metadata on the workers, set_xfer_handshake_metadata
on the scheduler, before the first request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

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
    # blocks vLLM gave out this step (new blocks of every request past its own prefix-cache hit,
    # copy-on-write targets, zeroed blocks; planner.ALL_BLOCKS: any): a pending store reading one must read it before
    # this step writes it; prewritten_blocks: those the runner may write before the connector's
    # first call of the step (zeroing, copy-on-write, Mamba's state pre-copy; Model Runner V2)
    reused_blocks: set[int] = field(default_factory=set)
    prewritten_blocks: set[int] = field(default_factory=set)
    # engines of several KV-cache groups load asynchronously (vLLM takes a failed load back
    # only per request there): these requests' loads are reported in finished_recving, and
    # failed_recving if they fail; failed_loads could not even be planned
    async_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    # the scheduler half's last weights check request (weights.py): a worker that has not answered
    # it fingerprints its weights before this step's copies
    check_weights: int = 0
    # per request with loads or stores this step that has a LoRA adapter: (lora_int_id, the digest its keys
    # name); a worker holding another adapter under that id refuses its loads and no rank stores it (adapters.py)
    adapters: dict[str, tuple[int, str]] = field(default_factory=dict)
    # ... of them loading this step, whose adapter vLLM reads again when they compute (load_inplace)
    adapter_rereads: set[str] = field(default_factory=set)


@dataclass
class ShmKVWorkerReport(KVConnectorHandshakeMetadata):
    """One worker's answer at engine start: `off_reason` None when it copies
    this engine's KV cache; `sections` names the payload's per-shape
    sections where a KV-cache group's layers differ in shape ("" when every
    group has one shape: plain engines keep their keys); `weights` the
    digest of the rank's weights (loaded_weights.py)."""

    tp_rank: int
    off_reason: str | None = None
    sections: str = ""
    # the rank's weights as it computes with them (loaded_weights.py): a digest and its basis
    # ("loaded", "held"); "" where no model was found (the files' digest names the weights alone)
    weights: str = ""
    weights_basis: str = ""
