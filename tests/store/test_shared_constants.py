"""Constants shared by C++ and Python have one source, the C++ core: result
codes (cpp/status.h -> _C.Status, each error code with its exception class),
statistics (cpp/counters.h -> _C.COUNTERS: what stats() returns, what the
tiers may bump, what Prometheus shows with which help text), entry flags; and
the checked-in type stub shmkv/_C.pyi is what pybind11-stubgen makes of the
built module."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import REPO

from shmkv import _C, Store
from shmkv.errors import BY_STATUS, ShmkvError, error_for
from shmkv.services.stats import render_prometheus, snapshot
from shmkv.store import PutResult, Status


@pytest.fixture
def store(cache_name):
    with Store.create(cache_name, 8 << 20, populate=False) as s:
        yield s


def test_every_error_code_has_its_exception_and_put_results_are_the_cores_codes():
    assert {Status(c).name for c in _C.ERROR_CODES} <= set(BY_STATUS)
    for code in _C.ERROR_CODES:
        e = error_for(Status(code).name, "m")
        assert isinstance(e, ShmkvError) and type(e) is not ShmkvError, Status(code).name
    assert {r.name: r.value for r in PutResult} == {r.name: int(_C.Status.__members__[r.name]) for r in PutResult}


def test_the_counter_list_is_exactly_what_stats_returns(store):
    names = [c[0] for c in _C.COUNTERS]
    assert len(names) == len(set(names)), "each statistic is listed once"
    assert set(store.stats()) == set(names)
    assert {c[2] for c in _C.COUNTERS} == {"counter", "gauge", "info"}
    assert {c[3] for c in _C.COUNTERS} == {"shm", "disk", "remote"}


def test_only_the_tiers_counters_can_be_bumped(store):
    for name, _help, _kind, tier, bumpable, _family in _C.COUNTERS:
        if bumpable:
            before = store.stats()[name]
            store.bump(name, 3)
            assert store.stats()[name] == before + 3, name
            assert tier in ("disk", "remote") or name == "hit_tokens", "the Python side counts only these"
        else:
            with pytest.raises(ValueError):
                store.bump(name)


def test_prometheus_has_one_family_per_quantity_with_the_tier_as_label(store):
    text = render_prometheus(snapshot(store))
    for name, help_text, kind, tier, _, family in _C.COUNTERS:
        sample = f"shmkv_{family}_total" if kind == "counter" else f"shmkv_{family}"
        if kind == "info":
            assert f"# HELP shmkv_{name}" not in text
            continue
        assert f"# HELP {sample} {_C.METRIC_FAMILIES.get(family, help_text)}\n" in text
        assert text.count(f"# HELP {sample} ") == 1, "one family, however many tiers"
        assert f'{sample}{{cache="{store.name}",tier="{tier}"}}' in text
    for tier in ("shm", "disk", "remote"):
        assert f'shmkv_hits_total{{cache="{store.name}",tier="{tier}"}}' in text


@pytest.mark.skipif(importlib.util.find_spec("pybind11_stubgen") is None,
                    reason="pybind11-stubgen is not installed (scripts/setup.sh installs it)")
def test_the_checked_in_stub_is_the_built_modules(tmp_path):
    subprocess.run([sys.executable, "-m", "pybind11_stubgen", "shmkv._C", "-o", str(tmp_path)], check=True,
                   capture_output=True, cwd=REPO)
    with open(tmp_path / "shmkv" / "_C.pyi") as f:
        built = f.read()
    with open(os.path.join(REPO, "shmkv", "_C.pyi")) as f:
        checked_in = f.read()
    assert built == checked_in, "shmkv/_C.pyi is out of date: run scripts/gen_stubs.sh"
