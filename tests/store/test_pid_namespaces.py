"""Processes in separate PID namespaces (containers: `docker run --ipc=host`,
pods) share one segment: whether a lease's, a write's or the table lock's
holder lives is what the kernel says of its process slot's OFD lock, never
its pid read in the checker's namespace, where another container's pid means
nothing. Each case runs its processes under `unshare --pid --fork
--mount-proc` (root here, as in CI), sharing /dev/shm and nothing of /proc.

On cdea691 the first three cases failed: another namespace's reclaim took a
live holder's lease (its view then held someone else's bytes) and its
unfinished write, and a live lock holder there was called a broken segment.
"""

from __future__ import annotations

import os

import pytest
from helpers import helpers_env, key, lock_holder_code, payload_for, wait_until

from shmkv import PutResult, Store
from shmkv.store import Role

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root (unshare), as in CI")

HOLDER = """
import sys
from helpers import key, payload_for
from shmkv import Store
s = Store.attach({name!r}, populate=False)
lease = s.acquire(key(1))
view = bytes(lease.view())
r = s.reserve(key(2), 1 << 20)
r.view()[: 1 << 19] = payload_for(key(2), 1 << 19)  # half of a write, as a store in flight
print("held", flush=True)
sys.stdin.readline()  # the other namespace reclaims and writes meanwhile
r.view()[1 << 19:] = payload_for(key(2), 1 << 20)[1 << 19:]
print("lease", bytes(lease.view()) == view, lease.release(), flush=True)
print("commit", r.commit().name, flush=True)
"""

OTHER = """
from helpers import key, payload_for
from shmkv import PutResult, Store
s = Store.attach({name!r}, populate=False)
got = s.reclaim()
print("reclaimed", got["leases"], got["writes"], flush=True)
for i in range(16):
    k = key(("other", i))
    assert s.put(k, payload_for(k, 1 << 20)) in (PutResult.OK, PutResult.FULL)
print("attached", s.stats()["processes_attached"], flush=True)
"""


def in_namespace(child, code: str):
    """A child in a PID namespace of its own (helpers importable)."""
    return child(code, pid_namespace=True, env=helpers_env())


@pytest.fixture
def segment(cache_name):
    s = Store.create(cache_name, 24 << 20, populate=False)
    s.put(key(1), payload_for(key(1), 1 << 20))
    yield s
    s.close()


def test_a_live_holder_in_another_namespace_keeps_its_lease_and_its_write(segment, cache_name, child):
    a = in_namespace(child, HOLDER.format(name=cache_name))
    a.expect("held")
    b = in_namespace(child, OTHER.format(name=cache_name))
    assert b.expect("reclaimed") == "reclaimed 0 0", "nothing of the live holder in the other namespace"
    assert b.expect("attached").split()[1] in ("2", "3"), "the holder counts as attached from there too"
    b.finish()
    a.proc.stdin.write("go\n")
    a.proc.stdin.flush()
    assert a.expect("lease") == "lease True True", "the leased bytes stayed the holder's, and its release held"
    assert a.expect("commit") == "commit OK"
    a.finish()
    assert bytes(segment.get(key(2))) == payload_for(key(2), 1 << 20)
    assert segment.check_consistency() == []


def test_a_holder_killed_in_another_namespace_is_reclaimed_from_this_one(segment, cache_name, child):
    a = in_namespace(child, HOLDER.format(name=cache_name))
    a.expect("held")
    assert segment.reclaim()["leases"] == 0, "alive: not reclaimed"
    a.kill9()  # unshare dies, and with it the namespace's processes (its init first)
    # NOTE: the namespace's processes exit after unshare has been reaped: their slots tell when
    wait_until(lambda: segment.stats()["processes_attached"] == 1, "the other namespace's holder exited")
    got = segment.reclaim()
    assert (got["leases"], got["writes"]) == (1, 1)
    assert segment.check_consistency() == []
    assert segment.put(key(2), payload_for(key(2), 4096)) is PutResult.OK, "the dead write's key is free again"


IDLE = """
import os, sys
from shmkv import Store
s = Store.attach({name!r}, populate=False)
print("pid", os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_a_killed_holder_is_reclaimed_while_another_namespace_runs_a_process_of_its_pid(segment, cache_name, child):
    """Every container's first process is pid 1 in its namespace: a killed
    container's lease and write are reclaimed although a live process of
    another namespace (a daemon, another engine) carries the same pid."""
    a = in_namespace(child, HOLDER.format(name=cache_name))
    a.expect("held")
    b = in_namespace(child, IDLE.format(name=cache_name))
    assert b.expect("pid") == "pid 1", "both are their namespace's first process"
    a.kill9()
    wait_until(lambda: segment.stats()["processes_attached"] == 2, "the killed namespace's holder exited")
    got = segment.reclaim()
    assert (got["leases"], got["writes"]) == (1, 1), "not kept alive by the other namespace's pid 1"
    assert segment.check_consistency() == []
    b.proc.stdin.write("go\n")
    b.proc.stdin.flush()
    b.finish()


TWO_STORES = """
import sys
from helpers import key
from shmkv import Store
first = Store.attach({name!r}, populate=False)
second = Store.attach({name!r}, populate=False)
lease = second.acquire(key(1))
first.close()  # the process stays attached through the second store
print("closed one", flush=True)
sys.stdin.readline()  # another namespace reclaims meanwhile
print("lease", lease.release(), flush=True)
"""


def test_a_process_that_closes_one_of_two_stores_keeps_the_other_stores_lease(segment, cache_name, child):
    a = in_namespace(child, TWO_STORES.format(name=cache_name))
    a.expect("closed one")
    assert segment.reclaim()["leases"] == 0, "the holder lives: its other store still holds its slot"
    a.proc.stdin.write("go\n")
    a.proc.stdin.flush()
    assert a.expect("lease") == "lease True"
    a.finish()
    wait_until(lambda: segment.stats()["processes_attached"] == 1, "the child detached")


LOCK_CHECKER = """
from helpers import key, payload_for
from shmkv import PutResult, Store
from shmkv.errors import LockTimeoutError
s = Store.attach({name!r}, populate=False, lock_timeout_s=0.2)
print("get", s.get(key(0)) is None, flush=True)
print("put", s.put(key(5), payload_for(key(5), 4096)).name, flush=True)
try:
    s.reclaim()
    print("reclaim returned", flush=True)
