"""`shmkv bench NAME [options]` (or `python -m shmkv.bench`): one benchmark, its figures printed or as JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys

BENCHES = {  # name: (module, what it measures, one line)
    "store": ("shmkv.bench.store_bench", "put/get GB/s of the shared segment against memcpy"),
    "kernels": ("shmkv.bench.kernels_bench", "paged-KV gather/scatter GB/s against memcpy (CPU; GPU if present)"),
    "ttft": ("shmkv.bench.ttft_bench", "time to first token with and without shmkv, separate vLLM engines"),
    "disk": ("shmkv.bench.disk_bench", "the disk tier's throughput and compression"),
    "remote": ("shmkv.bench.remote_bench", "the remote tier's throughput through Redis on loopback"),
    "soak": ("shmkv.bench.soak_bench", "chaos soak: concurrent put/get/pin/delete with processes killed"),
    "spill": ("shmkv.bench.spill_bench", "what RAM evicts reaches the disk, per writer pace"),
    "trace": ("shmkv.bench.trace_bench", "a production request trace replayed through vllm serve, beside LMCache"),
    "concurrency": ("shmkv.bench.concurrency_bench", "vLLM's random and prefix-repetition datasets at 1/4/16"),
    "controller": ("shmkv.bench.controller_bench", "the controller's latency under many clients (and attackers)"),
    "compress": ("shmkv.bench.compress_bench", "what POST /compress buys: chunks held per byte"),
    "lossy": ("shmkv.bench.lossy_bench", "what the lossy (fp8) form costs in output"),
    "segment": ("shmkv.bench.segment_bench", "segment creation: how soon it is usable"),
    "pages": ("shmkv.bench.pages_bench", "what huge pages change for a segment"),
    "hostpath": ("shmkv.bench.hostpath_bench", "host time of the transfer engine's per-step calls"),
    "gpu": ("shmkv.bench.gpu_bench", "the CUDA path through the connector's worker (skipped without a GPU)"),
    "native-tier": ("shmkv.bench.native_tier", "vLLM's native offloading with shmkv as its shared tier"),
    "fleet": ("shmkv.bench.fleet_bench", "N engines on one host behind a router, with and without shmkv"),
    "serve": ("shmkv.bench.serve_bench", "shmkv measured the way vLLM users measure: vllm serve + its client"),
    "churn": ("shmkv.bench.churn_bench", "engines sharing a cache through restarts, kills and weight changes: "
              "every answer checked"),
    "weights-digest": ("shmkv.bench.digest_bench", "what the weights' identity costs at engine start (GB/s, 8B, 70B)"),
}


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # NOTE: no -h of its own once a benchmark is named: `bench trace --help` is the trace benchmark's help
    listing = "\n".join(f"  {name:12s} {what}" for name, (_mod, what) in BENCHES.items())
    p = argparse.ArgumentParser(prog="shmkv bench", description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"benchmarks:\n{listing}\n\n`shmkv bench NAME --help`: that benchmark's options")
    p.add_argument("name", nargs="?", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = p.parse_known_args(argv)
    if args.name is None:
        p.print_help()
        return 0 if any(a in ("-h", "--help") for a in rest) else 2
    mod = importlib.import_module(BENCHES[args.name][0])
    # a SIGTERM (`timeout`, a CI job's end) unwinds as an interrupt does: the benchmark's own
    # clean-up (its engines, servers, segments) runs before the process ends
    signal.signal(signal.SIGTERM, _terminated)
    result = mod.run(rest)
    if "skipped" in result:  # e.g. `bench gpu` without a GPU: one line, and success
        print(json.dumps(result) if args.json else f"shmkv bench {args.name}: skipped: {result['skipped']}")
        return 0
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        mod.report(result)
    if result.get("failed"):  # a benchmark's own checks (bench serve's controls) failed
        print(f"shmkv bench {args.name}: FAILED: {result['failed']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
