"""A process that holds a segment's init byte (creating a large segment, or
stopped in the middle of it) delays others only up to init_wait_s: then
Store.create / attach raise LockTimeoutError saying what they waited for,
instead of hanging every vLLM start behind it. Once it is gone, they work."""

from __future__ import annotations

import time

import pytest

from shmkv import Store
from shmkv.errors import LockTimeoutError

HOLDER = """
import fcntl, os, struct, sys
fd = os.open("/dev/shm/" + sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
lock = struct.pack("hhqqii", fcntl.F_WRLCK, 0, 0, 1, 0, 0)  # struct flock: byte 0, the init byte
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
print("held", flush=True)
sys.stdin.read()  # until the test ends (or kills us)
"""


def test_a_stuck_initialiser_delays_create_and_attach_only_up_to_the_bound(cache_name):
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, cache_name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for open_it in (lambda: Store.create(cache_name, 8 << 20, populate=False, init_wait_s=0.5),
                        lambda: Store.attach(cache_name, populate=False, init_wait_s=0.5)):
            t0 = time.monotonic()
            with pytest.raises(LockTimeoutError, match=f"initialising segment /dev/shm/{cache_name} for over 0.5 s"):
                open_it()
            assert time.monotonic() - t0 < 5, "bounded by init_wait_s (and its polling)"
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with Store.create(cache_name, 8 << 20, populate=False, init_wait_s=0.5) as s:  # the holder's lock went with it
        assert s.stats()["entries"] == 0