except LockTimeoutError as e:
    print("reclaim timed out", "another PID namespace" in str(e), flush=True)
"""


def test_a_stopped_lock_holder_in_another_namespace_is_waited_for_not_called_broken(cache_name, child):
    """A holds the table lock in one namespace, B asks in another, where A's
    thread id and pid mean nothing: B gets ordinary answers within the bound
    (a miss, a busy put, a whole-table operation timed out), never "the
    segment was overwritten"; once A dies the lock is recovered."""
    store = Store.create(cache_name, 8 << 20, populate=False, lock_timeout_s=0.2)
    try:
        store.put(key(0), payload_for(key(0), 4096))
        a = in_namespace(child, lock_holder_code(cache_name))
        a.expect("held")
        b = in_namespace(child, LOCK_CHECKER.format(name=cache_name))
        assert b.expect("get") == "get True", "a miss while the lock is held"
        assert b.expect("put").split()[1] in ("BUSY", "TIMED_OUT")
        assert b.expect("reclaim") == "reclaim timed out True", "the message says whose pid it is"
        b.finish()
        a.kill9()
        wait_until(lambda: store.get(key(0)) is not None, "the lock recovered once its holder died")
        assert bytes(store.get(key(0))) == payload_for(key(0), 4096)
        assert store.check_consistency() == []
    finally:
        store.close()


FORKER = """
import os, sys
from helpers import key
from shmkv import Store
s = Store.attach({name!r}, populate=False)
s.get(key(1))  # registered before the fork
pid = os.fork()
if pid == 0:
    lease = s.acquire(key(1))  # the child's own slot
    os._exit(0)  # exits holding it
os.waitpid(pid, 0)
print("forked child gone", flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_is_judged_by_its_own_slot_while_its_parent_lives(segment, cache_name, child):
    """A child forked from an attached process shares its parent's open
    file description: it takes one of its own, so its death is seen from
    every namespace while the parent lives on."""
    a = in_namespace(child, FORKER.format(name=cache_name))
    a.expect("forked child gone")
    assert segment.reclaim()["leases"] == 1, "the dead child's lease, while its parent lives"
    assert segment.stats().get("liveness_unshared") == 0, "the child had a description of its own"
    a.proc.stdin.write("done\n")
    a.proc.stdin.flush()
    a.finish()


ROLE = """
import sys
from shmkv import Store
from shmkv.store import Role
s = Store.attach({name!r}, populate=False)
print("maintainer", s.try_hold_role(Role.MAINTAINER), flush=True)
sys.stdin.readline()
"""


def test_the_maintainer_role_is_one_across_namespaces(segment, cache_name, child):
    """Containers share the segment, not the runtime directory: the role is
    the segment's own lock, and it passes on when its holder dies."""
    a = in_namespace(child, ROLE.format(name=cache_name))
    assert a.expect("maintainer") == "maintainer True"
    b = in_namespace(child, ROLE.format(name=cache_name))
    assert b.expect("maintainer") == "maintainer False"
    assert segment.role_held_elsewhere(Role.MAINTAINER)
    assert not segment.try_hold_role(Role.MAINTAINER)
    a.kill9()
    wait_until(lambda: segment.try_hold_role(Role.MAINTAINER), "the role free again once its holder died")
    segment.release_role(Role.MAINTAINER)
    b.kill9()


def test_an_embedded_maintainer_stands_by_for_a_daemon_of_another_namespace(segment, cache_name, child):
    from shmkv.config import load_config
    from shmkv.services.maintainer import MaintainerRole
    from shmkv.tiers import TierChain

    d = in_namespace(child, f"""
import sys
from shmkv import Store
from shmkv.store import Role
s = Store.attach({cache_name!r}, populate=False)
print("daemon", s.try_hold_role(Role.DAEMON), flush=True)
sys.stdin.readline()
""")
    assert d.expect("daemon") == "daemon True"
    role = MaintainerRole(load_config({"cache_name": cache_name}), TierChain(segment), standby_s=0.01)
    try:
        assert role._daemon_runs(), "the daemon of the other namespace is seen through the segment"
        role.start()
        d.kill9()
        wait_until(lambda: role.lock.held, "the embedded role took over once the daemon died")
    finally:
        role.stop()
