"""`shmkv bench NAME --help` prints that benchmark's own options under its
own name (and runs nothing), for every benchmark; without a name the
dispatcher lists them all, one line each; `shmkv --help` and `python -m
shmkv --help` list every subcommand and every benchmark."""

from __future__ import annotations

import contextlib
import io

import pytest

from shmkv.bench.__main__ import BENCHES, main


def help_text(entry, argv: list[str]) -> str:
    """What `entry(argv)` prints for --help (argparse exits 0 after it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        entry(argv)
    assert e.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_each_benchmark_answers_help_with_its_own_options(name):
    text = help_text(main, [name, "--help"])
    assert text.startswith(f"usage: shmkv bench {name}"), text[:200]


def test_without_a_name_the_benchmarks_are_listed():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    assert all(name in out.getvalue() for name in BENCHES)


def test_the_shmkv_command_lists_every_subcommand_and_benchmark():
    import subprocess
    import sys

    from shmkv.cli import SUBCOMMANDS

    for argv in (["shmkv", "--help"], [sys.executable, "-m", "shmkv", "--help"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(any(line.split()[:1] == [sub] for line in lines) for sub in SUBCOMMANDS), r.stdout
        assert all(any(line.split()[:2] == ["bench", name] for line in lines) for name in BENCHES), r.stdout


@pytest.mark.parametrize("sub", ["daemon", "stats", "ctl", "check"])
def test_each_subcommand_shows_its_options_under_its_own_name(sub):
    from shmkv.cli import main as shmkv_main

    text = help_text(shmkv_main, [sub, "--help"])
    assert text.startswith(f"usage: shmkv {sub}"), text[:200]


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_each_benchmark_says_what_it_measures_under_its_usage(name):
    text = help_text(main, [name, "--help"])
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 2 and not paragraphs[1].startswith(("options:", "positional arguments:")), text[:400]


@pytest.mark.parametrize("sub", ["daemon", "stats", "ctl", "check"])
def test_a_subcommands_help_speaks_to_its_user(sub):
    """Its own command line in its examples, no `python -m` module path and no maintainers' notes."""
    from shmkv.cli import main as shmkv_main

    text = help_text(shmkv_main, [sub, "--help"])
    assert "python -m" not in text and "Invariant" not in text and "shmkv.controller" not in text, text[:1200]
