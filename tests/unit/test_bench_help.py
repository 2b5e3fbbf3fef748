"""`python -m shmkv.bench NAME --help` prints that benchmark's own options
(and runs nothing), for every benchmark; without a name the dispatcher lists
them all."""

from __future__ import annotations

import contextlib
import io

import pytest

from shmkv.bench.__main__ import BENCHES, main


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_each_benchmark_answers_help_with_its_own_options(name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert out.getvalue().startswith(f"usage: python -m shmkv.bench {name}"), out.getvalue()[:200]


def test_without_a_name_the_benchmarks_are_listed():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    assert all(name in out.getvalue() for name in BENCHES)
