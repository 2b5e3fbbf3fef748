"""What shmkv does to a fleet: N engines on one host behind a router, a seeded
stream of multi-turn conversations that share system prompts.

Three ways, same workload:
  prefix     vLLM's own prefix cache alone (no connector)
  shmkv      the prefix cache and shmkv's shared tier (with a disk tier)
  restart    the shmkv engines restarted on an empty segment: hits come from
             the disk tier only

and two routers for each of the first two: round-robin (each request to the
next engine) and prefix-aware (a conversation sticks to one engine, as
KV-cache-aware routers send it). Every request is timed to its first token
(max_tokens=1; the answers of earlier turns are seeded tokens, so every way
sees the same prompts). Per way and router: TTFT p50/p99 (ms), prefill tokens
avoided (vLLM's num_cached_tokens: its own hits plus shmkv's), hit rate,
prompt tokens per second; and shmkv's p50 TTFT over prefix-alone's per
router. `--plot PATH` draws the TTFT distributions side by side (needs
matplotlib). A progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.ttft_options import bench_model
from shmkv.engines.engine import EngineProcess, EngineSpec

ROUTERS = ("round-robin", "prefix-aware")


def workload(a: argparse.Namespace) -> list[list[tuple[int, list[int]]]]:
    """Rounds of (conversation, prompt): round t holds every conversation's turn t, in a seeded order."""
    rng = random.Random(a.seed)
    tok = lambda n: [rng.randrange(3, 4000) for _ in range(n)]  # noqa: E731
    systems = [tok(a.system_tokens) for _ in range(a.system_prompts)]
    history = [list(systems[c % a.system_prompts]) for c in range(a.conversations)]
    rounds = []
    for _ in range(a.turns):
        turn = []
        for c in range(a.conversations):
            history[c] += tok(a.user_tokens)
            turn.append((c, list(history[c])))
            history[c] += tok(a.answer_tokens)  # the answer, as the next turn sends it back
        rng.shuffle(turn)  # conversations' turns arrive in no fixed order
        rounds.append(turn)
    return rounds


def start(specs: list[EngineSpec], logs: str, label: str, fork: bool = False) -> list[EngineProcess]:
    """The engines, started together (`fork`: in_process ones forked from one Python that imported vLLM
    once, engine_forks)."""
    launch = None
    if fork:
        from shmkv.engines.forks import fork_engine

        launch = fork_engine
    with ThreadPoolExecutor(len(specs)) as ex:
        futures = [ex.submit(EngineProcess, spec, os.path.join(logs, f"{label}-{i}.log"), launch=launch)
                   for i, spec in enumerate(specs)]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(futures):  # one failed to start: those that did are closed, none left running
        for e in started:
            e.close()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


