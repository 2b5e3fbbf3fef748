"""`shmkv`: one command for the operator tools.

    shmkv daemon [...]     the maintainer and controller (python -m shmkv.daemon)
    shmkv stats [...]      what the cache is doing (python -m shmkv.stats)
    shmkv ctl METHOD PATH  one request to the daemon's controller, with its token
    shmkv check [...]      the host's checks before serving (python -m shmkv.check)
    shmkv bench NAME [...] benchmarks (python -m shmkv.bench)

Each subcommand takes the same options as its `python -m` module, which keeps
working; `shmkv SUBCOMMAND --help` lists them.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "daemon": ("shmkv.services.daemon", "the cache's maintainer and controller API"),
    "stats": ("shmkv.services.stats", "what the cache is doing, read from the segment"),
    "ctl": ("shmkv.services.controller_client", "one request to the daemon's controller API (sends its token)"),
    "check": ("shmkv.check", "what an operator runs on a host before serving: settings and checks"),
    "bench": ("shmkv.bench.__main__", "benchmarks (`shmkv bench --help` lists them)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:8s} {help_}" for name, (_mod, help_) in SUBCOMMANDS.items()]
        out = "usage: shmkv {" + ",".join(SUBCOMMANDS) + "} [options]\n\n" + "\n".join(lines) + "\n"
        if argv and argv[0] not in ("-h", "--help"):
            sys.stderr.write(f"shmkv: unknown subcommand {argv[0]!r}\n" + out)
            return 2
        sys.stdout.write(out)
        return 0 if argv else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
