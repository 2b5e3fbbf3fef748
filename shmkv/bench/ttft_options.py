"""The options every TTFT benchmark takes (`bench ttft`, `compress`,
`lossy`, `fleet`), and the model they ask for."""

from __future__ import annotations

import argparse
import os
import tempfile

from shmkv.engines.models import TEST_MODEL, TIMING_MODEL, TinyLlama, write_llama


def ttft_args(prog: str, workdir: str, description: str | None = None) -> argparse.ArgumentParser:
    """The options every TTFT benchmark takes (prompts, their length, --small, --workdir)."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="distinct prompts per figure")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--small", action="store_true", help="tiny model (quick check)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), workdir))
    return ap


def bench_model(a: argparse.Namespace) -> tuple[TinyLlama, str]:
    """(spec, checkpoint directory) of the model a TTFT benchmark's options ask for."""
    spec = TEST_MODEL if a.small else TIMING_MODEL
    return spec, write_llama(os.path.join(a.workdir, "model-small" if a.small else "model"), spec)

