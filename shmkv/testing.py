"""Behaviour only the test suite switches on: faults the product cannot be
made to show on demand (a chunk another engine evicts between lookup and
load, a layer a load leaves unfilled, a worker that cannot serve while its
scheduler half can). Read here, and only here, from SHMKV_TEST_* environment
variables; never an operator setting, never in shmkv.yaml.

Each switch that is on says so in a WARNING that names its variable, once per
process that reads it, so a log of a run with one on cannot be mistaken for
a real fault.

    SHMKV_TEST_SKIP_LOAD_LAYERS=REGEX   loads leave the layers REGEX matches as they were
    SHMKV_TEST_EVICT_BEFORE_LOAD=1      a worker deletes each chunk it is about to load
    SHMKV_TEST_EVICT_BEFORE_LOAD=rank:N ... only the worker of TP rank N (its lease fails, the others' not)
    SHMKV_TEST_WORKER_OFF=REASON        every worker turns off with REASON (the scheduler half does not)
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from shmkv.errors import ConfigError

log = logging.getLogger("shmkv")

PREFIX = "SHMKV_TEST_"  # the test suite's variables: not settings (shmkv.config warns of none of them)
SKIP_LOAD_LAYERS = "SHMKV_TEST_SKIP_LOAD_LAYERS"
EVICT_BEFORE_LOAD = "SHMKV_TEST_EVICT_BEFORE_LOAD"
WORKER_OFF = "SHMKV_TEST_WORKER_OFF"
VARIABLES = (SKIP_LOAD_LAYERS, EVICT_BEFORE_LOAD, WORKER_OFF)


@dataclass(frozen=True)
class Switches:
    skip_load_layers: str = ""  # a regex over layer names; "": none
    evict_before_load: bool = False
    evict_rank: int | None = None  # evict_before_load on this TP rank only (None: every rank)
    worker_off: str = ""  # the reason; "": workers serve


_warned: set[str] = set()


def switches(environ: dict[str, str] | None = None) -> Switches:
    """The switches the environment turns on (a bad value raises ConfigError
    naming its variable); each one on is logged as a WARNING once."""
    env = os.environ if environ is None else environ
    skip = env.get(SKIP_LOAD_LAYERS, "")
    if skip:
        try:
            re.compile(skip)
        except re.error as e:
            raise ConfigError(f"{SKIP_LOAD_LAYERS}={skip!r}: not a regular expression ({e})") from None
    evict_raw = env.get(EVICT_BEFORE_LOAD, "").strip().lower()
    rank = re.fullmatch(r"rank:(\d+)", evict_raw)
    if evict_raw not in ("", "0", "1", "true", "false") and rank is None:
        raise ConfigError(f"{EVICT_BEFORE_LOAD}={evict_raw!r}: expected 1, 0 or rank:N")
    found = Switches(skip_load_layers=skip, evict_before_load=evict_raw in ("1", "true") or rank is not None,
                     evict_rank=int(rank.group(1)) if rank else None, worker_off=env.get(WORKER_OFF, ""))
    for name in VARIABLES:
        if env.get(name) and env.get(name) not in ("0", "false") and name not in _warned:
            _warned.add(name)
            log.warning("shmkv: TEST SWITCH %s=%r is on (a fault the test suite injects; never set it in service)",
                        name, env[name])
    return found
