"""`shmkv` (or `python -m shmkv`): one command for the operator tools.

    shmkv daemon [...]     the maintainer and controller
    shmkv stats [...]      what the cache is doing
    shmkv ctl METHOD PATH  one request to the daemon's controller, with its token
    shmkv config [...]     the settings in force, and where each came from
    shmkv check [...]      the host's checks before serving
    shmkv bench NAME [...] benchmarks

`shmkv SUBCOMMAND --help` lists a subcommand's options under its own name;
the older module entry points (`python -m shmkv.stats`, ...) keep working.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "daemon": ("shmkv.services.daemon", "the cache's maintainer and controller API"),
    "stats": ("shmkv.services.stats", "what the cache is doing, read from the segment"),
    "ctl": ("shmkv.services.controller_client", "one request to the daemon's controller API (sends its token)"),
    "config": ("shmkv.config", "the settings in force and where each came from (--json; --markdown: the table)"),
    "check": ("shmkv.check", "what an operator runs on a host before serving: settings and checks"),
    "bench": ("shmkv.bench.__main__", "benchmarks (below)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        from shmkv.bench.__main__ import BENCHES  # names and one line each: no benchmark is imported

        lines = [f"  {name:8s} {help_}" for name, (_mod, help_) in SUBCOMMANDS.items()]
        benches = [f"  bench {name:12s} {what}" for name, (_mod, what) in BENCHES.items()]
        out = ("usage: shmkv {" + ",".join(SUBCOMMANDS) + "} [options]\n\n" + "\n".join(lines) + "\n\nbenchmarks:\n"
               + "\n".join(benches) + "\n\n`shmkv SUBCOMMAND --help`, `shmkv bench NAME --help`: their options\n")
        if argv and argv[0] not in ("-h", "--help"):
            sys.stderr.write(f"shmkv: unknown subcommand {argv[0]!r}\n" + out)
            return 2
        sys.stdout.write(out)
        return 0 if argv else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
