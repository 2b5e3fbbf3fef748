"""Pinning the segment for a GPU a slice at a time (shmkv.transfer.gpu), on a
stand-in for the CUDA part that records what it is asked to pin: the first
slice is pinned before register_segment returns, the rest by a thread, never
past what the segment has reserved (pinning would fault in pages the daemon
owns); a copy that touches a slice not pinned yet pins it first; the last
user stops the thread and unpins every slice; a second user shares the
registration. No GPU needed: the bookkeeping is the same code a GPU runs."""

from __future__ import annotations

import threading

import pytest
from helpers import wait_until

from shmkv import Store
from shmkv.transfer import gpu

SLICE = 32 << 20


class FakeCuda:
    """Records register_host / unregister_host; `gate` holds the background thread's pins."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.main = threading.get_ident()

    def register_host(self, ptr: int, nbytes: int) -> None:
        if threading.get_ident() != self.main:
            self.gate.wait(30)
        with self.lock:
            assert ptr not in self.pinned, "a slice is pinned once"
            self.pinned[ptr] = nbytes
            self.calls.append(("register", ptr))

    def unregister_host(self, ptr: int) -> None:
        with self.lock:
            self.pinned.pop(ptr)
            self.calls.append(("unregister", ptr))


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda()
    monkeypatch.setattr(gpu, "extension", lambda: f)
    monkeypatch.setattr(gpu, "SLICE_BYTES", SLICE)
    monkeypatch.setattr(gpu, "RESERVE_POLL_S", 0.005)
    return f


def test_the_first_slice_before_serving_the_rest_in_the_background(fake, cache_name):
    with Store.create(cache_name, 160 << 20, populate=False) as store:
        base, size = store.arena_address, store.arena_bytes
        slices = -(-size // SLICE)
        fake.gate.clear()  # the background thread waits: only the first slice is pinned on return
        gpu.register_segment(store)
        assert fake.pinned == {base: SLICE}
        fake.gate.set()
        wait_until(lambda: len(fake.pinned) == slices, "every slice pinned in the background")
        assert sum(fake.pinned.values()) == size and sorted(fake.pinned) == [base + i * SLICE for i in range(slices)]
        gpu.unregister_segment(store)
        assert fake.pinned == {} and [c for c, _ in fake.calls].count("unregister") == slices


def test_a_copy_pins_its_slices_first_and_nothing_is_pinned_twice(fake, cache_name):
    with Store.create(cache_name, 160 << 20, populate=False) as store:
        base, size = store.arena_address, store.arena_bytes
        fake.gate.clear()
        gpu.register_segment(store)
        last = base + size - 4096
        gpu.ensure_registered(last - SLICE + 2048, SLICE)  # spans the last two slices
        tail = sorted(fake.pinned)[-2:]
        assert len(fake.pinned) == 3 and tail == [base + (size - 1) // SLICE * SLICE - SLICE,
                                                  base + (size - 1) // SLICE * SLICE]
        gpu.ensure_registered(base + 100, 10)  # already pinned: nothing more
        assert len(fake.pinned) == 3
        fake.gate.set()
        wait_until(lambda: len(fake.pinned) == -(-size // SLICE), "the background pins the rest, skipping those")
        gpu.unregister_segment(store)
        assert fake.pinned == {}


def test_nothing_past_the_reserved_arena_is_pinned_until_it_is_reserved(fake, cache_name):
    # 256 MiB of the arena are reserved at creation, the rest only when asked (no background reservation here)
    with Store.create(cache_name, 400 << 20, populate=False, background_reserve=False) as store:
        base, size = store.arena_address, store.arena_bytes
        reserved = store.stats()["arena_reserved_bytes"]
        assert reserved < size
        gpu.register_segment(store)
        within = reserved // SLICE
        wait_until(lambda: len(fake.pinned) == within, "the reserved slices pinned")
        assert all(p + n <= base + reserved for p, n in fake.pinned.items()), "nothing past the reservation"
        store.reserve_more(size)
        wait_until(lambda: len(fake.pinned) == -(-size // SLICE), "the rest pinned once reserved")
        gpu.unregister_segment(store)
        assert fake.pinned == {}


def test_a_second_user_shares_the_registration(fake, cache_name):
    with Store.create(cache_name, 64 << 20, populate=False) as store:
        gpu.register_segment(store, wait=True)
        n = len(fake.pinned)
        assert gpu.register_segment(store) == 0.0 and len(fake.pinned) == n
        gpu.unregister_segment(store)
        assert len(fake.pinned) == n, "one user left"
        gpu.unregister_segment(store)
        assert fake.pinned == {}


def test_memory_outside_every_segment_is_left_alone(fake):
    gpu.ensure_registered(0x1000, 4096)  # a host tensor of a test: torch pins its own
    assert fake.calls == []