def serve(engines: list[EngineProcess], rounds: list, router: str, progress: Any) -> dict[str, Any]:
    """Send every round (its requests at once, each to its engine's queue); per-request figures."""
    n = len(engines)
    out: list[tuple[float, int, int]] = []  # (ttft s, prompt tokens, cached tokens)
    rr = 0
    t0 = time.perf_counter()
    for turn in rounds:
        queues: list[list[list[int]]] = [[] for _ in engines]
        for conv, prompt in turn:
            target = conv % n if router == "prefix-aware" else rr % n
            rr += 1
            queues[target].append(prompt)

        def run(i: int, queue: list[list[int]]) -> list[tuple[float, int, int]]:
            got = []
            for p in queue:
                r = engines[i].ttft(p)
                got.append((r["wall_s"], len(p), r["num_cached_tokens"][0]))
                progress()
            return got

        with ThreadPoolExecutor(n) as ex:
            for got in ex.map(run, range(n), queues):
                out.extend(got)
    wall = time.perf_counter() - t0
    ttft = sorted(x[0] for x in out)
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    prompt_tokens = sum(x[1] for x in out)
    return {"requests": len(out), "ttft_p50_ms": round(pick(0.5) * 1e3, 1), "ttft_p99_ms": round(pick(0.99) * 1e3, 1),
            "prefill_tokens_avoided": sum(x[2] for x in out), "prompt_tokens": prompt_tokens,
            "hit_rate": round(sum(1 for x in out if x[2]) / len(out), 3),
            "prompt_tokens_per_s": round(prompt_tokens / wall, 1), "ttft_ms": [round(x * 1e3, 1) for x in ttft]}


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny model (quick check)")
    ap.add_argument("--in-process", action="store_true",
                    help="each engine's EngineCore in its own process (faster starts, for quick checks; the "
                         "default is vLLM's own process split, as served)")
    ap.add_argument("--no-fork", dest="fork", action="store_false",
                    help="with --in-process, each engine a new Python (default: forked from one Python that "
                         "imported vLLM once)")
    ap.add_argument("--capacity", help="shmkv's segment capacity (default: shmkv's own default)")
    ap.add_argument("--plot", help="write a PNG of the TTFT distributions here (needs matplotlib)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shmkv-bench-fleet"))
    a = ap.parse_args(argv)
    _spec, model = bench_model(a)
    rounds = workload(a)
    total = sum(len(t) for t in rounds) * (2 * len(ROUTERS) + 1)
    done = [0]

    def progress() -> None:
        done[0] += 1
        bar = "#" * (30 * done[0] // total)
        sys.stderr.write(f"\rshmkv bench fleet [{bar:<30}] {done[0]}/{total}")
        sys.stderr.flush()

    logs = os.path.join(a.workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    cache = f"shmkv-bench-fleet-{os.getpid()}"
    disk = os.path.join(a.workdir, f"disk-{os.getpid()}")
    shmkv_cfg = {"cache_name": cache, "disk_dir": disk, **({"capacity": a.capacity} if a.capacity else {})}
    env = {"SHMKV_CACHE_NAME": cache}
    result: dict[str, Any] = {"engines": a.engines, "conversations": a.conversations, "turns": a.turns,
                              "system_prompts": a.system_prompts, "model": "small" if a.small else "timing"}
    ways: dict[str, dict[str, Any]] = {}
    try:
        for way, cfg in (("prefix", None), ("shmkv", shmkv_cfg)):
            engines = start([EngineSpec(model, shmkv=cfg, prefix_caching=True, env=env if cfg else {},
                                        in_process=a.in_process) for _ in range(a.engines)], logs, way,
                            fork=a.in_process and a.fork)
            try:
                for router in ROUTERS:
                    for e in engines:
                        e.reset_prefix_cache(connector=cfg is not None)
                    ways[f"{way}/{router}"] = serve(engines, rounds, router, progress)
                if cfg is not None:  # the workload once more, untimed, then all of it on disk before the restart
                    for e in engines:
                        e.reset_prefix_cache(connector=True)
                    serve(engines, rounds, "round-robin", lambda: None)
                    _spill_all(shmkv_cfg)
            finally:
                for e in engines:
                    e.close()
        Store.unlink(cache)  # the restart: an empty segment, the disk tier as it was
        engines = start([EngineSpec(model, shmkv=shmkv_cfg, prefix_caching=True, env=env, in_process=a.in_process)
                         for _ in range(a.engines)], logs, "restart", fork=a.in_process and a.fork)
        try:
            ways["restart/round-robin"] = serve(engines, rounds, "round-robin", progress)
        finally:
            for e in engines:
                e.close()
    finally:
        sys.stderr.write("\n")
        drop_cache(cache)
        shutil.rmtree(disk, ignore_errors=True)
    result["ways"] = ways
    p50 = {name: w["ttft_p50_ms"] for name, w in ways.items()}
    result["shmkv_p50_over_prefix_p50"] = {r: round(p50[f"shmkv/{r}"] / p50[f"prefix/{r}"], 3) for r in ROUTERS}
    if a.plot:
        result["plot"] = _plot(ways, a.plot)
    return result


def _spill_all(cfg: dict[str, Any]) -> None:
    """Every chunk of the segment written to the disk tier now (what POST /flush does)."""
    from shmkv.config import load_config
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers import open_tiers

    with Store.attach(cfg["cache_name"], populate=False, background_reserve=False) as store:
        chain = open_tiers(load_config(cfg, env={}), store)
        try:
            _spilled, left = Maintainer(chain).spill_all()
            if left:
                raise RuntimeError(f"{left} chunks could not be written to the disk tier")
        finally:
            chain.close()


def _plot(ways: dict[str, dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib"
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.boxplot([w["ttft_ms"] for w in ways.values()], labels=list(ways), showfliers=True)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("shmkv bench fleet: time to first token per request")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path)
    return path


def report(r: dict[str, Any]) -> None:
    print(f"fleet: {r['engines']} engines, {r['conversations']} conversations x {r['turns']} turns, "
          f"{r['system_prompts']} system prompts ({r['model']} model)")
    print(f"  {'way/router':24s} {'p50 ms':>8s} {'p99 ms':>8s} {'avoided':>9s} {'hit rate':>8s} {'tok/s':>9s}")
    for name, w in r["ways"].items():
        print(f"  {name:24s} {w['ttft_p50_ms']:8.1f} {w['ttft_p99_ms']:8.1f} {w['prefill_tokens_avoided']:9d} "
              f"{w['hit_rate']:8.3f} {w['prompt_tokens_per_s']:9.1f}")
    print("  shmkv p50 / prefix-alone p50: " + ", ".join(f"{k} {v}" for k, v in r["shmkv_p50_over_prefix_p50"].items()))
    if r.get("plot"):
        print(f"  plot: {r['plot']}")
