"""shmkv in vLLM's own metrics.

Two ways in, both vLLM 0.32 interfaces:
  * hit tokens by tier: the scheduler half answers
    `get_external_cache_hit_sources`, so vLLM's own
    `vllm:prompt_tokens_cached_by_source{source=...}` splits shmkv's hits into
    `host` (the shared-memory tier), `disk` and `external_unspecified` (the
    remote tier), labelled like every vLLM metric (model name, engine);
  * transfer stats: the worker half returns ShmKVStats from
    `get_kv_connector_stats` each step (pickled to the front end with the
    step's output); vLLM aggregates them and calls ShmKVPromMetrics.observe,
    which feeds `vllm:shmkv_loaded_tokens_total`, `vllm:shmkv_stored_tokens_total`
    and the `vllm:shmkv_load_seconds` / `vllm:shmkv_store_seconds` histograms;
    the scheduler half adds the gauge `vllm:shmkv_connector_on` (1: the
    connector serves this engine, 0: it turned off, the log says why) at
    start and whenever it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from shmkv.names import DISK, REMOTE, SHM

# tier of the chain -> vLLM's CacheHitSource value
HIT_SOURCES = {SHM: "host", DISK: "disk", REMOTE: "external_unspecified"}

COUNTERS = {  # stats key -> (metric, help)
    "loaded_tokens": ("vllm:shmkv_loaded_tokens_total", "Prompt tokens whose KV shmkv loaded into the paged cache"),
    "stored_tokens": ("vllm:shmkv_stored_tokens_total", "Prompt tokens whose KV shmkv stored in the shared tier"),
    "load_failed_blocks": ("vllm:shmkv_load_failed_blocks_total",
                           "Blocks shmkv could not load (evicted or damaged): recomputed by vLLM"),
}
HISTOGRAMS = {  # stats key -> (metric, help)
    "load_seconds": ("vllm:shmkv_load_seconds", "Time to load one step's hits into the paged cache"),
    "store_seconds": ("vllm:shmkv_store_seconds", "Time from issuing a chunk's store to its commit in the shared tier"),
}
GAUGES = {  # stats key -> (metric, help)
    "connector_on": ("vllm:shmkv_connector_on",
                     "1 while shmkv serves this engine; 0 once it turned off for it (the engine's log says why)"),
}
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class ShmKVStats(KVConnectorStats):
    """{"counters": {key: n}, "observations": {key: [seconds, ...]}, and
    optionally "gauges": {key: value}}, plain data (it travels between
    processes; the latest gauge value wins)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "observations": {}}

    def count(self, key: str, n: float) -> None:
        if n:
            self.data["counters"][key] = self.data["counters"].get(key, 0) + n

    def observe(self, key: str, seconds: float) -> None:
        self.data["observations"].setdefault(key, []).append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.get("counters", {}).items():
            self.count(k, v)
        for k, vs in other.data.get("observations", {}).items():
            self.data["observations"].setdefault(k, []).extend(vs)
        if other.data.get("gauges"):
            self.data.setdefault("gauges", {}).update(other.data["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for k, vs in self.data["observations"].items():
            if vs:
                out[f"{k}_avg_ms"] = round(1e3 * sum(vs) / len(vs), 3)
        out.update(self.data.get("gauges", {}))
        return out

    def is_empty(self) -> bool:
        return (not self.data["counters"] and not any(self.data["observations"].values())
                and not self.data.get("gauges"))


class ShmKVPromMetrics(KVConnectorPromMetrics):
    """shmkv's transfer metrics, one child per engine (vLLM's labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {k: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for k, (name, doc) in COUNTERS.items()}
        self._histograms = {k: self._histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                                   buckets=_BUCKETS)
                            for k, (name, doc) in HISTOGRAMS.items()}
        self._gauges = {k: self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                           multiprocess_mode="mostrecent")
                        for k, (name, doc) in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, v in transfer_stats_data.get("counters", {}).items():
            if k in self._counters:
                self._counters[k].labels(*labels).inc(v)
        for k, vs in transfer_stats_data.get("observations", {}).items():
            if k in self._histograms:
                child = self._histograms[k].labels(*labels)
                for v in vs:
                    child.observe(v)
        for k, v in transfer_stats_data.get("gauges", {}).items():
            if k in self._gauges:
                self._gauges[k].labels(*labels).set(v)
