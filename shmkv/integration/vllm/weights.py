"""What an engine's weights are, so that no engine ever loads KV computed
with other weights. The namespace names them in two parts:

  * The weights as the engine started with them: each TP rank's digest of
    its tensors as loaded (loaded_weights.py), reported at the handshake.
    Where a rank has none (a loader that skips vLLM's post-load step), the
    files beside a digest of the tensors as held: an xxh3-128 of every byte
    of every weight file of a local model (hub models: the commit vLLM
    resolved), remembered by (device, inode, size, mtime, ctime) in
    <runtime dir>/weights-digests.json (0600) and read once per content, in
    a thread; the engine waits for it up to FILES_WAIT_S, then serves
    without shmkv (no lookup, no store) until it is known.
  * The weights in memory (RLHF updates, reload_weights, the weight-transfer
    engines, a collective_rpc running a user's function, sleep and wake):
    each worker fingerprints every byte of its parameters and buffers at
    registration; a load_weights (wrapped), and every call from the engine
    to its workers not known to leave the weights alone (install_hooks),
    marks the rank's board file in the runtime directory "dirty" before it
    runs and rings the engine's bell (a mapped file of one stamp per rank,
    read by the scheduler every step without a system call), so the next
    step knows; the worker fingerprints again before its next step, and
    when the scheduler half asks (after a prefix-cache reset, vLLM's or the
    connector's). Weights that differ from those of the start name a new
    generation (namespace field weights_gen); the same weights again are the
    starting generation. While a board is dirty or a check is unanswered,
    lookups answer "ask again" and nothing is stored; a rank whose
    fingerprint fails stops the engine's use of shmkv (never vLLM's step).

Boards and bells are named per engine instance (the connector's engine_id
and the VllmConfig's instance id: two LLMs built from one KVTransferConfig
share the engine_id).

Invariant: a key's namespace names the weights that computed its KV; when in
doubt (unknown digest, pending check), shmkv neither loads nor stores.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import xxhash

from shmkv.integration.vllm.loaded_weights import combine, digest_tensors, watch
from shmkv.integration.vllm.weights_boards import (
    board_stamp,
    engine_bell,
    read_board,
    sweep_stale,
    write_board,
)
from shmkv.integration.vllm.weights_files import (
    FilesIdentity,
)

log = logging.getLogger("shmkv.connector")

CHECK_WAIT_S = 30.0  # how long lookups wait for the workers' answer to a weights check
FILES_WAIT_S = 5.0  # how long engine start waits for the files' digest (then serves without shmkv until known)


# -------------------------------------------------------------- in memory --
def fingerprint(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of every byte of the parameters as held (loaded_weights.digest_tensors;
    b7fe4e6 sampled 64 elements and a sum per tensor, which a change between samples escaped)."""
    return digest_tensors(params, "held").digest


