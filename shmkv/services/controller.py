"""The controller API of the shmkv daemon: JSON over HTTP, transport-free here.

    GET  /health       liveness, pid, whether this daemon holds the maintainer role
    GET  /stats        the same snapshot as `python -m shmkv.stats --json`
    GET  /metrics      Prometheus text (shmkv_* per tier, shmkv_controller_*)
    GET  /namespaces   the namespaces engines registered (root hex -> fields)
    POST /lookup       {"tokens": [...], "namespace": N} -> tokens cached per tier
    POST /clear        {} (everything) or {"namespace": N}
    POST /pin          {"tokens", "namespace"} -> chunks never evicted nor spilled until unpinned
    POST /unpin        {"tokens", "namespace"}
    POST /move         {"tokens", "namespace", "to": "shm" | "disk"}
    POST /flush        {} -> returns once every chunk of the shared tier is on disk (fsync'd)
                       and, with a remote tier, written there (or failed, counted)
    POST /compress     {"namespace", optional "tokens"} -> the namespace's chunks in the shared
                       tier (or the cached prefix of `tokens`) re-encoded in place, lossless
                       (zstd of the byte-shuffled payload, checked like a disk chunk); loads
                       decode them exactly
    POST /decompress   the same fields -> compressed chunks put back raw
                       /compress with "form": "fp8" makes the lossy form instead: each exact
                       chunk quantized (float8, a scale per 1,024 values) into the namespace's
                       lossy form, the exact chunk dropped (unless "keep_exact": true)

Every endpoint taking a namespace also takes "lossy_form": "fp8": then it
means that namespace's lossy form (the chunks only engines with the shmkv
setting `lossy_form: fp8` read; shmkv.keys.lossy_key).

A namespace N is either the 32-hex root key of a registered namespace
(`/namespaces`), or an object of Namespace fields (shmkv.keys.Namespace, with
`cache_salt` for a tenant's chunks). With an unregistered root, `chunk_size`
(default: the daemon's) and `block_size` (tail pieces; default none) may be
given. With exactly one namespace registered, the token endpoints may leave
it out.

Invariant: a request is fully validated before anything changes; a bad one
is a RequestError (4xx) naming the field. Pins nest: every pin needs an unpin.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shmkv.chunking import Chunker, Unit
from shmkv.config import ShmkvConfig
from shmkv.errors import ConfigError, LockTimeoutError, RequestError
from shmkv.keys import CHUNK_SIZE_MAX, CHUNK_SIZE_MIN, check_chunk_size, lossy_key
from shmkv.names import SHM, TIERS
from shmkv.namespaces import known, namespace_from_dict
from shmkv.services.maintainer import Maintainer, MaintainerRole
from shmkv.services.stats import render_prometheus, snapshot
from shmkv.store import Store
from shmkv.tiers import TierChain, kv_element_size, open_tiers, recode

log = logging.getLogger("shmkv.controller")

MAX_BODY_BYTES = 16 << 20
MAX_TOKENS = 1 << 20

JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


# ------------------------------------------------------ request models --
# One model per body shape; both transports (shmkv.controller_http and
# Controller.handle) validate with them, and request_error() turns pydantic's
# errors into one 4xx message naming the field.
TokenId = Annotated[int, Field(strict=True, ge=0, lt=1 << 32)]
ChunkSize = Annotated[int, Field(strict=True, ge=CHUNK_SIZE_MIN, le=CHUNK_SIZE_MAX)]  # the core's bounds
Size = Annotated[int, Field(strict=True, ge=1, le=1 << 16)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EmptyArgs(_Body):
    """No fields (POST /flush)."""


class NamespaceArgs(_Body):
    """A namespace: a 32-hex root key or an object of Namespace fields; left
    out when exactly one namespace is registered."""
    namespace: Any = None
    chunk_size: ChunkSize | None = None  # only with a root key that is not registered
    block_size: Size | None = None
    lossy_form: Literal["fp8"] | None = None  # the namespace's lossy form


class TokensArgs(NamespaceArgs):
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS)


class MoveArgs(TokensArgs):
    to: Literal["shm", "disk"]


class RecodeArgs(NamespaceArgs):
    """POST /compress and /decompress: a namespace, and optionally the tokens
    whose cached prefix is meant (else every chunk of the namespace); for
    /compress, the form: "zstd" (lossless, in place) or "fp8" (lossy, into
    the namespace's lossy form)."""
    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    form: Literal["zstd", "fp8"] = "zstd"
    keep_exact: bool = False  # with form fp8: keep the exact chunks too


def request_error(errors: list[Any], model: type[BaseModel]) -> RequestError:
    """The first of pydantic's errors (ValidationError.errors()) as a
    RequestError naming the field."""
    if not errors:
        return RequestError("invalid request body")
    err = errors[0]
    loc = [p for p in err["loc"] if p != "body"]  # FastAPI prefixes "body"
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    kind, value = err["type"], err.get("input")
    if kind == "json_invalid":
        return RequestError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not where:
        if kind == "missing":
            return RequestError(f"request body: required, a JSON object with {sorted(model.model_fields)}")
        return RequestError(f"request body must be a JSON object, got {_json_type(value)}")
    if kind == "extra_forbidden":
        return RequestError(f"unknown field {where!r}; this endpoint takes {sorted(model.model_fields) or 'no fields'}")
    if kind == "missing":
        return RequestError(f"{where}: required")
    if kind == "too_long" and where == "tokens":
        return RequestError(f"tokens: {len(value)} ids exceed the limit of {MAX_TOKENS}", 413)
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return RequestError(f"{where}={shown}: {err['msg']}")


def parse_args(model: type[BaseModel], obj: Any) -> BaseModel:
    try:
        return model.model_validate({} if obj is None else obj)
    except ValidationError as e:
        raise request_error(e.errors(include_url=False), model) from None


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


class _Resolved:
    """A request's namespace, ready to compute keys."""

    def __init__(self, root: bytes, chunk_size: int, block_size: int | None, *, lossy_form: str | None = None,
                 dtype: str | None = None) -> None:
        self.chunker = Chunker([root], chunk_size, block_size, lossy_form)
        self.root = self.chunker.roots[0]  # the tag of its chunks (the lossy root with a lossy form)
        self.dtype = dtype  # of its KV, when the registry or the request says


class Controller:
    def __init__(self, cfg: ShmkvConfig, store: Store, chain: TierChain | None = None,
                 role: MaintainerRole | None = None) -> None:
        """`chain`: this process's tiers (the maintainer role's when there is
        one; None: open_tiers(cfg) builds them)."""
        self.cfg = cfg
        self.store = store
        self.role = role
        if role is not None:
            self.maintainer = role.maintainer
        else:
            self.maintainer = Maintainer(chain if chain is not None else open_tiers(cfg, store),
                                         low_watermark=cfg.low_watermark, spill_ahead=cfg.spill_ahead)
        self.chain = self.maintainer.chain  # the one chain of this process's tiers: every tier is reached through it
        self.started = time.time()
        self.counters = {"requests": 0, "bad_requests": 0, "refused_requests": 0, "errors": 0,
                         "throttled_connections": 0, "write_timeouts": 0}
        self._count_lock = threading.Lock()
        self._mutate = threading.Lock()  # one changing operation at a time
        # path -> (method, request model or None for GET, endpoint)
        self.routes: dict[str, tuple[str, type[BaseModel] | None, Callable[[Any], Any]]] = {
            "/health": ("GET", None, self.health),
            "/stats": ("GET", None, self.stats),
            "/metrics": ("GET", None, self.metrics),
            "/namespaces": ("GET", None, self.namespaces),
            "/lookup": ("POST", TokensArgs, self.lookup),
            "/clear": ("POST", NamespaceArgs, self.clear),
            "/pin": ("POST", TokensArgs, self.pin),
            "/unpin": ("POST", TokensArgs, self.unpin),
            "/move": ("POST", MoveArgs, self.move),
            "/flush": ("POST", EmptyArgs, self.flush),
            "/compress": ("POST", RecodeArgs, self.compress),
            "/decompress": ("POST", RecodeArgs, self.decompress),
        }

    # ----------------------------------------------------------- dispatch --
    def handle(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        """(HTTP status, content type, body) for one raw request (the in-process
        transport; shmkv.controller_http serves the same routes). Never raises."""
        try:
            path = path.split("?", 1)[0].rstrip("/") or "/"
            route = self.routes.get(path)
            if route is None:
                raise RequestError(f"no endpoint {path!r}; endpoints: {', '.join(sorted(self.routes))}", 404)
            want, model, _fn = route
            if method != want:
                raise RequestError(f"{path} takes {want}, not {method}", 405)
            if len(body) > MAX_BODY_BYTES:
                raise RequestError(f"a body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}", 413)
            args = parse_args(model, _parse_body(body)) if model is not None else None
        except RequestError as e:
            return self.refuse(e)
        return self.run(path, args)

    def run(self, path: str, args: BaseModel | None) -> tuple[int, str, bytes]:
        """Answer one validated request. Never raises."""
        want, _model, fn = self.routes[path]
        try:
            if want == "POST":
                self._check_lock()
            result = fn(args)
            status = 200
            if isinstance(result, tuple):  # (status, body): an answer that is not a success
                status, result = result
            ctype, out = (PROMETHEUS, result.encode()) if isinstance(result, str) else (JSON, _json(result))
        except RequestError as e:
            return self.refuse(e)
        except LockTimeoutError as e:
            status, ctype, out = 503, JSON, _json({"error": str(e)})
        except Exception as e:  # a bug or an I/O failure: the daemon stays up
            log.exception("shmkv: controller request %s failed", path)
            status, ctype, out = 500, JSON, _json({"error": f"internal error: {type(e).__name__}: {e}"})
        self.count(status)
        return status, ctype, out

    def refuse(self, e: RequestError) -> tuple[int, str, bytes]:
        """The answer to a request refused before it ran (counted)."""
        self.count(e.status)
        return e.status, JSON, _json({"error": str(e)})

    def count(self, status: int) -> None:
        """Count one answered request (the transport calls it for what it refuses itself)."""
        with self._count_lock:
            self.counters["requests"] += 1
            if status in (401, 403):
                self.counters["refused_requests"] += 1
            elif 400 <= status < 500:
                self.counters["bad_requests"] += 1
            elif status >= 500:
                self.counters["errors"] += 1

    def count_transport(self, what: str) -> None:
        """Count one connection the transport ended itself: `throttled_connections`
        (another uid over its budget) or `write_timeouts` (an answer not read)."""
        with self._count_lock:
            self.counters[what] += 1

    # ---------------------------------------------------------- endpoints --
    def health(self, _args: None) -> dict[str, Any]:
        return {"status": "ok", "cache": self.store.name, "pid": os.getpid(),
                "maintainer": bool(self.role and self.role.lock.held),
                "disk_tier": self.chain.disk.dir if self.chain.disk else None,
                "remote_tier": self.chain.remote.display_url if self.chain.remote else None,
                "uptime_s": round(time.time() - self.started, 3)}

    def stats(self, _args: None = None) -> dict[str, Any]:
        snap = snapshot(self.store, self.cfg.disk_dir or None)
        snap["controller"] = self._controller_counters()
        if self.chain.disk is not None:  # this process's writes: which codec, and why
            snap["disk"]["codec"] = self.chain.disk.codec.describe()
        if self.chain.remote is not None:
            snap["remote"]["codec"] = self.chain.remote.codec.describe()
        return snap

    def metrics(self, _args: None) -> str:
        return render_prometheus(self.stats())

    def namespaces(self, _args: None) -> dict[str, Any]:
        return {"namespaces": [{"root": root, **fields} for root, fields in sorted(known(self.store.name).items())]}

    def lookup(self, args: TokensArgs) -> dict[str, Any]:
        return self._tiers(self._namespace(args), args.tokens)

    def clear(self, args: NamespaceArgs) -> dict[str, Any]:
        root = self._namespace(args).root if args.namespace is not None else None
        with self._mutate:
            removed = {**dict.fromkeys(TIERS, 0), **self.chain.clear(root)}
        log.info("shmkv: controller cleared %s: %d chunks in memory, %d on disk, %d in the remote",
                 f"namespace {root.hex()}" if root else "everything", removed["shm"], removed["disk"],
                 removed["remote"])
        return {"removed": removed}

    def pin(self, args: TokensArgs) -> dict[str, Any]:
        tokens, ns = args.tokens, self._namespace(args)
        with self._mutate:
            self._promote(ns, tokens)  # a pinned chunk lives in the shared tier
            units = self._units(ns, tokens)
            pinned = []
            for u in units:
                if not self.store.pin(u.keys[0]):
                    break  # evicted between lookup and pin: the pinned prefix ends here
                pinned.append(u)
        return {"pinned_chunks": len(pinned), "pinned_tokens": pinned[-1].end if pinned else 0}

    def unpin(self, args: TokensArgs) -> dict[str, Any]:
        tokens, ns = args.tokens, self._namespace(args)
        with self._mutate:
            units = self._units(ns, tokens)
            n = sum(self.store.unpin(u.keys[0]) for u in units)
        return {"unpinned_chunks": n}

    def move(self, args: MoveArgs) -> dict[str, Any]:
        tokens, ns, to = args.tokens, self._namespace(args), args.to
        if to == "disk":
            self._need_disk("move to disk")
        with self._mutate:
            if to == "shm":
                moved = self._promote(ns, tokens)
                kept = 0
            else:
                moved = kept = 0
                for u in self._units(ns, tokens):
                    key = u.keys[0]
                    self.maintainer.spill(key, ns.root)
                    if self.store.evict_spilled(key):
                        moved += 1
                    else:
                        kept += 1  # pinned, leased right now, or not on disk (spill failed)
        out = self._tiers(ns, tokens)
        out.update({"moved_chunks": moved, "kept_chunks": kept})
        return out

    def flush(self, _args: EmptyArgs) -> dict[str, Any]:
        self._need_disk("flush")
        assert self.chain.disk is not None
        with self._mutate:
            spilled, left = self.maintainer.spill_all()
            # spilled chunks are queued for the remote tier too: the flush waits for its writer
            flushed = self.chain.flush(timeout_s=60)
            synced, remote = flushed.get("synced_files", 0), flushed.get("remote_flushed")
        remote_note = "" if remote is None else f", remote writes {'done' if remote else 'still pending after 60 s'}"
        log.info("shmkv: controller flush: %d chunks spilled, %d not on disk, %d files synced%s", spilled, left,
                 synced, remote_note)
        out: dict[str, Any] = {"spilled_chunks": spilled, "synced_files": synced}
        if remote is not None:
            out["remote_flushed"] = remote
        if left:
            err = self.chain.disk.last_write_error
            out["not_on_disk"] = left
            out["error"] = (f"{left} chunks of the shared tier are not on disk"
                            + (f" (last write error: {err})" if err else ""))
            return 507 if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) else 503, out
        return out

    def compress(self, args: RecodeArgs) -> dict[str, Any]:
        return self._recode(args, compress=True)

    def decompress(self, args: RecodeArgs) -> dict[str, Any]:
        return self._recode(args, compress=False)

    def _recode(self, args: RecodeArgs, *, compress: bool) -> dict[str, Any]:
        if not compress and (args.form != "zstd" or args.keep_exact):
            raise RequestError("form and keep_exact are for /compress; /decompress puts compressed chunks back raw")
        if compress and args.form != "zstd":
            return self._make_lossy(args)
        ns = self._namespace(args)
        element_size = kv_element_size(self.cfg, _element_size(known(self.store.name).get(ns.root.hex())))
        with self._mutate:
            entries = self._ready_entries(ns, args.tokens)
            verb = "compressed" if compress else "decompressed"
            outcomes: dict[str, int] = {}
            recoded: dict[bytes, int] = {}  # key -> its size before
            for e in entries:
                if compress:
                    got = recode.compress(self.store, e, element_size=element_size, level=self.cfg.disk_level)
                else:
                    got = recode.decompress(self.store, e)
                outcomes[got] = outcomes.get(got, 0) + 1
                if got == verb:
                    recoded[e["key"]] = e["size"]
            before = sum(recoded.values())
            after = sum(e["size"] for e in self.store.entries() if e["key"] in recoded and e["state"] == "ready")
        n = outcomes.pop(verb, 0)
        log.info("shmkv: controller %s %d chunks of namespace %s (%d -> %d bytes; left as they were: %s)", verb, n,
                 ns.root.hex(), before, after, outcomes or "none")
        return {"namespace": ns.root.hex(), f"{verb}_chunks": n, "bytes_before": before, "bytes_after": after,
                "skipped": outcomes}

    def _make_lossy(self, args: RecodeArgs) -> dict[str, Any]:
        """/compress with a lossy form: the namespace's exact chunks (or the
        cached prefix of `tokens`) quantized into its lossy form."""
        if args.lossy_form is not None:
            raise RequestError(f"form={args.form!r} makes the lossy form of exact chunks; leave lossy_form out")
        ns = self._namespace(args)
        dtype = str(ns.dtype or "").replace("torch.", "")
        from shmkv.tiers.format import FP8_SOURCES

        if dtype not in FP8_SOURCES:
            raise RequestError(f"form={args.form!r}: the namespace's KV dtype is {dtype or 'unknown'}; the fp8 "
                               f"form is made of {sorted(FP8_SOURCES)} (give the namespace as an object of its "
                               "fields, or a registered root)", 409)
        lossy_root = lossy_key(ns.root, args.form)
        with self._mutate:
            entries = self._ready_entries(ns, args.tokens)
            outcomes: dict[str, int] = {}
            errors: list[float] = []
            made: set[bytes] = set()
            before = 0
            for e in entries:
                got, err = recode.make_lossy(self.store, e, args.form, dtype, keep_exact=args.keep_exact)
                outcomes[got] = outcomes.get(got, 0) + 1
                if got == "made":
                    errors.append(err)
                    made.add(lossy_key(e["key"], args.form))
                    before += e["size"]
            after = sum(e["size"] for e in self.store.entries() if e["key"] in made and e["state"] == "ready")
        n = outcomes.pop("made", 0)
        worst = max(errors, default=0.0)
        log.info("shmkv: controller made the %s form of %d chunks of namespace %s into %s (%d bytes; relative RMS "
                 "error up to %.4f; exact chunks %s; left as they were: %s)", args.form, n, ns.root.hex(),
                 lossy_root.hex(), before, worst, "kept" if args.keep_exact else "dropped", outcomes or "none")
        return {"namespace": ns.root.hex(), "lossy_namespace": lossy_root.hex(), "form": args.form,
                "compressed_chunks": n, "bytes_before": before, "bytes_after": after,
                "relative_rms_error_max": worst,
                "relative_rms_error_mean": sum(errors) / len(errors) if errors else 0.0,
                "exact_kept": args.keep_exact, "skipped": outcomes}

    # ---------------------------------------------------------- internals --
    def _controller_counters(self) -> dict[str, Any]:
        with self._count_lock:
            out: dict[str, Any] = dict(self.counters)
        out["uptime_seconds"] = round(time.time() - self.started, 3)
        return out

    def _check_lock(self) -> None:
        """503 naming the holder when the table lock is stuck (a stopped
        process): the operation would only answer "miss" or time out."""
        if self.store.lock_available():
            return
        pid, held = self.store.lock_holder()
        raise RequestError(f"the segment's table lock is held by pid {pid} for {held:.1f} s (over the bound "
                           f"of {self.store.stats()['lock_timeout_ms']} ms); is that process stopped? "
                           "Try again later", 503)

    def _need_disk(self, what: str) -> None:
        if self.chain.disk is None:
            raise RequestError(f"{what} needs the disk tier; start the daemon with --disk-dir DIR", 409)

    def _namespace(self, args: NamespaceArgs) -> _Resolved:
        value = args.namespace
        if value is None:
            registered = known(self.store.name)
            if len(registered) != 1:
                raise RequestError(f"namespace: required ({len(registered)} namespaces are registered; give a root "
                                   "hex from /namespaces, or an object of fields)")
            value = next(iter(registered))  # the only one: it may be left out
        chunk_size, block_size = args.chunk_size, args.block_size
        if isinstance(value, str):
            try:
                root = bytes.fromhex(value)
            except ValueError:
                root = b""
            if len(root) != 16:
                raise RequestError(f"namespace={value!r}: expected 32 hex digits (a root key) or an object")
            fields = known(self.store.name).get(root.hex())
            dtype = None
            if fields is not None:
                chunk_size = fields.get("chunk_size") if chunk_size is None else chunk_size
                block_size = (fields.get("block_size") or None) if block_size is None else block_size
                dtype = fields.get("dtype")
            chunk_size = self.cfg.chunk_size if chunk_size is None else chunk_size
        elif isinstance(value, dict):
            if chunk_size is not None or block_size is not None:
                raise RequestError("chunk_size and block_size come from the namespace object; do not give them")
            try:
                nso = namespace_from_dict(value)
            except (ConfigError, TypeError) as e:
                raise RequestError(str(e)) from e
            root, chunk_size, block_size, dtype = nso.root_key(), nso.chunk_size, nso.block_size or None, nso.dtype
        else:
            raise RequestError(f"namespace: expected a 32-hex string or an object, got {type(value).__name__}")
        # the config's own bounds, wherever chunk_size came from (a namespace object, the registry): a
        # 1-token chunk would make a request hash and look up one key per token
        try:
            chunk_size = check_chunk_size(chunk_size)  # the one rule (shmkv.keys)
        except ConfigError as e:
            raise RequestError(str(e)) from None
        if block_size is not None:
            block_size = _int_in("block_size", block_size, 1, chunk_size)
            if chunk_size % block_size:
                raise RequestError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
        return _Resolved(root, chunk_size, block_size, lossy_form=args.lossy_form, dtype=dtype)

    def _ready_entries(self, ns: _Resolved, tokens: list[int] | None) -> list[dict[str, Any]]:
        """The namespace's readable entries in the shared tier (with `tokens`:
        those of the cached prefix of these tokens only)."""
        entries = [e for e in self.store.entries() if e["state"] == "ready" and e["namespace"] == ns.root]
        if tokens is not None:
            wanted = {u.keys[0] for u in self._units(ns, tokens)}
            entries = [e for e in entries if e["key"] in wanted]
        return entries

    def _cached(self, ns: _Resolved, tokens: list[int], *, lower: bool) -> list[tuple[Unit, str]]:
        """The cached prefix as (unit, tier); below the shared tier only with `lower`."""
        return ns.chunker.cached_prefix(self.chain, tokens, ns.chunker.units(tokens), lower=lower)

    def _units(self, ns: _Resolved, tokens: list[int]) -> list[Unit]:
        """The units of the prefix cached in the shared tier."""
        return [u for u, _ in self._cached(ns, tokens, lower=False)]

    def _tiers(self, ns: _Resolved, tokens: list[int]) -> dict[str, Any]:
        cached = self._cached(ns, tokens, lower=True)
        chunks = [{"start": u.start, "end": u.end, "tier": tier} for u, tier in cached]
        per_tier = dict.fromkeys(TIERS, 0)
        for c in chunks:
            per_tier[c["tier"]] += c["end"] - c["start"]
        return {"namespace": ns.root.hex(), "tokens": len(tokens), "cached_tokens": cached[-1][0].end if cached else 0,
                "tiers": per_tier, "chunks": chunks}

    def _promote(self, ns: _Resolved, tokens: list[int]) -> int:
        """Bring the disk / remote part of the cached prefix into the shared tier."""
        below = [u for u, tier in self._cached(ns, tokens, lower=True) if tier != SHM]
        if not below:
            return 0
        return self.chain.promote([u.keys[0] for u in below], [ns.root] * len(below),
                                  tokens=[u.tokens for u in below])


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def _parse_body(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    except RecursionError:
        raise RequestError("request body is JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise RequestError(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _int_in(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"{name}={value!r}: expected an integer in [{lo}, {hi}]")
    return value


def _element_size(fields: dict[str, Any] | None) -> int:
    """Bytes per element of a registered namespace's dtype (the byte-plane
    shuffle's unit); 2 when unknown."""
    dtype = str((fields or {}).get("dtype", ""))
    if "float32" in dtype or dtype in ("fp32", "float"):
        return 4
    if "fp8" in dtype or "float8" in dtype or "int8" in dtype:
        return 1
    return 2

