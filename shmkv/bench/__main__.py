"""Dispatch `python -m shmkv.bench NAME [options]`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

BENCHES = {
    "store": "shmkv.bench.store_bench",
    "kernels": "shmkv.bench.kernels_bench",
    "ttft": "shmkv.bench.ttft_bench",
    "disk": "shmkv.bench.disk_bench",
    "remote": "shmkv.bench.remote_bench",
    "soak": "shmkv.bench.soak_bench",
    "spill": "shmkv.bench.spill_bench",
    "trace": "shmkv.bench.trace_bench",
    "concurrency": "shmkv.bench.concurrency_bench",
    "controller": "shmkv.bench.controller_bench",
    "compress": "shmkv.bench.compress_bench",
    "lossy": "shmkv.bench.lossy_bench",
    "segment": "shmkv.bench.segment_bench",
    "pages": "shmkv.bench.pages_bench",
    "hostpath": "shmkv.bench.hostpath_bench",
    "gpu": "shmkv.bench.gpu_bench",
    "native-tier": "shmkv.bench.native_tier",
    "fleet": "shmkv.bench.fleet_bench",
    "serve": "shmkv.bench.serve_bench",
}


def main(argv: list[str] | None = None) -> int:
    # NOTE: no -h of its own once a benchmark is named: `bench trace --help` is the trace benchmark's help
    p = argparse.ArgumentParser(prog="python -m shmkv.bench", description=__doc__, add_help=False,
                                epilog="`python -m shmkv.bench NAME --help`: that benchmark's options")
    p.add_argument("name", nargs="?", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = p.parse_known_args(argv)
    if args.name is None:
        p.print_help()
        return 0 if any(a in ("-h", "--help") for a in rest) else 2
    mod = importlib.import_module(BENCHES[args.name])
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