def find_models(layers: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The outermost modules with a load_weights method that hold one of
    `layers` (vLLM's attention layers of this worker): the target model and
    a drafter's. The model runner that registers the KV caches is on the
    call stack (its get_model() and its drafter's model); failing that, one
    scan of the heap."""
    want = {id(m) for m in layers}
    if not want:
        return []

    def holding(cands: Iterable[Any]) -> list[torch.nn.Module]:
        mods = [m for m in cands if isinstance(m, torch.nn.Module) and callable(getattr(m, "load_weights", None))]
        mods = [m for m in mods if any(id(s) in want for s in m.modules())]
        inner = {id(s) for m in mods for s in m.modules() if s is not m}
        out, seen = [], set()
        for m in mods:
            if id(m) not in inner and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
        return out

    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        get_model = getattr(owner, "get_model", None)
        if callable(get_model):
            try:
                cands = [get_model()]
            except Exception:
                cands = []
            for name in ("drafter", "speculator"):
                cands.append(getattr(getattr(owner, name, None), "model", None))
            found = holding(cands)
            if found:
                return found
        frame = frame.f_back
    ok_type: dict[type, bool] = {}  # one check per type: the heap holds about a million objects

    def model_like(o: Any) -> bool:
        t = type(o)
        ok = ok_type.get(t)
        if ok is None:
            ok = ok_type[t] = issubclass(t, torch.nn.Module) and callable(getattr(t, "load_weights", None))
        return ok

    return holding(o for o in gc.get_objects() if model_like(o))


def board_id(vllm_config: Any) -> str:
    """The engine instance's name for its weights boards and bell: the
    connector's engine_id (two LLMs built from one KVTransferConfig share it)
    and the VllmConfig's instance id (one per engine, the same in its workers)."""
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    instance = str(getattr(vllm_config, "instance_id", "") or "")
    return f"{engine_id}-{instance}" if instance else engine_id


def tp_rank() -> int:
    """This worker's TP rank (0 where vLLM's parallel state is not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001
        return 0


def engine_weights(vllm_config: Any) -> EngineWeights:
    """The weights' identity for an engine's keys: the ranks' digests of
    their tensors as loaded (loaded_weights.py, reported at the handshake or
    on the boards); where a rank has none, the files' digest beside it (the
    hub commit vLLM resolved, for a hub model)."""
    mc = vllm_config.model_config
    commit = getattr(getattr(mc, "hf_config", None), "_commit_hash", None)
    model, commit = str(mc.model), commit if isinstance(commit, str) else None
    return EngineWeights(board_id(vllm_config), vllm_config.parallel_config.tensor_parallel_size,
                         files_factory=lambda: FilesIdentity(model, commit))


class WorkerWeights:
    """A worker's watch over its model's weights in memory (module doc)."""

    def __init__(self, engine_id: str, rank: int, models: list[torch.nn.Module], *,
                 settle_after_calls: bool = False) -> None:
        """`settle_after_calls`: fingerprint again as soon as a worker call
        that may have written the weights returned (the native tier: no
        connector step runs in the worker to do it before the next step)."""
        self.engine_id, self.rank = engine_id, rank
        self.models = models
        self.settle_after_calls = settle_after_calls
        self.loaded: Any = None  # the rank's digest of its tensors as loaded (loaded_weights.TensorsDigest), if shown
        self.answered = 0  # the scheduler's last check request answered
        self.dirty = False  # a load_weights ran since the last fingerprint
        self.fingerprint = ""
        self.failed: str | None = None  # why a fingerprint failed: the board says so, the engine stops using shmkv
        self.adapters: dict[str, str] = {}  # lora_int_id -> digest of the LoRA adapter held (adapters.py)
        for m in models:
            self._wrap(m)
        self.publish()
        watch(self)  # loaded_weights' worker-call hook marks it dirty before a call that may write the weights

    def add_model(self, model: torch.nn.Module, loaded: Any = None) -> None:
        """Watch one more model of this rank (a drafter), with the rank's
        digest of its tensors as loaded now (shown on the board), and write
        the board."""
        self.models.append(model)
        self._wrap(model)
        self.loaded = loaded
        self.publish()

    def due(self, asked: int) -> bool:
        """Whether this step must fingerprint (weights loaded, or a check asked for)."""
        return self.failed is None and (self.dirty or asked > self.answered)

    def _params(self) -> Iterable[tuple[str, torch.Tensor]]:
        for i, m in enumerate(self.models):
            for name, p in m.named_parameters():
                yield f"{i}.{name}", p
            for name, b in m.named_buffers():
                yield f"{i}.buffer.{name}", b

    def _wrap(self, model: torch.nn.Module) -> None:
        original: Callable = model.load_weights

        def load_weights(*args: Any, **kwargs: Any) -> Any:
            self.mark_dirty("load_weights")
            return original(*args, **kwargs)

        model.load_weights = load_weights  # type: ignore[method-assign]

    def mark_dirty(self, reason: str) -> None:
        """Before the weights may move: the board says so (the scheduler stops
        using their keys at its next step) and the next step fingerprints."""
        if self.dirty:
            return
        self.dirty = True
        log.debug("shmkv: TP rank %d weights may change (%s): fingerprinted before the next step", self.rank, reason)
        try:
            write_board(self.engine_id, self.rank, self._board())
        except Exception as e:  # noqa: BLE001 - never into vLLM's call; unread dirt: the engine stops
            self.failed = f"the board could not be written: {type(e).__name__}: {e}"
            log.warning("shmkv: TP rank %d: %s; weights changed now are not seen by the scheduler, so "
                        "this engine stops using the shared cache", self.rank, self.failed)

    def set_adapters(self, held: dict[int, str]) -> None:
        """The LoRA adapters this rank holds now (adapters.held_adapters):
        the board says so when they changed (the scheduler keys requests of
        an adapter by what every rank holds). Never raises."""
        now = {str(k): v for k, v in held.items()}
        if now == self.adapters or self.failed:
            return
        self.adapters = now
        try:
            write_board(self.engine_id, self.rank, self._board())
        except Exception as e:  # noqa: BLE001 - the scheduler then keys adapters by their files (checked here)
            log.warning("shmkv: TP rank %d: the board could not be written (%s): the scheduler does not learn "
                        "which LoRA adapters this rank holds", self.rank, e)

    def _board(self) -> dict[str, Any]:
        board: dict[str, Any] = {"answered": self.answered, "fingerprint": self.fingerprint, "dirty": self.dirty,
                                 "adapters": self.adapters}
        if self.failed:
            board["failed"] = self.failed
        if self.loaded is not None:
            board["loaded"], board["basis"] = self.loaded.digest, self.loaded.basis
        return board

    def publish(self, answered: int | None = None) -> None:
        """Fingerprint the weights now and write the board (before returning).
        Never raises into vLLM's step: a failure (a device out of memory, a
        full runtime directory) is written to the board if it can be, and the
        engine serves without shmkv from then on (EngineWeights)."""
        if answered is not None:
            self.answered = max(self.answered, answered)
        t0 = time.perf_counter()
        try:
            self.fingerprint = fingerprint(self._params())
            self.dirty = False
            write_board(self.engine_id, self.rank, self._board())
        except Exception as e:  # noqa: BLE001 - the step goes on; the scheduler half stops using shmkv
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("shmkv: TP rank %d could not fingerprint its weights (%s): this engine serves without the "
                        "shared cache from now on", self.rank, self.failed)
            try:
                write_board(self.engine_id, self.rank, self._board())
            except Exception as e2:  # noqa: BLE001 - no board: the scheduler's check times out (CHECK_WAIT_S)
                log.warning("shmkv: TP rank %d could not write its weights board either (%s)", self.rank, e2)
            return
        log.debug("shmkv: TP rank %d weights fingerprint %s (%.3f s)", self.rank, self.fingerprint,
                  time.perf_counter() - t0)


class EngineWeights:
    """The scheduler half's view of the engine's weights: the ranks' digests
    of their tensors (reported at the handshake, loaded_weights.py), the
    files' identity where a rank has no digest of its tensors as loaded, and
    the workers' boards, read once per step. `fields()` are the namespace's
    weight fields, or None while they are not known (no lookup, no store)."""

    def __init__(self, engine_id: str, tp_size: int, files: FilesIdentity | None = None,
                 files_factory: Callable[[], FilesIdentity] | None = None) -> None:
        self.engine_id, self.tp_size = engine_id, tp_size
        self.files = files
        self._files_factory = files_factory
        # an engine (files_factory) waits for its ranks' tensor digests; a bare view (files) names the files alone
        self._tensors_expected = files is None
        self._tensors: str | None = None  # the ranks' digests, combined, once every rank reported one
        self._tensors_basis = ""  # "loaded" when every rank's digest is of its tensors as loaded
        self._reported = False
        engine_bell(engine_id)  # held from the start: no sweep takes it while this engine lives
        try:
            swept = sweep_stale(engine_id)
        except OSError as e:
            log.warning("shmkv: sweeping the weights boards of engines that are gone failed: %s", e)
        else:
            if swept:
                log.info("shmkv: removed %d weights board(s) of engines that are gone", swept)
        self._start: list[str | None] = [None] * tp_size  # each rank's fingerprint at registration
        self._now: list[str | None] = [None] * tp_size
        self._answered = [0] * tp_size
        self._dirty = [False] * tp_size
        self._failed: list[str | None] = [None] * tp_size  # a rank whose fingerprint failed: shmkv off
        self._stamps: list[tuple[int, int] | None] = [None] * tp_size
        self._adapters: list[dict[str, str]] = [{} for _ in range(tp_size)]  # per rank: LoRA adapters held
        self.asked = 0  # the last check request (ask_check), shipped to the workers in the step's metadata
        self._asked_at = 0.0
        self._check_late_logged = False
        self._fields: tuple[tuple[str, str], ...] | None = None
        self.generation = ""  # "" while the weights are those the engine started with

    def set_tensors(self, reports: dict[int, tuple[str, str]]) -> None:
        """At the handshake: each rank's (digest, basis) of its tensors. Where
        a rank has none of its tensors as loaded, the files' digest joins the
        identity (read once per file content, waited for up to FILES_WAIT_S;
        then the engine serves without shmkv until it is known)."""
        self._reported = True
        ranks = [reports.get(r, ("", "")) for r in range(self.tp_size)]
        digests, bases = [d for d, _ in ranks], {b for _, b in ranks}
        if all(digests):
            self._tensors = combine(digests)
            self._tensors_basis = "loaded" if bases == {"loaded"} else "held"
        if self._tensors_basis == "loaded":
            log.info("shmkv: weights identity: the tensors as loaded on %d rank(s), digest %s", self.tp_size,
                     self._tensors[:16] if self._tensors else "")
            return
        if self.files is None and self._files_factory is not None:
            self.files = self._files_factory()
        if self.files is None:
            return
        if self.files.wait(FILES_WAIT_S):
            log.info("shmkv: weights identity: the files %s%s (%.2f s)", (self.files.value or "unknown")[:40],
                     f" and the tensors as held ({self._tensors[:16]})" if self._tensors else "", self.files.seconds)
        else:
            log.info("shmkv: the digest of the weight files takes longer than %.0f s (every byte is read once per "
                     "file content, then remembered): this engine serves without the shared cache until it is known",
                     FILES_WAIT_S)

    def _identity(self) -> tuple[tuple[str, str], ...] | None:
        """The weights' fields before any change in memory, or None while unknown."""
        if self._tensors_basis == "loaded":
            return (("weights", f"tensors:{self._tensors}"),)
        if self._tensors_expected and not self._reported:
            return None
        if self.files is None or self.files.value is None:
            return None
        return (("weights", self.files.value),) + ((("weights_held", self._tensors),) if self._tensors else ())

    def ask_check(self) -> None:
        """The workers fingerprint their weights at the next step (a prefix-cache reset: weights may have changed)."""
        self.asked += 1
        self._asked_at = time.monotonic()

    def pending(self) -> bool:
        """A check asked for is not answered by every worker yet (lookups ask
        again), for at most CHECK_WAIT_S: then the engine serves without
        shmkv until the answers come (a worker that never answers must not
        hold requests)."""
        if self._identity() is None or any(f is None for f in self._now) or any(self._failed):
            return False
        if all(a >= self.asked for a in self._answered) and not any(self._dirty):
            return False
        if time.monotonic() - self._asked_at > CHECK_WAIT_S:
            if not self._check_late_logged:
                self._check_late_logged = True
                log.warning("shmkv: the workers did not answer a weights check within %.0f s: requests are served "
                            "without the shared cache until they do", CHECK_WAIT_S)
            return False
        return True

    def refresh(self) -> bool:
        """Read the boards (once per step). True when the namespace's fields changed."""
        for r in range(self.tp_size):
            stamp = board_stamp(self.engine_id, r)
            if stamp is None or stamp == self._stamps[r]:
                continue  # unchanged since the last step: one stat
            b = read_board(self.engine_id, r)
            if b is None:
                continue
            self._stamps[r] = stamp
            if b.get("failed") and not self._failed[r]:
                self._failed[r] = str(b["failed"])
                log.warning("shmkv: TP rank %d could not fingerprint its weights (%s): this engine serves without "
                            "the shared cache from now on", r, self._failed[r])
            fp = str(b.get("fingerprint", ""))
            if self._start[r] is None:
                self._start[r] = fp
            self._now[r] = fp
            self._answered[r] = int(b.get("answered", 0))
            held = b.get("adapters")
            self._adapters[r] = {str(k): str(v) for k, v in held.items()} if isinstance(held, dict) else {}
            was_dirty, self._dirty[r] = self._dirty[r], bool(b.get("dirty"))
            if self._dirty[r] and not was_dirty:
                self._asked_at = time.monotonic()  # the wait for its fingerprint starts now
        fields = self._compute()
        if fields == self._fields:
            return False
        self._fields = fields
        return True

    def _compute(self) -> tuple[tuple[str, str], ...] | None:
        ident = self._identity()
        if ident is None or any(f is None for f in self._now) or any(self._failed):
            return None
        if any(a < self.asked for a in self._answered) or any(self._dirty):
            return None
        fields: tuple[tuple[str, str], ...] = ident
        if self._now != self._start:
            gen = xxhash.xxh3_128("\0".join(str(f) for f in self._now).encode()).hexdigest()
            fields += (("weights_gen", gen),)
            if gen != self.generation:
                log.info("shmkv: this engine's weights changed in memory (generation %s): it loads and stores only "
                         "KV of these weights from now on", gen[:12])
            self.generation = gen
        elif self.generation:
            log.info("shmkv: this engine's weights are those it started with again: it shares their chunks")
            self.generation = ""
        return fields

    def fields(self) -> tuple[tuple[str, str], ...] | None:
        return self._fields

    def adapter(self, lora_int_id: int) -> str | None:
        """The digest of the LoRA adapter every rank holds under this id
        (adapters.py), or None where a rank holds none (or they differ)."""
        held = {a.get(str(lora_int_id)) for a in self._adapters}
        if len(held) != 1:
            return None
        only = held.pop()
        return only or None

    def failures(self) -> int:
        """Ranks whose weights check failed (the engine serves without shmkv from then on)."""
        return sum(1 for f in self._failed if f)
