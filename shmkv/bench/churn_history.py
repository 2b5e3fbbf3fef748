"""`bench churn`'s history, read after a run: the smallest failing history
(ddmin), which changes the cache served again after (recovered_changes),
the PNG timeline and the per-kind table."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def ddmin(items: list[Any], fails: Callable[[list[Any]], bool], budget: int = 64) -> list[Any]:
    """Delta debugging (Zeller): the shortest list found, by removing ever smaller runs of `items`, for
    which fails() still holds (it holds for `items`); at most `budget` calls of fails()."""
    n, calls = 2, 0
    while len(items) >= 2 and calls < budget:
        size = -(-len(items) // n)
        for start in range(0, len(items), size):
            if calls >= budget:
                break
            rest = items[:start] + items[start + size:]
            calls += 1
            if fails(rest):
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    if len(items) == 1 and calls < budget and fails([]):
        return []
    return items


def recovered_changes(history: list[dict[str, Any]]) -> dict[int, bool]:
    """Per change (by id): whether a request between it and the next change hit (the cache served again)."""
    out: dict[int, bool] = {}
    current: dict[str, Any] | None = None
    for e in history:
        if e["type"] == "change":
            current = e
            out[id(e)] = False
        elif e["type"] == "request" and current is not None and e.get("hit"):
            out[id(current)] = True
    return out


def history_failed(history: list[dict[str, Any]]) -> bool:
    return any(r.get("verdict") in ("WRONG", "hang", "error") for r in history)


def plot_history(history: list[dict[str, Any]], path: str) -> str:
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
    colors = dict(zip(kinds, plt.cm.tab20.colors))  # every kind its own colour (up to 20)
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
    print(f"chunks evicted before reaching disk: {r['evicted_unspilled']} ({r['lost_with_disk_room']} while the "
          f"disk tier had room); spill errors {r['spill_errors']}")
    for note in r["notes"]:
        print(f"note: {note}")
    if r["never_recovered"]:
        print(f"no hit before the next change after any change of: {', '.join(r['never_recovered'])}")
    print(f"{'after':18s} {'changes':>7s} {'recovered':>9s} {'requests':>8s} {'hits':>5s} {'hit rate':>8s} "
          f"{'wrong':>5s} {'tie':>4s} {'hang':>4s} {'error':>5s} {'unchecked':>9s} {'lost':>5s} "
          f"{'lost, disk full':>15s}")
    for k, v in r["per_kind"].items():
        rate = "-" if v["hit_rate_after"] is None else f"{v['hit_rate_after']:.0%}"
        print(f"{k:18s} {v['changes']:7d} {v['recovered']:9d} {v['requests_after']:8d} {v['hits_after']:5d} "
              f"{rate:>8s} {v['WRONG']:5d} {v['tie']:4d} {v['hang']:4d} {v['error']:5d} {v['unchecked']:9d} "
              f"{v['lost']:5d} "
              f"{v['lost_disk_full']:15d}")
    if r.get("minimal"):
        m = r["minimal"]
        print(f"smallest history found that answers wrong: {m['events']} events of {m['of']} ({m['replays']} "
              f"replays): {m['replay']}")
    if r.get("failed"):
        print(f"FAILED: {r['failed']}", file=sys.stderr)
