"""The suite's schedule (tests/support/schedule.py, LONGEST_FIRST): every file it
names exists (a renamed file would silently run last again), and the
ordering puts those files first, in the list's order, keeping every other
item in its collected order."""

from __future__ import annotations

import os
from types import SimpleNamespace

from helpers import REPO
from schedule import LONGEST_FIRST, longest_first


def test_every_file_named_exists():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [p for p in LONGEST_FIRST if not os.path.isfile(os.path.join(REPO, p))]
    assert missing == []


def test_the_longest_files_go_first_and_the_rest_keep_their_order():
    item = lambda nodeid: SimpleNamespace(nodeid=nodeid)  # noqa: E731
    items = [item("tests/a.py::t1"), item(f"{LONGEST_FIRST[1]}::x"), item("tests/b.py::t2"),
             item(f"{LONGEST_FIRST[0]}::y[v2]"), item("tests/a.py::t3"), item(f"{LONGEST_FIRST[0]}::y[v1]")]
    longest_first(items)
    assert [i.nodeid for i in items] == [f"{LONGEST_FIRST[0]}::y[v2]", f"{LONGEST_FIRST[0]}::y[v1]",
                                         f"{LONGEST_FIRST[1]}::x", "tests/a.py::t1", "tests/b.py::t2", "tests/a.py::t3"]
