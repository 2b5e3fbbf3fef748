"""The weights' identity as the engine computes with them: a digest of every
byte of every parameter and buffer a worker holds, taken where vLLM's
loader hands the model to its kernels.

vLLM's loaders (safetensors, the runai streamer, GGUF, sharded state, the
weight-cache daemon, a reload) end in `process_weights_after_loading`, which
turns the tensors into each kernel's format; on vLLM-CPU that step prepacks
every linear weight for oneDNN (or sgl's and zentorch's kernels) and leaves
an empty `Parameter` in its place, so the model no longer holds what it
computes with. shmkv's vLLM plugin (`register`, in every process vLLM
starts) wraps that function: just before it runs, an engine that uses shmkv
digests the model's tensors as the loader produced them (each TP rank its
shard) and keeps the digest on the model (`LOADED_ATTR`). The worker's
connector reports it at the handshake (connector.py), and the namespace
names it (weights.py): two engines share keys only when their loaded
tensors are equal to the byte, whatever their files, paths or loaders.

Loaders that skip the function (tensorizer's vLLM-serialized models) leave
no digest: the worker then digests what its model holds at KV-cache
registration ("held" basis; on vLLM-CPU that misses the packed linear
weights, so the files' digest stays in the namespace beside it).

Invariant: a digest covers every byte of every tensor it names, in order,
with names, shapes and dtypes; it never raises into vLLM's loading (a
failure leaves no digest, logged, and the engine falls back as above).
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from shmkv.integration.vllm.adapters import install_adapter_hook

log = logging.getLogger("shmkv.connector")

LOADED_ATTR = "_shmkv_loaded_digest"
PIECE_BYTES = 64 << 20  # a tensor is hashed in pieces of this size (threads; bounded host copies from a GPU)
_HOOKED = "_shmkv_hooked"


@dataclass(frozen=True)
class TensorsDigest:
    digest: str  # xxh3-128 hex of the tensors' names, shapes, dtypes and every byte
    tensors: int
    nbytes: int
    seconds: float
    basis: str  # "loaded": before kernel processing; "held": what the model held at registration
    # name -> (its digest, data_ptr, numel) as digested: which tensors a model still holds at registration
    per_tensor: dict[str, tuple[str, int, int]] = field(default_factory=dict, compare=False, repr=False)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view where it can be)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.element_size() else flat


def _pieces(named: Iterable[tuple[str, torch.Tensor]]
            ) -> tuple[list[tuple[str, torch.Tensor, bytes]], list[tuple[int, torch.Tensor]]]:
    """Each tensor's (name, tensor, header) and its byte pieces (index into the headers)."""
    headers: list[tuple[str, torch.Tensor, bytes]] = []
    pieces: list[tuple[int, torch.Tensor]] = []
    for name, t in named:
        headers.append((name, t, f"{name}:{tuple(t.shape)}:{t.dtype}\0".encode()))
        if t.is_meta or t.numel() == 0:
            continue
        b = _bytes_of(t)
        for start in range(0, b.numel(), PIECE_BYTES):
            pieces.append((len(headers) - 1, b[start:start + PIECE_BYTES]))
    return headers, pieces


def _piece_digest(piece: torch.Tensor) -> bytes:
    host = piece if piece.device.type == "cpu" else piece.to("cpu")
    return xxhash.xxh3_128_digest(memoryview(host.numpy()))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


# odd 64-bit constants (xxh64's and splitmix64's primes) for the device hash's two lanes
_K1, _C1 = _signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F)
_K2, _C2 = _signed(0x165667B19E3779F9), _signed(0xD6E8FEB86659FD93)
_M3 = _signed(0xBF58476D1CE4E5B9)


