"""`shmkv bench churn`: several vLLM engines share one cache while the world
changes under it, and every answer is checked (#64).

A seeded stream of requests (multi-turn conversations on shared system
prompts, some with a tenant's cache salt) goes to engines that share one
segment (the disk tier on). Between requests a scheduler applies changes
drawn by weight (CHANGES): graceful restarts, kill -9, a new engine
attaching, the checkpoint rewritten in place or its config.json edited (then
a rolling restart), weights changed in memory through the loader or in
place by a collective_rpc, the connector reset by a pause, eviction storms
(a writer filling the segment).

Every answer that used loaded KV is checked against the truth for the
weights and config that engine had at that moment: the same request
recomputed by the same engine right after, under a fresh cache salt (no
shmkv chunk can match it) and at the same split (its prefix computed first
into vLLM's own prefix cache: vllm_connector_api.md §9, the split alone can
flip a greedy token). Before each measured request vLLM's own prefix cache
is emptied, so every reuse comes through shmkv.

The run fails on any wrong answer, a request that did not answer within
--request-timeout (a hang), an engine error, no hit at all (a run where
shmkv silently turned itself off), or a lease still held once every engine
ended and the dead ones' leases were reclaimed. Output: the JSON history
(every change and request: engine, hit tokens, verdict), a table per change
kind (changes, requests after it, hits, wrong, hangs), optionally a PNG
timeline; `--seed` replays a run's draws.

Not yet drawn: the daemon's kill -9, LoRA rewrites, sleep level 2, a full disk
tier, a Redis tier, POST /clear, a TP=2 rank's eviction between lookup and
load (each has its own end-to-end test in tests/)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from shmkv.bench import drop_cache
from shmkv.bench.engines import EngineProcess, EngineSpec
from shmkv.bench.models import TEST_MODEL, write_llama

# change kind: weight (how often it is drawn, relative)
CHANGES = {
    "restart": 3, "kill9": 2, "attach": 1, "weights_rewrite": 1, "config_edit": 1,
    "reload_weights": 1, "inplace_weights": 1, "pause_resume": 1, "connector_reset": 1, "eviction_storm": 2,
}
NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight")
CHUNK = 256
STORM_NAMESPACE = xxhash.xxh3_128_digest(b"shmkv bench churn: eviction storm")  # no engine's namespace


@dataclass
class Prompt:
    id: int
    tokens: list[int]
    salt: str | None  # a tenant's cache salt (its conversation's)


def prompt_pool(rng: random.Random, systems: int = 3, conversations: int = 6, turns: int = 3,
                system_tokens: int = 512, vocab: int = TEST_MODEL.vocab_size) -> list[Prompt]:
    """Conversations on shared system prompts, each turn the last one's
    prompt, an answer and a new question; a quarter of the conversations
    under a tenant's salt."""
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
    return out


