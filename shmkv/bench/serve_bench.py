"""`shmkv bench serve`: shmkv measured the way vLLM users measure
it, with vLLM's own client (`vllm bench serve`) against `vllm serve`.

Each arm runs against fresh servers, once with vLLM alone (its prefix cache
on, as by default) and once with shmkv on its defaults, in rotated order;
the measured requests go one at a time, in order, through vLLM's client over
a custom dataset of word prompts (a word-level tokenizer is written beside
the random model's weights: token i is the word `t<i>`):

  no_reuse     distinct prompts: nothing to reuse. A control: shmkv must load
               0 tokens.
  in_cache     prefixes asked again while vLLM's own cache still holds them.
               A control: vLLM's cache serves the reuse, shmkv loads 0.
  evicted      prefixes asked, then enough other prompts to evict them from
               vLLM's cache (its size is set in blocks), then asked again.
  restart      prefixes asked of one server, which is stopped; a fresh one
               is asked them again.
  round_robin  two servers behind a round-robin proxy; system prompts, each
               asked three times in a row (so by both servers).
  budget       the same two servers with shmkv, a fixed host-memory budget
               held as one shared segment or as one segment per server
               (half each); every prefix asked by both servers.

Reuse is read from the servers' counters (vLLM's prefix_cache_hits and
external_prefix_cache_hits, shmkv's loaded tokens), never inferred from
timings; the controls fail the run on those counters.

--small (CI's check: the test model, timings not compared) starts 8
servers instead of 16: one server per variant serves no_reuse, in_cache,
evicted and restart's first half in turn, restart's fresh server is the
first of the variant's round-robin pair, and budget's shared half runs on
the shmkv round-robin pair (their one segment made of the budget's size),
vLLM's prefix cache reset before each arm (fresh prompts every arm; the
counters are differences). Output: TTFT p50/p99
and throughput per arm and variant, the ratios shmkv / vLLM alone, one JSON,
one PNG (--plot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from shmkv.bench import drop_cache
from shmkv.bench.serve_client import BenchServeClient
from shmkv.engines.models import TEST_MODEL, TIMING_MODEL, words, write_llama, write_tokenizer
from shmkv.engines.vllm_server import NO_FORK_HELP, RoundRobinProxy, VllmServer

VLLM_BLOCK = 128  # vLLM-CPU's KV block size
ARMS = ("no_reuse", "in_cache", "evicted", "restart", "round_robin", "budget")
VARIANTS = ("vllm", "shmkv")
GOALS = {"evicted": 0.3, "restart": 0.35, "round_robin": 0.6}  # shmkv TTFT p50 / vLLM alone, at most
CONTROL_TOLERANCE = 0.05  # the controls' time ratios: within 5 % of vLLM alone (reported, not failed on)
COUNTERS = {"vllm_cache_tokens": "vllm:prefix_cache_hits_total",
            "connector_tokens": "vllm:external_prefix_cache_hits_total",
            "shmkv_loaded_tokens": "vllm:shmkv_loaded_tokens_total",
            "shmkv_stored_tokens": "vllm:shmkv_stored_tokens_total",
            "prompt_tokens": "vllm:prompt_tokens_total"}


@dataclass(frozen=True)
class Workload:
    prefix_tokens: int = 1024
    suffix_tokens: int = 32
    output_tokens: int = 4
    prefixes: int = 4  # asked again in the evicted and restart arms
    in_cache_prefixes: int = 2  # ... in the in-cache arm (they must fit vLLM's cache)
    repeats: int = 2  # requests per prefix in the in-cache arm
    system_prompts: int = 3  # round-robin and budget arms (odd: each prefix moves to the other server)
    vllm_cache_prompts: int = 3  # vLLM's KV cache holds about this many prompts (evicted arm)


# NOTE: the default run (the timing model, ~100-250 prompt tokens/s per server here) takes about 30 min on
# this 2-core machine, most of it in cold prefills and 18 server starts; --small is CI's quick check
SMALL = Workload(prefix_tokens=512, suffix_tokens=32, output_tokens=4)


def _prompts(seed: int, n: int, tokens: int, vocab: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(tokens)] for _ in range(n)]


class Run:
    """One benchmark run's servers, datasets and results."""

    def __init__(self, a: argparse.Namespace, w: Workload) -> None:
        self.a, self.w = a, w
        self.spec = TEST_MODEL if a.small else TIMING_MODEL
        self.model = write_llama(os.path.join(a.workdir, "model-small" if a.small else "model"), self.spec)
        write_tokenizer(self.model, self.spec.vocab_size)
        self.logs = os.path.join(a.workdir, "logs")
        self.data = os.path.join(a.workdir, f"data-{os.getpid()}")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.data, exist_ok=True)
        prompt = w.prefix_tokens + w.suffix_tokens + w.output_tokens
        self.max_model_len = -(-prompt // VLLM_BLOCK) * VLLM_BLOCK + VLLM_BLOCK
        self.kv_blocks = w.vllm_cache_prompts * (self.max_model_len // VLLM_BLOCK)
        self.segments: list[str] = []
        self.starts: list[float] = []
        self._seed = 0
        self._n = 0
        self._client: BenchServeClient | None = None
        self._started: dict[str, VllmServer] = {}  # --small: servers started ahead, by label
        self._kept: dict[bool, VllmServer] = {}  # --small: each variant's server of the one-server arms
        self._started_segments: list[str] = []
        self._keep_for: dict[str, str] = {}  # --small: a pair's label -> the arm that reuses its servers

    def prestart(self, arm: str) -> None:
        """--small (CI's check, whose timings are not compared): the servers
        an arm needs, both variants started together; most of a small run is
        server starts. One server per variant serves every one-server arm in
        turn (one_server); restart's second server is the first of the
        variant's round-robin pair (restart)."""
        if arm in ("no_reuse", "in_cache", "evicted") and not self._kept:
            labels = [f"one-server-{_v(flag)}" for flag in (False, True)]
            caches = [None, self.segment_name("one-server")]
            self._started_segments.append(caches[1])
            self._kept.update(zip((False, True), self.servers(labels, caches, self._one_segment_capacity())))

    def _one_segment_capacity(self) -> str | None:
        """--small: the one segment every shmkv arm but split's uses, of the budget arm's size when the budget
        arm's shared half runs on the round-robin pair (keep_for_budget)."""
        return str(self.budget_bytes()) if self._keep_for else None

    @contextlib.contextmanager
    def one_server(self, arm: str, shmkv: bool) -> Iterator[VllmServer]:
        """The server of a one-server arm: a fresh one per arm, or with --small
        the variant's one server, vLLM's prefix cache reset first (what a fresh
        server holds of the arm's prompts: nothing; its segment keeps the
        earlier arms' chunks, which the arm's fresh prompts never hit; the
        counters are taken as differences)."""
        kept = self._kept.get(shmkv)
        if kept is None:
            with self.server(f"{arm}-{_v(shmkv)}", self.segment(arm) if shmkv else None) as s:
                yield s
            return
        _as_fresh([kept], arm)
        yield kept

    # ------------------------------------------------------------ helpers --
    def fresh(self, n: int, tokens: int) -> list[list[int]]:
        self._seed += 1
        return _prompts(1000 * self.a.seed + self._seed, n, tokens, self.spec.vocab_size)

    def segment_name(self, label: str) -> str:
        return f"shmkv-bench-serve-{os.getpid()}-{label}"

    def segment(self, label: str) -> str:
        """The segment of an arm's variant, unlinked after it (drop_segments)."""
        name = self.segment_name(label)
        self.segments.append(name)
        return name

    def servers(self, labels: list[str], caches: list[str | None], capacity: str | None = None,
                peer: Any = None, bind: bool = True) -> list[VllmServer]:
        """Several servers, started at once (nothing is measured meanwhile);
        `peer`: another cache's server (lmcache_peer.LMCacheServer) they all use instead of shmkv;
        `bind` False: vLLM's default binding for each (else a core of its own each, where there are enough)."""
        from concurrent.futures import ThreadPoolExecutor

        # NOTE: each server's compute threads on a core of their own, as a multi-instance host pins
        # its instances (on one core, each one's spinning OpenMP threads slow the other's prefills)
        cpus = os.sched_getaffinity(0)
        env = ([{"VLLM_CPU_OMP_THREADS_BIND": str(c), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} for c in sorted(cpus)]
               if bind and len(cpus) >= len(labels) else [{}] * len(labels))
        with ThreadPoolExecutor(len(labels)) as pool:
            futures = [pool.submit(self.server, lb, c, capacity, e, peer) for lb, c, e in zip(labels, caches, env)]
            out, errors = [], []
            try:
                for f in futures:
                    try:
                        out.append(f.result())
                    except Exception as e:  # noqa: BLE001 - the others are closed, then it is raised
                        errors.append(e)
            except BaseException:  # stopped while they start (SIGTERM, ^C): each that starts is closed
                for f in futures:
                    with contextlib.suppress(Exception):
                        f.result().close()
                raise
        if errors:
            for s in out:
                s.close()
            raise errors[0]
        return out

    def server(self, label: str, cache: str | None, capacity: str | None = None,
               env: dict[str, str] | None = None, peer: Any = None) -> VllmServer:
        started = self._started.pop(label, None)
        if started is not None:
            return started
        ktc, python = None, sys.executable
        if peer is not None:
            ktc, python = peer.connector_config, peer.python
        elif cache is not None:
            extra: dict[str, Any] = {"cache_name": cache}
            if capacity or self.a.capacity:
                extra["capacity"] = capacity or self.a.capacity
            ktc = {"kv_connector": "ShmKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        s = VllmServer(self.model, os.path.join(self.logs, f"{label}.log"), kv_transfer_config=ktc, env=env,
                       python=python, fork=getattr(self.a, "fork", True),
                       fork_children=bool(self.a.small) and getattr(self.a, "fork", True),
                       args=["--max-model-len", str(self.max_model_len),
                             "--num-gpu-blocks-override", str(self.kv_blocks)])
        self.starts.append(s.start_seconds)
        return s

    def warm(self, servers: list[VllmServer], prompts: list[list[int]], first: int = 0) -> None:
        """Untimed requests, in turn over the servers from servers[first] (as the proxy would)."""
        for i, p in enumerate(prompts):
            servers[(first + i) % len(servers)].complete(p, max_tokens=self.w.output_tokens)
        wait_stores(servers)

    def measure(self, servers: list[VllmServer], url: str, prompts: list[list[int]], label: str) -> dict[str, Any]:
        """The prompts through vLLM's client, one at a time; its figures and
        the servers' counters over exactly these requests."""
        dataset = self.dataset([{"prompt": words(p)} for p in prompts], label)
        self.warm_up(servers)
        before = server_counters(servers)
        r = self.client().run(url, self.model, dataset, dataset[:-6] + ".result.json", requests=len(prompts),
                              output_tokens=self.w.output_tokens)
        after = server_counters(servers)
        if r.get("completed") != len(prompts):
            raise RuntimeError(f"{label}: vLLM's client completed {r.get('completed')} of {len(prompts)} "
                               f"requests; see {self.logs}")
        ttfts = [t * 1e3 for t in r["ttfts"]]
        return {"requests": len(prompts), "ttft_p50_ms": round(r["median_ttft_ms"], 2),
                "ttft_p99_ms": round(r["p99_ttft_ms"], 2), "ttft_ms": [round(t, 2) for t in ttfts],
                "requests_per_s": round(r["request_throughput"], 3),
                "output_tokens_per_s": round(r["output_throughput"], 2),
                "input_tokens": r["total_input_tokens"],
                **{k: int(after[k] - before[k]) for k in COUNTERS}}

    def dataset(self, rows: list[dict[str, Any]], label: str) -> str:
        """A custom JSONL dataset for vLLM's client (its rows in order)."""
        self._n += 1
        path = os.path.join(self.data, f"{self._n:02d}-{label}.jsonl")
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return path

    def client(self) -> BenchServeClient:
        if self._client is None:
            self._client = BenchServeClient(os.path.join(self.logs, "client.log"))
        return self._client

    def warm_up(self, servers: list[VllmServer]) -> None:
        """Each server's one-off costs paid before a measurement: a server's first prefill of a shape
        builds oneDNN's kernels (an unrelated prompt of the measured length, then again with another
        suffix: a hit's shape); then every store has landed."""
        for srv in servers:
            u = self.fresh(1, self.w.prefix_tokens)[0]
            for q in self.fresh(2, self.w.suffix_tokens):
                srv.complete(u + q, max_tokens=self.w.output_tokens)
        wait_stores(servers)

    def asked(self, prefixes: list[list[int]]) -> list[list[int]]:
        """Each prefix with a new question (suffix) after it."""
        return [p + q for p, q in zip(prefixes, self.fresh(len(prefixes), self.w.suffix_tokens))]

    # --------------------------------------------------------------- arms --
    def no_reuse(self, shmkv: bool) -> dict[str, Any]:
        with self.one_server("no_reuse", shmkv) as s:
            return self.measure([s], s.url, self.fresh(self.w.prefixes, self.w.prefix_tokens + self.w.suffix_tokens),
                                f"no_reuse-{_v(shmkv)}")

    def in_cache(self, shmkv: bool) -> dict[str, Any]:
        w = self.w
        prefixes = self.fresh(w.in_cache_prefixes, w.prefix_tokens)
        with self.one_server("in_cache", shmkv) as s:
            self.warm([s], self.asked(prefixes))
            asks = [p + q for p in prefixes for q in self.fresh(w.repeats, w.suffix_tokens)]
            return self.measure([s], s.url, asks, f"in_cache-{_v(shmkv)}")

    def evicted(self, shmkv: bool) -> dict[str, Any]:
        w = self.w
        prefixes = self.fresh(w.prefixes, w.prefix_tokens)
        with self.one_server("evicted", shmkv) as s:
            self.warm([s], self.asked(prefixes))
            self.warm([s], self.fresh(w.vllm_cache_prompts + 1, w.prefix_tokens + w.suffix_tokens))  # evicts
            return self.measure([s], s.url, self.asked(prefixes), f"evicted-{_v(shmkv)}")

    def restart(self, shmkv: bool) -> dict[str, Any]:
        w = self.w
        prefixes = self.fresh(w.prefixes, w.prefix_tokens)
        kept = self._kept.pop(shmkv, None)  # --small: the first server is the one-server arms' one
        cache = (self.segment_name("one-server") if kept else self.segment("restart")) if shmkv else None
        with kept or self.server(f"restart-first-{_v(shmkv)}", cache) as first:
            self.warm([first], self.asked(prefixes))
        if kept is None:
            with self.server(f"restart-second-{_v(shmkv)}", cache) as s:
                return self.measure([s], s.url, self.asked(prefixes), f"restart-{_v(shmkv)}")
        # --small: the fresh server is the first of the variant's round-robin pair, started now with its
        # partner on the same segment; the round-robin arm serves fresh prompts on both (its counters: differences)
        labels = self._pair_labels(f"round_robin-{_v(shmkv)}")
        pair = self.servers(labels, [cache, cache], self._one_segment_capacity() if shmkv else None)
        self._started.update(zip(labels, pair))
        return self.measure([pair[0]], pair[0].url, self.asked(prefixes), f"restart-{_v(shmkv)}")

    @staticmethod
    def _pair_labels(label: str) -> list[str]:
        return [f"{label}-{i}" for i in range(2)]

    def _pair(self, label: str, caches: list[str | None], capacity: str | None, passes: int) -> dict[str, Any]:
        """Two servers behind the round-robin proxy; each system prompt asked
        `passes` times in a row with new questions (an odd number of system
        prompts: the next prefix starts on the other server)."""
        w = self.w
        systems = self.fresh(w.system_prompts, w.prefix_tokens)
        labels = self._pair_labels(label)
        if all(lb in self._started for lb in labels):  # --small: restart's servers; vLLM's cache as a fresh one's
            _as_fresh([self._started[lb] for lb in labels], label)
        servers = self.servers(labels, caches, capacity)
        proxy = RoundRobinProxy([s.url for s in servers])
        try:
            if label.startswith("budget"):
                # every prefix once (each on one server), then measured: on the other server, then back
                self.warm(servers, self.asked(systems), first=1)
                asks = [p for _ in range(passes) for p in self.asked(systems)]
            else:
                asks = [p + q for p in systems for q in self.fresh(passes, w.suffix_tokens)]
            out = self.measure(servers, proxy.url, asks, label)
            out["per_server_requests"] = list(proxy.sent)
            return out
        finally:
            proxy.close()
            keep = self._keep_for.pop(label, None)
            for i, s in enumerate(servers):
                if keep is not None:  # --small: the next arm's pair (keep_for_budget)
                    self._started[f"{keep}-{i}"] = s
                else:
                    s.close()

    def round_robin(self, shmkv: bool) -> dict[str, Any]:
        started = self._pair_labels(f"round_robin-{_v(shmkv)}")[0] in self._started  # --small: on restart's segment
        cache = (self.segment_name("one-server") if started else self.segment("round_robin")) if shmkv else None
        return self._pair(f"round_robin-{_v(shmkv)}", [cache, cache], None, passes=3)

    def budget(self, shared: bool) -> dict[str, Any]:
        budget = self.budget_bytes()
        if shared:
            reused = all(lb in self._started for lb in self._pair_labels("budget-shared"))
            # --small: the round-robin pair on its one segment of this size (keep_for_budget)
            cache = self.segment_name("one-server") if reused else self.segment("budget-shared")
            return self._pair("budget-shared", [cache, cache], f"{budget}", passes=2)
        return self._pair("budget-split", [self.segment("budget-split-0"), self.segment("budget-split-1")],
                          f"{budget // 2}", passes=2)

    def keep_for_budget(self) -> None:
        """--small: the budget arm's shared half runs on the round-robin arm's shmkv pair (two servers on one
        segment, made of the budget's size: _one_segment_capacity) instead of two more server starts; the
        split half starts its two servers as always. The budget never binds at --small's size (the working
        set is a few MiB): what its check compares is one segment seen by both servers against one each."""
        self._keep_for["round_robin-shmkv"] = "budget-shared"

    def budget_bytes(self) -> int:
        """The host-memory budget of the budget arm: the system prompts' KV
        and a half again (one segment holds them all; half of it does not)."""
        s = self.spec
        per_token = 2 * s.num_hidden_layers * s.num_key_value_heads * (s.hidden_size // s.num_attention_heads) * 2
        kv = self.w.system_prompts * (self.w.prefix_tokens + self.w.suffix_tokens) * per_token
        return max(64 << 20, int(kv * 1.5) + (16 << 20))

    def drop_segments(self) -> None:
        """After each arm: a default segment is a quarter of /dev/shm, reserved in the background."""

        for name in self.segments:
            drop_cache(name)
        self.segments = []

    def cleanup(self) -> None:
        if self._client is not None:
            self._client.close()
        for srv in [*self._started.values(), *self._kept.values()]:
            srv.close()
        self.segments += self._started_segments
        self.drop_segments()
        shutil.rmtree(self.data, ignore_errors=True)


def _v(shmkv: bool) -> str:
    return "shmkv" if shmkv else "vllm"


def server_counters(servers: list[VllmServer]) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for s in servers:
        totals = s.totals(list(COUNTERS.values()))
        for k, name in COUNTERS.items():
            out[k] += totals[name]
    return out


def _as_fresh(servers: list[VllmServer], arm: str) -> None:
    """Servers kept from an earlier arm, as a fresh server holds the arm's
    prompts in vLLM's own cache (nothing): their stores landed, then vLLM's
    prefix cache reset."""
    wait_stores(servers)
    for s in servers:
        if not s.post("/reset_prefix_cache").get("success", True):
            raise RuntimeError(f"{arm}: vLLM's prefix cache of a kept server would not reset; see {s.log_path}")


def wait_stores(servers: list[VllmServer], timeout_s: float = 60.0) -> None:
    """Until the servers' stored-token counters stop moving (their stores are
    asynchronous): a warm-up's chunks are in the cache before what follows."""
    last, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = server_counters(servers)["shmkv_stored_tokens"]
        if now == last:
            return
        last = now
        time.sleep(0.5)


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true",
                    help="tiny model and workload, both variants' servers of an arm started together (CI's check)")
    ap.add_argument("--no-fork", dest="fork", action="store_false",
                    help=NO_FORK_HELP)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which arms, comma-separated (of {','.join(ARMS)})")
    ap.add_argument("--capacity", help="shmkv's segment capacity (default: shmkv's own default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", help="write a PNG of TTFT per arm here (needs matplotlib)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shmkv-bench-serve"))
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}: choose from {', '.join(ARMS)}")
    w = SMALL if a.small else Workload()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: servers and segments still cleaned up
    r = Run(a, w)
    if a.small and all(x in arms for x in ("restart", "round_robin", "budget")) \
            and arms.index("restart") < arms.index("round_robin") < arms.index("budget"):
        r.keep_for_budget()
    result: dict[str, Any] = {"model": "small" if a.small else "timing", "workload": asdict(w),
                              "vllm_kv_blocks": r.kv_blocks, "arms": {}}
    t0 = time.monotonic()
    try:
        for i, arm in enumerate(arms):
            fn = getattr(r, arm)
            order = (False, True) if i % 2 == 0 else (True, False)  # the order rotated between arms
            if arm == "budget":
                names = {True: "shared", False: "split"}
                result["budget_bytes"] = r.budget_bytes()
            else:
                names = {False: "vllm", True: "shmkv"}
            out = {}
            if a.small:
                r.prestart(arm)
            for flag in order:
                sys.stderr.write(f"shmkv bench serve: {arm} / {names[flag]} ...\n")
                out[names[flag]] = fn(flag)
                r.drop_segments()
            result["arms"][arm] = {k: out[k] for k in sorted(out)}
    finally:
        r.cleanup()
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["server_starts"] = len(r.starts)
    result["server_start_seconds_p50"] = round(sorted(r.starts)[len(r.starts) // 2], 1) if r.starts else None
    result.update(_verdicts(result["arms"], w))
    import importlib.util

    result["lmcache"] = ("installed, but its arms are not run by this benchmark yet"
                         if importlib.util.find_spec("lmcache") else "not installed: its arms were not run")
    if a.plot:
        result["plot"] = _plot(result["arms"], a.plot)
    return result


def _verdicts(arms: dict[str, dict[str, Any]], w: Workload) -> dict[str, Any]:
    """Ratios, goals and the controls (which fail the run on counters)."""
    ratios, goals, controls, failed = {}, {}, {}, []
    for arm, v in arms.items():
        if "vllm" in v and "shmkv" in v and v["vllm"]["ttft_p50_ms"]:
            ratios[arm] = round(v["shmkv"]["ttft_p50_ms"] / v["vllm"]["ttft_p50_ms"], 3)
        if arm in GOALS and arm in ratios:
            goals[arm] = {"ratio": ratios[arm], "goal": GOALS[arm], "met": ratios[arm] <= GOALS[arm]}
    if "budget" in arms:
        b = arms["budget"]
        ratios["budget_split_over_shared"] = round(b["split"]["ttft_p50_ms"] / b["shared"]["ttft_p50_ms"], 3)
    if "no_reuse" in arms:
        s = arms["no_reuse"]["shmkv"]
        ok = s["shmkv_loaded_tokens"] == 0 and s["connector_tokens"] == 0
        controls["no_reuse"] = {"ok": ok, "shmkv_loaded_tokens": s["shmkv_loaded_tokens"],
                                "connector_tokens": s["connector_tokens"]}
    if "in_cache" in arms:
        s = arms["in_cache"]["shmkv"]
        reuse = s["requests"] * (w.prefix_tokens // VLLM_BLOCK) * VLLM_BLOCK  # every prefix's whole blocks
        ok = s["shmkv_loaded_tokens"] == 0 and s["connector_tokens"] == 0 and s["vllm_cache_tokens"] >= reuse
        controls["in_cache"] = {"ok": ok, "shmkv_loaded_tokens": s["shmkv_loaded_tokens"],
                                "connector_tokens": s["connector_tokens"], "vllm_cache_tokens": s["vllm_cache_tokens"],
                                "vllm_cache_tokens_expected_at_least": reuse}
    for arm in ("no_reuse", "in_cache"):
        if arm in ratios:
            controls[arm]["time_ratio"] = ratios[arm]
            controls[arm]["time_within_5_percent"] = abs(ratios[arm] - 1) <= CONTROL_TOLERANCE
        if arm in controls and not controls[arm]["ok"]:
            failed.append(f"control {arm}: {controls[arm]}")
    out: dict[str, Any] = {"ratios": ratios, "goals": goals, "controls": controls}
    if failed:
        out["failed"] = "; ".join(failed)
    return out


def _plot(arms: dict[str, dict[str, Any]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, p50, p99, colors = [], [], [], []
    palette = {"vllm": "#8c8c8c", "shmkv": "#1f77b4", "shared": "#1f77b4", "split": "#ff7f0e"}
    for arm, v in arms.items():
        for name, m in v.items():
            labels.append(f"{arm}\n{name}")
            p50.append(m["ttft_p50_ms"])
            p99.append(m["ttft_p99_ms"])
            colors.append(palette.get(name, "#2ca02c"))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    xs = range(len(labels))
    ax.bar(xs, p50, color=colors, label="p50")
    ax.scatter(xs, p99, color="black", marker="_", s=200, label="p99")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("shmkv bench serve: vllm bench serve against vllm serve (vLLM alone vs shmkv)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(f"serve ({r['model']} model): prefixes of {w['prefix_tokens']} tokens + {w['suffix_tokens']}, "
          f"{w['output_tokens']} output tokens; vLLM's KV cache {r['vllm_kv_blocks']} blocks; "
          f"{r['server_starts']} server starts, {r['seconds']} s")
    print(f"  {'arm':12s} {'variant':8s} {'reqs':>4s} {'p50 ms':>9s} {'p99 ms':>9s} {'req/s':>7s} "
          f"{'vLLM cache':>10s} {'shmkv':>7s}")
    for arm, v in r["arms"].items():
        for name, m in v.items():
            print(f"  {arm:12s} {name:8s} {m['requests']:4d} {m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:9.1f} "
                  f"{m['requests_per_s']:7.2f} {m['vllm_cache_tokens']:10d} {m['shmkv_loaded_tokens']:7d}")
    print("  ratios (shmkv / vLLM alone, p50): " + ", ".join(f"{k} {v}" for k, v in r["ratios"].items()))
    for arm, g in r["goals"].items():
        print(f"  goal {arm}: {g['ratio']} <= {g['goal']}: {'met' if g['met'] else 'NOT met'}")
    for arm, c in r["controls"].items():
        print(f"  control {arm}: {'ok' if c['ok'] else 'FAILED'} {c}")
    if r.get("plot"):
        print(f"  plot: {r['plot']}")
    if r.get("failed"):
        print(f"  FAILED: {r['failed']}")
