"""`bench churn`'s kinds of change (churn_bench.py runs them): what each
does to the engines, the daemon, the tiers and the files under them, and how
often it is drawn (CHANGES): graceful restarts, kill -9, a new engine
attaching, the checkpoint rewritten in place or its config.json edited (then
a rolling restart), weights changed in memory through the loader or in
place by a collective_rpc, the connector reset by a pause, eviction storms
(a writer filling the segment), the daemon (the cache's maintainer and
controller) killed with -9 and started again, POST /clear of one namespace,
the disk tier's file system filled and freed (a tmpfs of its own: root),
Redis killed and started empty or flushed, a LoRA adapter's directory
rewritten in place, and a tensor-parallel-2 engine whose one rank finds its
chunks gone between the scheduler's lookup and its load (shmkv.testing's
EVICT_BEFORE_LOAD switch for one rank, as another engine's eviction would
do: the request must come back right, recomputed; started at its first draw
and kept, vLLM's own process split). Each change records the parameters it drew in
its history record, so that a replay applies the same change.

The attributes and helpers the changes use (engines by slot, the daemon,
Redis, the disk tier's mount, the recorded parameters) are the run's
(churn_bench.Churn)."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from typing import Any

import xxhash

from shmkv.engines.models import TEST_MODEL, write_llama

# change kind: weight (how often it is drawn, relative)
CHANGES = {
    "restart": 3, "kill9": 2, "attach": 1, "weights_rewrite": 1, "config_edit": 1,
    "reload_weights": 1, "inplace_weights": 1, "pause_resume": 1, "connector_reset": 1, "eviction_storm": 2,
    "daemon_kill9": 1, "clear_namespace": 1, "disk_full": 1, "redis_restart": 1, "redis_flush": 1,
    "lora_rewrite": 1, "tp2_rank_eviction": 1,
}
ADAPTERS = ("A", "B")  # LoRA adapters some conversations use (their ids: 1, 2)
LORA_KW = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
DISK_CAPACITY = 256 << 20  # the disk tier's byte cap; its tmpfs (disk_full) is a little larger
DISK_FS_SLACK = 64 << 20
NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight")
CHUNK = 256
TP2_SLOT = "tp2"  # the TP=2 engine's name in the history (not one of the drawn engines)
TRUTH_LOGPROBS = 3  # the truth's top tokens per position: a differing answer is told apart from a near tie
FAILED_BLOCKS = "vllm:shmkv_load_failed_blocks"  # LLM.get_metrics' name: blocks vLLM recomputed
STORM_NAMESPACE = xxhash.xxh3_128_digest(b"shmkv bench churn: eviction storm")  # no engine's namespace


class ChangeKinds:
    """The changes, one method each (`_<kind>`), mixed into churn_bench.Churn."""

    def _restart(self, rec: dict[str, Any]) -> None:
        slot = self._slot(rec)
        self.stop(slot)
        self.start(slot)

    def _kill9(self, rec: dict[str, Any]) -> None:
        """kill -9 right after a request was sent (its prefill and stores in flight)."""
        slot = self._slot(rec)
        e = self.engines[slot]
        assert e is not None and e.proc.stdin is not None
        p = self.pool[self._drawn(rec, "prompt", lambda: self.rng.randrange(len(self.pool)))]
        e.proc.stdin.write((json.dumps({"cmd": "generate", "prompts": [p.tokens], "max_tokens": 8,
                                        "salts": [p.salt]}) + "\n").encode())
        e.proc.stdin.flush()
        # NOTE: a random point of the request, not a race being hidden
        time.sleep(self._drawn(rec, "delay_s", lambda: round(self.rng.uniform(0.0, 0.3), 3)))
        self.stop(slot, kill=True)
        self.start(slot)

    def _attach(self, rec: dict[str, Any]) -> None:
        if len(self.engines) < self.a.engines + 1:
            self.engines.append(None)
        free = [i for i, e in enumerate(self.engines) if e is None]
        if not free:  # every slot is live: the newest leaves, a fresh one attaches in its place
            self.stop(len(self.engines) - 1)
            free = [len(self.engines) - 1]
        rec["engine"] = free[0]
        self.start(free[0])

    def _rolling(self, rec: dict[str, Any]) -> None:
        """Engines restarted one by one, a request between each (old and new weights serve side by side);
        each restart is a step of the history (a replay follows the recorded steps instead)."""
        if self.replaying:
            return
        for slot in self.live():
            self.step(slot)
            self.request()
        rec["restarted"] = len(self.live())

    def step(self, slot: int) -> None:
        """One engine of a rolling restart restarted."""
        self.history.append({"type": "step", "engine": slot, "t": round(time.monotonic() - self.t0, 3)})
        self.stop(slot)
        self.start(slot)

    def _weights_rewrite(self, rec: dict[str, Any]) -> None:
        self.version += 1
        os.unlink(os.path.join(self.model, "shmkv_spec.json"))
        write_llama(self.model, replace(TEST_MODEL, seed=self.version))  # same path, new bytes
        rec["version"] = self.version
        self._rolling(rec)

    def _config_edit(self, rec: dict[str, Any]) -> None:
        path = os.path.join(self.model, "config.json")
        with open(path) as f:
            config = json.load(f)
        self.rope = 20000.0 if self.rope == 10000.0 else 10000.0
        config["rope_theta"] = self.rope
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        rec["rope_theta"] = self.rope
        self._rolling(rec)

    def _reload_weights(self, rec: dict[str, Any]) -> None:
        slot = self._slot(rec)
        name = self._drawn(rec, "param", lambda: self.rng.choice(NORMS))
        self.engines[slot].negate_weight(name, through_loader=True)  # type: ignore[union-attr]

    def _inplace_weights(self, rec: dict[str, Any]) -> None:
        slot = self._slot(rec)
        name = self._drawn(rec, "param", lambda: self.rng.choice(NORMS))
        reset = self._drawn(rec, "reset", lambda: self.rng.random() < 0.5)
        self.engines[slot].negate_weight(name, through_loader=False, reset=reset)  # type: ignore[union-attr]

    def _pause_resume(self, rec: dict[str, Any]) -> None:
        self.engines[self._slot(rec)].pause_and_resume()  # type: ignore[union-attr]

    def _connector_reset(self, rec: dict[str, Any]) -> None:
        self.engines[self._slot(rec)].reset_prefix_cache(connector=True)  # type: ignore[union-attr]

    def _eviction_storm(self, rec: dict[str, Any]) -> None:
        """Another process's writer fills the segment (its own namespace): the engines' chunks are evicted."""
        from shmkv import Store

        store = Store.attach(self.cache)
        try:
            before = store.stats()["evictions"]
            junk = os.urandom(CHUNK * 1024)
            n, target = 0, store.stats()["arena_bytes"]
            while n * len(junk) < target:
                store.put(uuid.uuid4().bytes, junk, namespace=STORM_NAMESPACE, tokens=CHUNK)
                n += 1
            rec.update(puts=n, evictions=store.stats()["evictions"] - before)
        finally:
            store.close()

    def _daemon_kill9(self, rec: dict[str, Any]) -> None:
        """kill -9 of the daemon (an engine's embedded maintainer takes the role), then a new one adopts the
        segment and takes the role back."""
        rec["pid"] = self.daemon.pid if self.daemon is not None else None
        self.stop_daemon(kill=True)
        self.start_daemon()

    def _lora_rewrite(self, rec: dict[str, Any]) -> None:
        """One adapter's directory rewritten in place with other tensors, under the same name and id: engines
        that read it keep serving what they read, an engine reading it later gets the new tensors."""
        from shmkv.engines.models import write_lora

        name = self._drawn(rec, "adapter", lambda: self.rng.choice(ADAPTERS))
        self.adapter_version[name] += 1
        rec["version"] = self.adapter_version[name]
        write_lora(self.adapters[name], seed=1 + ADAPTERS.index(name) + 100 * self.adapter_version[name])

    def _redis_restart(self, rec: dict[str, Any]) -> None:
        """The remote tier's server killed (-9) and started again on its port, empty."""
        self.redis.kill()
        self.redis.start()

    def _redis_flush(self, rec: dict[str, Any]) -> None:
        """FLUSHALL on the remote tier's server (every host's chunks there gone)."""
        client = self.redis.client()
        try:
            rec["keys"] = client.dbsize()
            client.flushall()
        finally:
            client.close()

    def _clear_namespace(self, rec: dict[str, Any]) -> None:
        """POST /clear of one namespace the engines registered (its chunks in memory and on disk gone)."""
        roots = sorted(n["root"] for n in self.controller("GET", "/namespaces")["namespaces"])
        if not roots and "namespace" not in self.recorded:
            rec["removed"] = {}
            return
        root = self._drawn(rec, "namespace", lambda: self.rng.choice(roots))
        rec["removed"] = self.controller("POST", "/clear", {"namespace": root})["removed"]

    def _disk_full(self, rec: dict[str, Any]) -> None:
        """The disk tier's file system filled by another file (spills fail: ENOSPC), or, when it is full,
        freed again (spills resume)."""
        filler = os.path.join(self.disk_fs, "filler")
        if self.recorded.get("filled", not self.disk_filled) == self.disk_filled:  # a replay's: already so
            rec["filled"] = self.disk_filled
            return
        if self.disk_filled:
            os.unlink(filler)
            self.disk_filled = False
            rec["filled"] = False
            return
        block = b"\0" * (1 << 20)
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(block)
                    f.flush()
            except OSError:  # ENOSPC: full
                pass
        self.disk_filled = rec["filled"] = True

    def _tp2_rank_eviction(self, rec: dict[str, Any]) -> None:
        """A prompt asked twice of the TP=2 engine: the first stores both ranks' shards, the second finds
        them at lookup and then one rank's gone at its load (the switch): vLLM recomputes, and the answer
        is checked against that engine's own recompute even when it reports no hit."""
        rank = self._drawn(rec, "rank", lambda: self.rng.randrange(2) if self.tp2 is None else self.tp2_rank)
        if self.tp2 is not None and rank != self.tp2_rank:  # a replay's other rank
            self.stop_tp2()
        if self.tp2 is None:
            self.start_tp2(rank)
        assert self.tp2 is not None
        plain = [q.id for q in self.pool if q.adapter is None]  # the TP=2 engine runs without LoRA
        p = self.pool[self._drawn(rec, "prompt", lambda: self.rng.choice(plain))]
        before = self.tp2.metrics().get(FAILED_BLOCKS, 0.0)
        for _ in range(2):
            got = self.checked(self.tp2, TP2_SLOT, p, check_miss=True)
            if got["verdict"] in ("hang", "error"):
                self.stop_tp2(kill=True)
                return
        rec["failed_blocks"] = int(self.tp2.metrics().get(FAILED_BLOCKS, 0.0) - before)

    # ------------------------------------------------------------------ run --