def position_keys(words: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The device hash's odd per-position multipliers for pieces of up to `words` 64-bit words."""
    pos = torch.arange(words, device=device, dtype=torch.int64)
    k1 = pos * _K1
    k1.add_(_C1).bitwise_or_(1)
    k2 = pos.mul_(_K2)
    k2.add_(_C2).bitwise_or_(1)
    return k1, k2


def device_piece_sums(piece: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The device hash of one piece of bytes (uint8, any device), as two
    int64 sums, computed where the bytes are (no copy to the host): the
    piece as 64-bit words w_i (zero-padded), lane 1 the sum of
    mix(w_i * k1_i), lane 2 of mix((w_i ^ k2_i) * M), with k1_i, k2_i odd
    and distinct per position (swapped words count) and mix an invertible
    xor-shift, all in wrapping 64-bit integers. Integer sums are exact, so
    the result is the same on every device, thread count and reduction
    order. A change to one word always changes both lanes (each step is a
    bijection of the word); an accidental change of several words leaves
    both unchanged with odds of about 2^-128. Not a cryptographic hash:
    whoever writes an engine's weights already decides its KV. `keys`:
    position_keys(at least the piece's words) on the piece's device."""
    n = piece.numel()
    if n % 8:
        piece = torch.cat([piece, piece.new_zeros(8 - n % 8)])
    w = piece.view(torch.int64)
    k1, k2 = keys if keys is not None else position_keys(w.numel(), w.device)
    a = w * k1[:w.numel()]
    a.bitwise_xor_(a >> 29)
    b = w ^ k2[:w.numel()]
    b.mul_(_M3)
    b.bitwise_xor_(b >> 32)
    return torch.stack([a.sum(), b.sum(), torch.tensor(n, device=w.device, dtype=torch.int64)])


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]], basis: str, threads: int | None = None,
                   kernel: str = "auto") -> TensorsDigest:
    """A digest of the tensors' names, shapes, dtypes and every byte: each
    PIECE_BYTES piece hashed, each tensor's digest (xxh3-128) of its header
    and piece digests, then the tensors' digests in order. A piece in host
    memory is hashed with xxh3-128 in threads (python-xxhash releases the
    GIL on large buffers); a piece on a device (a GPU's weights) with the
    device hash where it lies (device_piece_sums: no copy, one transfer of
    the sums per call), or every piece so with `kernel="device"` (the
    benchmark's). The same tensors give the same digest whatever the thread
    count."""
    t0 = time.perf_counter()
    headers, pieces = _pieces(named)
    n = threads or min(8, os.cpu_count() or 1)
    on_device = [kernel == "device" or p.device.type != "cpu" for _, p in pieces]
    digests: list[bytes] = [b""] * len(pieces)
    with torch.no_grad():
        host = [i for i, d in enumerate(on_device) if not d]
        if n > 1 and len(host) > 1:
            with ThreadPoolExecutor(n, thread_name_prefix="shmkv-digest") as pool:
                for i, d in zip(host, pool.map(lambda i: _piece_digest(pieces[i][1]), host)):
                    digests[i] = d
        else:
            for i in host:
                digests[i] = _piece_digest(pieces[i][1])
        dev = [i for i, d in enumerate(on_device) if d]
        if dev:
            keys: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
            for i in dev:
                d = pieces[i][1].device
                if d not in keys:
                    keys[d] = position_keys(-(-PIECE_BYTES // 8), d)
            sums = torch.stack([device_piece_sums(pieces[i][1], keys[pieces[i][1].device]) for i in dev]).cpu()
            del keys
            for i, row in zip(dev, sums.tolist()):
                digests[i] = b"dev1" + b"".join(int(x).to_bytes(8, "little", signed=True) for x in row)
    by_tensor: dict[int, list[bytes]] = {}
    for (i, _), d in zip(pieces, digests):
        by_tensor.setdefault(i, []).append(d)
    h = xxhash.xxh3_128()
    per_tensor: dict[str, tuple[str, int, int]] = {}
    for i, (name, t, header) in enumerate(headers):
        th = xxhash.xxh3_128(header)
        for d in by_tensor.get(i, ()):
            th.update(d)
        h.update(th.digest())
        per_tensor[name] = (th.hexdigest(), 0 if t.is_meta else t.data_ptr(), t.numel())
    nbytes = sum(p.numel() for _, p in pieces)
    return TensorsDigest(h.hexdigest(), len(headers), nbytes, time.perf_counter() - t0, basis, per_tensor)


def model_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of the model, by name (shared ones once)."""
    for name, p in model.named_parameters():
        yield name, p
    for name, b in model.named_buffers():
        yield f"buffer.{name}", b


def combine(digests: Iterable[str]) -> str:
    return xxhash.xxh3_128("\0".join(digests).encode()).hexdigest()


# ------------------------------------------------------------ vLLM's hook --
def _connectors(kv_transfer_config: Any) -> Iterable[tuple[str, str, Any]]:
    """(connector name, module path, extra config) of the engine's connector
    and, for a MultiConnector, of each connector inside it."""
    if kv_transfer_config is None:
        return
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    yield (str(getattr(kv_transfer_config, "kv_connector", "") or ""),
           str(getattr(kv_transfer_config, "kv_connector_module_path", "") or ""), extra)
    for sub in extra.get("connectors", ()) if isinstance(extra, dict) else ():
        if isinstance(sub, dict):
            yield (str(sub.get("kv_connector", "") or ""), str(sub.get("kv_connector_module_path", "") or ""),
                   sub.get("kv_connector_extra_config") or {})


def uses_shmkv(kv_transfer_config: Any) -> bool:
    """Whether the engine's connector is shmkv's (alone or inside a MultiConnector)."""
    return any(name == "ShmKVConnector" or module.startswith("shmkv")
               for name, module, _ in _connectors(kv_transfer_config))


def uses_native_tier(kv_transfer_config: Any) -> bool:
    """Whether the engine's connector is vLLM's OffloadingConnector (alone or
    in a MultiConnector) with a shmkv secondary tier (native_identity.py)."""
    return any(name == "OffloadingConnector" and isinstance(extra, dict)
               and any(isinstance(t, dict) and t.get("type") == "shmkv" for t in extra.get("secondary_tiers") or ())
               for name, _, extra in _connectors(kv_transfer_config))


def _uses_native_tier(vllm_config: Any) -> bool:
    return uses_native_tier(vllm_config.kv_transfer_config)


_native_watch: Callable[[torch.nn.Module, Any], None] | None = None  # install_hooks: native_identity.watch_loaded


def after_processing(model: torch.nn.Module) -> None:
    """After vLLM's post-load step: an engine whose weights only the native
    tier watches starts its watch (native_identity.py); never raises."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
        if vc is None or _native_watch is None or uses_shmkv(vc.kv_transfer_config) or not _uses_native_tier(vc):
            return
        _native_watch(model, vc)
    except Exception as e:  # noqa: BLE001 - vLLM's loading goes on
        log.warning("shmkv: the native tier's weights watch failed to start: %s: %s", type(e).__name__, e)


def note_loaded(model: torch.nn.Module) -> None:
    """Digest the model's tensors as loaded (before kernel processing), if
    this engine uses shmkv; never raises."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
        if vc is None or not (uses_shmkv(vc.kv_transfer_config) or _uses_native_tier(vc)):
            return
        d = digest_tensors(model_tensors(model), "loaded")
        object.__setattr__(model, LOADED_ATTR, d)
        log.info("shmkv: weights as loaded: %d tensors, %.2f GB, digest %s (%.2f s, %.1f GB/s)", d.tensors,
                 d.nbytes / 1e9, d.digest[:16], d.seconds, d.nbytes / 1e9 / max(d.seconds, 1e-9))
    except Exception as e:  # noqa: BLE001 - vLLM's loading goes on; the worker falls back (module doc)
        object.__setattr__(model, LOADED_ATTR, None)
        log.warning("shmkv: the digest of the weights as loaded failed (%s: %s): the keys name what the model "
                    "holds at KV-cache registration instead", type(e).__name__, e)


# the engine's calls to its workers known to leave the weights as they are (vLLM 0.32's every-step calls
# first); any other (a method name or a user's function through collective_rpc) may write them
READ_ONLY_CALLS = frozenset({
    "execute_model", "sample_tokens", "take_draft_token_ids", "execute_dummy_batch", "check_health",
    "get_kv_connector_handshake_metadata", "get_kv_cache_spec", "determine_available_memory", "get_supported_tasks",
    "get_supported_kv_cache_layouts", "set_kv_cache_layout", "get_model_inspection", "get_encoder_timing_stats",
    "supports_draft_weight_updates", "synchronize_device", "compute_weight_checksums", "update_max_model_len",
    "list_loras", "add_lora", "remove_lora", "pin_lora", "reset_mm_cache", "reset_encoder_cache", "profile",
    "save_sharded_state", "save_tensorized_model", "init_worker", "init_device", "initialize_from_config",
    "compile_or_warm_up_model", "shutdown",
})


_watchers: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's weights watchers (weights.WorkerWeights)


def watch(watcher: Any) -> None:
    """A weights watcher of this process (one per rank it serves): told
    (`mark_dirty(reason)`) before a worker call that may write the weights."""
    _watchers.add(watcher)


def mark_dirty(reason: str) -> int:
    """Every watcher of this process: its weights may change now. How many were marked."""
    watchers = list(_watchers)
    for w in watchers:
        w.mark_dirty(reason)
    return len(watchers)


def _before_call(method: Any) -> bool:
    """A worker is about to run `method` for the engine: unless it is known
    read-only, its weights watchers go dirty first (weights.py). Whether
    they did (then _after_call runs once the call returned)."""
    if isinstance(method, str) and method in READ_ONLY_CALLS:
        return False
    name = method if isinstance(method, str) else getattr(method, "__name__", "a function (collective_rpc)")
    mark_dirty(f"the engine's call {name!r}")
    return True


def _after_call() -> None:
    """A call that may have written the weights returned (or raised): the
    watchers that settle at once (the native tier's) fingerprint again now."""
    for w in list(_watchers):
        if getattr(w, "settle_after_calls", False) and w.dirty:
            w.publish()


def _around_call(method: Any, call: Callable[[], Any]) -> Any:
    try:
        marked = _before_call(method)
    except Exception as e:  # noqa: BLE001 - never into vLLM's loop
        log.warning("shmkv: marking the weights before a worker call failed: %s", e)
        marked = True
    try:
        return call()
    finally:
        if marked:
            try:
                _after_call()
            except Exception as e:  # noqa: BLE001 - publish() never raises; this is belt and braces
                log.warning("shmkv: fingerprinting the weights after a worker call failed: %s", e)


def _hook_worker_calls() -> None:
    """vLLM's ways a worker runs the engine's calls: the multiprocessing
    executor's worker loop (Ray's executor v2 runs it too) and the in-process
    executor's run_method (each hooked once both modules are importable);
    Ray's worker wrapper: _hook_run_method, once ray_utils is imported."""
    try:
        from vllm.v1.executor import multiproc_executor, uniproc_executor
    except Exception as e:  # noqa: BLE001 - another vLLM: only load_weights is watched
        log.debug("shmkv: vLLM's worker calls could not be hooked: %s", e)
        return
    proc = multiproc_executor.WorkerProc
    original_rpc = getattr(proc, "_execute_worker_rpc", None)
    if original_rpc is not None and not getattr(original_rpc, _HOOKED, False):
        def _execute_worker_rpc(self: Any, rpc_request: Any) -> Any:
            return _around_call(rpc_request[0], lambda: original_rpc(self, rpc_request))

        setattr(_execute_worker_rpc, _HOOKED, True)
        proc._execute_worker_rpc = _execute_worker_rpc
    _hook_run_method(uniproc_executor)


def _hook_run_method(module: Any) -> None:
    """A module's `run_method` (vLLM's in-process executor; Ray's worker
    wrapper, whose execute_method runs the engine's calls with it)."""
    original_run = getattr(module, "run_method", None)
    if original_run is None or getattr(original_run, _HOOKED, False):
        return

    def run_method(obj: Any, method: Any, args: Any, kwargs: Any) -> Any:
        return _around_call(method, lambda: original_run(obj, method, args, kwargs))

    setattr(run_method, _HOOKED, True)
    module.run_method = run_method


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after its first import (the
    plugin then imports nothing of vLLM's loader or executors itself: a
    process that never loads a model, as `vllm serve`'s API server, pays
    nothing)."""

    def __init__(self) -> None:
        self.pending: dict[str, Callable[[Any], None]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        fn = self.pending.get(fullname)
        if fn is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module: Any, _exec: Callable = original_exec, _name: str = fullname) -> None:
                    _exec(module)
                    hook = self.pending.pop(_name, None)
                    if hook is not None:
                        hook(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
            if spec is not None:
                return spec
        return None


_after_import = _AfterImport()


def when_imported(name: str, fn: Callable[[Any], None]) -> None:
    """fn(module) now if `name` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    _after_import.pending[name] = fn
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def install_hooks(native_watch: Callable[[torch.nn.Module, Any], None] | None = None) -> None:
    """vLLM's plugin time (every process): the loader hook and the worker-call
    hook, each installed when vLLM's module is (or once it is) imported;
    `native_watch(model, vllm_config)` runs after vLLM's post-load step in
    an engine of the native tier (the plugin gives native_identity's)."""
    global _native_watch
    if native_watch is not None:
        _native_watch = native_watch
    when_imported("vllm.model_executor.model_loader.utils", lambda _m: install_load_hook())
    when_imported("vllm.v1.executor.multiproc_executor", lambda _m: _hook_worker_calls())
    when_imported("vllm.v1.executor.uniproc_executor", lambda _m: _hook_worker_calls())
    when_imported("vllm.v1.executor.ray_utils", _hook_run_method)  # Ray's workers: execute_method
    when_imported("vllm.lora.worker_manager", install_adapter_hook)  # which LoRA adapter a rank holds


def install_load_hook() -> bool:
    """Wrap vLLM's process_weights_after_loading (utils and every loader
    module that imported it) so that note_loaded runs first. Idempotent."""
    try:
        import vllm.model_executor.model_loader.base_loader  # noqa: F401 - binds the name there first
        import vllm.model_executor.model_loader.utils as utils
    except Exception as e:  # noqa: BLE001 - another vLLM: keys fall back to what the model holds
        log.debug("shmkv: vLLM's loader could not be hooked: %s", e)
        return False
    original: Callable = utils.process_weights_after_loading
    if getattr(original, _HOOKED, False):
        return True

    def process_weights_after_loading(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        note_loaded(model)
        out = original(model, *args, **kwargs)
        after_processing(model)
        return out

    setattr(process_weights_after_loading, _HOOKED, True)
    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "process_weights_after_loading", None) is original:
            module.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]
    return True


def loaded_digest(models: list[torch.nn.Module]) -> TensorsDigest | None:
    """The rank's weights identity at KV-cache registration: per tensor its
    models hold now (the target's first, a drafter's next; a tensor shared
    between them counted once, as the first model's), the digest kept at
    loading while the tensor is the one loaded or was emptied by kernel
    processing (vLLM-CPU's packed linear weights), else a digest of what it
    holds now (a drafter's embedding or head, given the target's after
    loading: at loading it held memory nobody wrote). "held" where a model
    kept no digest at loading (a loader that skipped the hook)."""
    if not models:
        return None
    t0 = time.perf_counter()
    kept = [getattr(m, LOADED_ATTR, None) for m in models]
    basis = "loaded" if all(isinstance(k, TensorsDigest) for k in kept) else "held"
    resolved: dict[int, str] = {}  # id(tensor) -> its digest: a tensor shared by two models is the first's
    lines: list[str] = []
    tensors = nbytes = 0
    load_s = 0.0
    for i, (m, k) in enumerate(zip(models, kept)):
        records = k.per_tensor if isinstance(k, TensorsDigest) else {}
        load_s += k.seconds if isinstance(k, TensorsDigest) else 0.0
        now, redo = dict(model_tensors(m)), []
        for name, t in now.items():
            if id(t) in resolved:
                lines.append(f"{i}.{name}:{resolved[id(t)]}")
                continue
            rec = records.get(name)
            if rec is not None and (t.numel() == 0 or (not t.is_meta and (t.data_ptr(), t.numel()) == rec[1:])):
                resolved[id(t)] = rec[0]
                lines.append(f"{i}.{name}:{rec[0]}")
            else:
                redo.append((name, t))
        for name, rec in records.items():
            if name not in now:  # gone since loading: its loaded bytes shaped what replaced it
                lines.append(f"{i}.{name}:{rec[0]}")
        if redo:
            d = digest_tensors(redo, "held")
            nbytes += d.nbytes
            for name, t in redo:
                resolved[id(t)] = d.per_tensor[name][0]
                lines.append(f"{i}.{name}:{d.per_tensor[name][0]}")
        tensors += len(now)
        nbytes += k.nbytes if isinstance(k, TensorsDigest) else 0
    return TensorsDigest(combine(sorted(lines)), tensors, nbytes, load_s + time.perf_counter() - t0, basis)