class Churn:
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
        self.cfg = {"cache_name": self.cache, "capacity": a.capacity,
                    "disk_dir": os.path.join(a.workdir, "disk"), "disk_capacity": "256MiB"}
        self.pool = prompt_pool(self.rng)
        self.engines: list[EngineProcess | None] = [None] * a.engines
        self.starts = 0
        self.history: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.last_change: str = "start"

    # -------------------------------------------------------------- engines --
    def start(self, slot: int) -> None:
        self.starts += 1
        spec = EngineSpec(self.model, shmkv=self.cfg, prefix_caching=True, in_process=True, max_model_len=2048)
        log = os.path.join(self.workdir, f"engine-{slot}-{self.starts}.log")
        self.engines[slot] = EngineProcess(spec, log, launch=self.launch)

    def stop(self, slot: int, kill: bool = False) -> None:
        e = self.engines[slot]
        self.engines[slot] = None
        if e is not None:
            e.kill() if kill else e.close()

    def live(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e is not None]

    # ------------------------------------------------------------- requests --
    def request(self) -> None:
        slot = self.rng.choice(self.live())
        p = self.rng.choice(self.pool)
        e = self.engines[slot]
        assert e is not None
        rec: dict[str, Any] = {"type": "request", "t": round(time.monotonic() - self.t0, 3), "engine": slot,
                               "prompt": p.id, "salt": p.salt, "after": self.last_change}
        self.history.append(rec)
        try:
            e.reset_prefix_cache()  # every reuse through shmkv
            r = self._generate(e, p.tokens, p.salt)
            rec.update(hit=r["num_cached_tokens"][0], wall_s=round(r["wall_s"], 4))
            if rec["hit"] == 0:
                rec["verdict"] = "miss"
                return
            truth, split = self.truth(e, p, rec["hit"])
            if split != rec["hit"]:
                rec.update(verdict="unchecked", truth_split=split)
            else:
                rec["verdict"] = "right" if truth == r["outputs"][0] else "WRONG"
                if rec["verdict"] == "WRONG":
                    rec.update(output=r["outputs"][0], truth=truth)
        except (TimeoutError, RuntimeError) as err:  # no answer in time / the engine failed: a fresh one goes on
            rec.update(verdict="hang" if isinstance(err, TimeoutError) else "error", error=str(err)[:4000])
            self.stop(slot, kill=True)
            self.start(slot)

    def _generate(self, e: EngineProcess, tokens: list[int], salt: str | None, max_tokens: int | None = None
                  ) -> dict[str, Any]:
        return e.call(cmd="generate", prompts=[tokens], max_tokens=max_tokens or self.a.max_tokens, salts=[salt],
                      loras=None, logprobs=0, timeout=self.a.request_timeout)

    def truth(self, e: EngineProcess, p: Prompt, split: int) -> tuple[list[int], int]:
        """The engine's own answer with nothing of shmkv's reused, at `split`:
        under a fresh salt, its first `split` tokens computed into vLLM's own
        prefix cache first."""
        salt = f"truth-{uuid.uuid4().hex}"
        e.reset_prefix_cache()
        self._generate(e, p.tokens[: split + 1], salt, max_tokens=1)
        r = self._generate(e, p.tokens, salt)
        return r["outputs"][0], r["num_cached_tokens"][0]

    # -------------------------------------------------------------- changes --
    def change(self, index: int) -> None:
        kinds = [k for k in CHANGES if k in self.a.kinds]
        kind = self.rng.choices(kinds, weights=[CHANGES[k] for k in kinds])[0]
        rec: dict[str, Any] = {"type": "change", "index": index, "kind": kind,
                               "t": round(time.monotonic() - self.t0, 3)}
        self.history.append(rec)
        self.last_change = kind  # a rolling restart's requests in between count as after it
        getattr(self, f"_{kind}")(rec)
        rec["done_t"] = round(time.monotonic() - self.t0, 3)

    def _slot(self, rec: dict[str, Any]) -> int:
        rec["engine"] = slot = self.rng.choice(self.live())
        return slot

    def _restart(self, rec: dict[str, Any]) -> None:
        slot = self._slot(rec)
        self.stop(slot)
        self.start(slot)

    def _kill9(self, rec: dict[str, Any]) -> None:
        """kill -9 right after a request was sent (its prefill and stores in flight)."""
        slot = self._slot(rec)
        e = self.engines[slot]
        assert e is not None and e.proc.stdin is not None
        p = self.rng.choice(self.pool)
        e.proc.stdin.write((json.dumps({"cmd": "generate", "prompts": [p.tokens], "max_tokens": 8,
                                        "salts": [p.salt]}) + "\n").encode())
        e.proc.stdin.flush()
        time.sleep(self.rng.uniform(0.0, 0.3))  # NOTE: a random point of the request, not a race being hidden
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
        """Engines restarted one by one, a request between each (old and new weights serve side by side)."""
        for slot in self.live():
            self.stop(slot)
            self.start(slot)
            self.request()
        rec["restarted"] = len(self.live())

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
        rec["param"] = name = self.rng.choice(NORMS)
        self.engines[slot].negate_weight(name, through_loader=True)  # type: ignore[union-attr]

    def _inplace_weights(self, rec: dict[str, Any]) -> None:
        slot = self._slot(rec)
        rec["param"] = name = self.rng.choice(NORMS)
        rec["reset"] = reset = self.rng.random() < 0.5
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

    # ------------------------------------------------------------------ run --
    def run(self) -> dict[str, Any]:
        for slot in range(self.a.engines):
            self.start(slot)
        for _ in range(self.a.requests_per_change):
            self.request()
        for i in range(self.a.changes):
            self.change(i)
            for _ in range(self.a.requests_per_change):
                self.request()
        return self.finish()

    def finish(self) -> dict[str, Any]:
        from shmkv import Store

        for slot in self.live():
            self.stop(slot)
        store = Store.attach(self.cache)
        try:
            held_at_end = store.stats()["leases_held"]
            reclaimed = store.reclaim()
            st = store.stats()
        finally:
            store.close()
        requests = [r for r in self.history if r["type"] == "request"]
        verdicts = Counter(r.get("verdict") for r in requests)
        per_kind: dict[str, dict[str, int]] = {}
        for k in ["start", *CHANGES]:
            after = [r for r in requests if r["after"] == k]
            per_kind[k] = {"changes": sum(1 for c in self.history if c["type"] == "change" and c["kind"] == k),
                           "requests_after": len(after), "hits_after": sum(1 for r in after if r.get("hit")),
                           **{v: sum(1 for r in after if r.get("verdict") == v)
                              for v in ("WRONG", "hang", "error", "unchecked")}}
        failed = []
        if verdicts["WRONG"]:
            failed.append(f"{verdicts['WRONG']} wrong answers")
        if verdicts["hang"]:
            failed.append(f"{verdicts['hang']} requests did not answer within {self.a.request_timeout} s")
        if verdicts["error"]:
            failed.append(f"{verdicts['error']} engine errors")
        if not any(r.get("hit") for r in requests):
            failed.append("no request hit: shmkv served nothing")
        if st["leases_held"]:
            failed.append(f"{st['leases_held']} leases still held after every engine ended and a reclaim")
        out: dict[str, Any] = {
            "seed": self.a.seed, "changes": self.a.changes, "engines": self.a.engines,
            "requests": len(requests), "verdicts": dict(verdicts), "engine_starts": self.starts,
            "hit_rate": round(sum(1 for r in requests if r.get("hit")) / max(1, len(requests)), 3),
            "per_kind": per_kind, "duration_s": round(time.monotonic() - self.t0, 1),
            "leases_held_at_end": held_at_end, "leases_reclaimed": reclaimed["leases"],
            "evictions": st["evictions"], "spills": st["spills"], "disk_hits": st["disk_hits"],
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
    ap.add_argument("--request-timeout", type=float, default=300.0, help="a request that takes longer is a hang")
    ap.add_argument("--workdir", default=None, help="model, logs and disk tier (default: a temporary directory)")
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
    """`launch`: how engines start (EngineProcess's; the test suite forks them from a server)."""
    a = parse(argv)
    own_dir = a.workdir is None
    if own_dir:
        a.workdir = tempfile.mkdtemp(prefix="shmkv-bench-churn-")
    os.makedirs(a.workdir, exist_ok=True)
    churn = Churn(a, launch)
    try:
        result = churn.run()
    finally:
        for slot in churn.live():
            churn.stop(slot, kill=True)
        drop_cache(churn.cache)
        if a.history:
            with open(a.history, "w") as f:
                json.dump(churn.history, f)
        if own_dir and not _history_failed(churn.history):  # a failed run keeps its logs
            shutil.rmtree(a.workdir, ignore_errors=True)
    if a.plot:
        result["plot"] = _plot(churn.history, a.plot)
    return result


def _history_failed(history: list[dict[str, Any]]) -> bool:
    return any(r.get("verdict") in ("WRONG", "hang", "error") for r in history)


def _plot(history: list[dict[str, Any]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in history if r["type"] == "request" and "wall_s" in r]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax1.scatter([r["t"] for r in reqs], [r["hit"] for r in reqs], s=6,
                c=["red" if r.get("verdict") == "WRONG" else "tab:blue" for r in reqs])
    ax1.set_ylabel("hit tokens")
    ax2.scatter([r["t"] for r in reqs], [r["wall_s"] for r in reqs], s=6)
    ax2.set_ylabel("request wall s")
    ax2.set_xlabel("seconds since start")
    kinds = sorted({c["kind"] for c in history if c["type"] == "change"})
    colors = dict(zip(kinds, plt.cm.tab10.colors))
    for c in (c for c in history if c["type"] == "change"):
        for ax in (ax1, ax2):
            ax.axvline(c["t"], color=colors[c["kind"]], alpha=0.3, lw=0.8)
    ax1.legend(handles=[plt.Line2D([], [], color=colors[k], label=k) for k in kinds], fontsize=7, ncol=5,
               loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(r: dict[str, Any]) -> None:
    print(f"bench churn: seed {r['seed']}, {r['changes']} changes, {r['requests']} requests on "
          f"{r['engines']} engines ({r['engine_starts']} starts), {r['duration_s']} s")
    print(f"verdicts: {r['verdicts']}; hit rate {r['hit_rate']:.0%}; leases held at end {r['leases_held_at_end']} "
          f"(reclaimed {r['leases_reclaimed']}); evictions {r['evictions']}, spills {r['spills']}")
    print(f"{'after':16s} {'changes':>7s} {'requests':>8s} {'hits':>5s} {'wrong':>5s} {'hang':>4s} {'error':>5s} "
          f"{'unchecked':>9s}")
    for k, v in r["per_kind"].items():
        print(f"{k:16s} {v['changes']:7d} {v['requests_after']:8d} {v['hits_after']:5d} {v['WRONG']:5d} "
              f"{v['hang']:4d} {v['error']:5d} {v['unchecked']:9d}")
    if r.get("failed"):
        print(f"FAILED: {r['failed']}", file=sys.stderr)
