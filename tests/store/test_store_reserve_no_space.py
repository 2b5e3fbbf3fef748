"""/dev/shm fills up while a segment's arena is still being reserved (another
process took the room): the reservation stops with one warning naming
/dev/shm and a counter, nothing raises SIGBUS, and the cache keeps working
in the part it has. Runs in a private mount namespace with a 600 MiB tmpfs
on /dev/shm (root only)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, logging, os
    import numpy as np
    from shmkv import PutResult, Store
    from shmkv.errors import NoSpaceError

    logs = []
    class Keep(logging.Handler):
        def emit(self, record):
            logs.append((record.levelname, record.getMessage()))
    logging.getLogger("shmkv").addHandler(Keep())
    MiB = 1 << 20
    creator = Store.create("nospace", 560 * MiB, background_reserve=False, max_payload_bytes=32 * MiB)
    fd = os.open("/dev/shm/someone-else", os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 300 * MiB)  # another user of /dev/shm takes the room
    try:
        creator.reserve_more(1 << 40)
        raised = ""
    except NoSpaceError as e:
        raised = str(e)
    other = Store.attach("nospace")  # its background reservation meets the same wall
    complete = other.wait_reserved(timeout_s=60)
    results = [creator.put(bytes([i]) * 16, np.full(32 * MiB, i, dtype=np.uint8)) for i in range(20)]
    st = other.stats()
    print("RESULT " + json.dumps({
        "raised": raised, "complete": complete, "reserve_errors": st["reserve_errors"],
        "reserved": st["arena_reserved_bytes"], "arena": st["arena_bytes"],
        "ok_puts": sum(r is PutResult.OK for r in results), "evictions": st["evictions"],
        "consistency": other.check_consistency(),
        "get_last": bytes(other.get(bytes([19]) * 16)[:4]).hex(),
        "warnings": [m for lvl, m in logs if lvl == "WARNING"],
    }))
    other.close()
    creator.close()
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) (util-linux)")
def test_a_full_dev_shm_stops_the_reservation_not_the_cache():
    shell = ("mount -t tmpfs -o size=600m,mode=1777 tmpfs /dev/shm || exit 77\n"
             f"exec {sys.executable} -c '{SCRIPT.replace(chr(39), chr(34))}'")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 77 or "unshare failed" in r.stderr or "Operation not permitted" in r.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here (needs root): {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert "/dev/shm" in got["raised"] and "No space" in got["raised"], got["raised"]
    assert got["complete"] is False and got["reserved"] < got["arena"]
    assert got["reserve_errors"] == 2, "the explicit call and the attacher's background thread"
    assert len(got["warnings"]) == 1 and "reserve" in got["warnings"][0], got["warnings"]
    assert got["ok_puts"] == 20 and got["evictions"] > 0, "the cache works as a smaller one"
    assert got["consistency"] == [] and got["get_last"] == "13131313"
