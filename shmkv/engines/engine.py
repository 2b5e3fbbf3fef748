"""Separate vLLM engine processes for the demo, the TTFT benchmark and the
end-to-end tests.

Each EngineProcess runs `python -m shmkv.engines.engine SPEC_JSON` in its own
process group (vLLM's EngineCore and worker processes can outlive their
parent; ending the group ends them all). It answers JSON lines prefixed with
"SHMKV-JSON " on stdout; vLLM's own logging goes to a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shmkv.engines.owned_files import OwnedFiles
from shmkv.engines.process_groups import end_group, signal_group, wait_exited

PREFIX = "SHMKV-JSON "
# vLLM-CPU's TP=2 on a 2-core host: one OpenMP thread per rank, each on a core of its own, none reserved
TP2_ON_TWO_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass
class EngineSpec:
    model_dir: str
    shmkv: dict[str, Any] | None = None  # kv_connector_extra_config; None = no connector
    kv_role: str = "kv_both"
    module_path: str | None = "shmkv.integration.vllm"  # None: the connector by name (the vLLM plugin)
    prefix_caching: bool = False
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None  # small values force chunked prefill
    llm_kwargs: dict[str, Any] = field(default_factory=dict)  # anything else for LLM(...)
    env: dict[str, str] = field(default_factory=dict)
    # EngineCore (the scheduler, and with one TP rank the worker too) in the engine's own
    # process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a start costs one Python with vLLM
    # imported instead of three. False: vLLM's default process split, as users run it.
    in_process: bool = False
    # the processes vLLM starts with multiprocessing's "spawn" (vLLM-CPU's EngineCore and workers) forked from
    # the engine's process instead, as vLLM starts them on a GPU host (its default there): none imports vLLM
    # again; and with a launcher (the suite's fork server) the engine's own process is forked too
    fork_children: bool = False
    # in a PID namespace of its own, as a container runs it (unshare --pid --fork --mount-proc: root),
    # and with private_shm a /dev/shm of its own (container_argv)
    pid_namespace: bool = False
    private_shm: bool = False
    binds: list[list[str]] = field(default_factory=list)  # [host path, container path] volumes (container_argv)
    engine_id: str | None = None  # kv_transfer_config's engine_id (None: vLLM's random one)


def container_argv(pid_namespace: bool, private_shm: bool = False, binds: Sequence[Sequence[str]] = (),
                   read_only_root: bool = False) -> list[str]:
    """The command prefix that runs a command as a container would (root:
    unshare): a PID namespace, a mount namespace and /proc of its own, dying
    with the unshare process; with `private_shm`, a /dev/shm of its own too (a
    container without --ipc=host: only what SHMKV_SEGMENT_DIR names is
    shared); `binds`: (host path, container path) volumes bind-mounted in it
    (the container path must exist); `read_only_root`: the rest of the file
    system read-only (Kubernetes' readOnlyRootFilesystem, Compose's read_only)."""
    if not pid_namespace:
        if private_shm or binds or read_only_root:
            raise ValueError("private_shm, binds and read_only_root need pid_namespace (a container)")
        return []
    ns = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    steps = ["mount -t tmpfs -o size=2g,mode=1777 container-shm /dev/shm"] if private_shm else []
    steps += [f"mount --bind {shlex.quote(host)} {shlex.quote(inside)}" for host, inside in binds]
    if read_only_root:  # after the binds: a bind of a read-only mount's subtree would be read-only too
        steps.append("mount -o remount,bind,ro /")  # this namespace's view only; the volumes stay writable
    if not steps:
        return ns
    return [*ns, "sh", "-c", " && ".join(steps) + ' && exec "$@"', "sh"]


def start_daemon(cache: str, *args: str, pid_namespace: bool = False) -> tuple[subprocess.Popen, str]:
    """`python -m shmkv.daemon` for a benchmark's segment (controller on a
    loopback port of its own, warnings only), once it serves: (process, URL)."""
    proc = subprocess.Popen([*container_argv(pid_namespace), sys.executable, "-m", "shmkv.daemon", "--cache", cache,
                             "--listen", "127.0.0.1:0", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "shmkv daemon ready" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the daemon for '{cache}' did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[-1].strip()


def signal_container(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to what runs in a container_argv container: unshare's child
    (unshare ignores SIGTERM and SIGINT while it waits for that child). A
    process not yet started there, or gone, is left alone."""
    pid = proc.pid
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pid = int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _exit_status(proc: Any) -> str:
    """How a child that closed its output ended, in words: its exit code, or
    the signal that killed it (SIGKILL with no message is most often the OOM killer)."""
    try:
        code = proc.wait(timeout=10)
    except Exception:  # noqa: BLE001 - still running, or not ours to wait for
        return "still running after closing its output"
    if code is None or code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
    hint = " (no message: most often the kernel's OOM killer; see dmesg)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


class EngineProcess:
    def __init__(self, spec: EngineSpec, log_path: str, *, start_timeout: float = 300,
                 launch: Callable[[str, dict[str, str], int], Any] | None = None):
        """`launch(spec_json, env, log_fd)`: starts an in_process engine some
        other way than a new Python (the test suite forks it from a server
        that imported vLLM once) and returns a Popen-like handle (pid, stdin,
        stdout, poll, wait; see process_groups for signalling its group)."""
        self.spec = spec
        env = dict(os.environ)
        if "kv_cache_memory_bytes" in spec.llm_kwargs:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM-CPU's legacy variable would override it
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM's own log into the log file, not stdout
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code leaves its Python stack in the log
        env.update(spec.env)
        if spec.in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # NOTE: the compute threads vLLM's CPU worker process gets (cores less the reserved
            # ones): another count reduces in another order, and a batch's outputs then differ
            reserved = int(env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - reserved)))
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # what vLLM's processes of this engine leave behind is removed by ownership (owned_files)
        self.owned_files = OwnedFiles("engine")
        env["TMPDIR"] = self.owned_files.tmpdir
        # a launcher forks in-process engines (in a container of its own with pid_namespace: forks.py),
        # and split ones whose children it forks too
        forked = launch is not None and (spec.in_process or (spec.fork_children and not spec.pid_namespace))
        try:
            if forked:
                self.proc: Any = launch(json.dumps(asdict(spec)), env, self._log.fileno())
            else:
                ns = container_argv(spec.pid_namespace, spec.private_shm, spec.binds)
                self.proc = subprocess.Popen(
                    [*ns, sys.executable, "-m", "shmkv.engines.engine", json.dumps(asdict(spec))],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                    start_new_session=True,
                )
        except BaseException:
            self._log.close()
            self.owned_files.remove()  # nothing started: its directory goes
            raise
        self.owned_files.watch(self.proc.pid)  # its process group (started as a session of its own)
        self._pending = b""  # stdout bytes read past the last whole line
        self.pid = self.proc.pid
        t0 = time.monotonic()
        try:
            ready = self._read(start_timeout)
            if not ready.get("ready"):
                raise RuntimeError(f"engine failed to start: {ready}; see {log_path}")
        except BaseException:
            # NOTE: no caller holds it to close: its processes and files (vLLM's, by ownership) go now
            self.kill()
            raise
        # what vLLM chose for this host (ask it, never assume the CPU's backend); the backends of the
        # layers are known with EngineCore in the engine's process (spec.in_process), else []
        self.block_size: int = ready["block_size"]
        self.attention_backends: list[str] = ready["attention_backends"]
        self.start_s = time.monotonic() - t0  # spawn to ready: what a caller waits for
        tp = spec.llm_kwargs.get("tensor_parallel_size", 1)
        kind = ("in-process" if spec.in_process else f"split-tp{tp}") + ("-forked" if forked else "")
        kind += ("-ns" if spec.pid_namespace else "") + ("-fork-children" if spec.fork_children else "")
        note_start(os.path.basename(log_path), self.start_s, kind)

    def _read(self, timeout: float) -> dict[str, Any]:
        """The engine's next answer; TimeoutError when none comes within
        `timeout` s, even if the engine stays silent (a stalled engine)."""
        import select

        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._pending:
                raw, self._pending = self._pending.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(PREFIX):
                    return json.loads(line[len(PREFIX):])
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"engine did not answer within {timeout}s; see {self.log_path}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"engine exited ({_exit_status(self.proc)}); log tail:\n{self._log_tail(3000)}")
            self._pending += chunk

    def call(self, timeout: float = 600, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        try:
            reply = self._read(timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.stacks()}") from None
        if "error" in reply:
            # NOTE: vLLM's "RPC call to execute_model timed out" is a worker that did not answer
            # (a hang, or a rank stuck in a collective): where each process was is the diagnosis
            stacks = f"\n{self.stacks()}" if "timed out" in str(reply["error"]) else ""
            raise RuntimeError(f"engine error: {reply['error']}{stacks}")
        return reply

    def stacks(self) -> str:
        """Where each process of the engine is now (py-spy, Python and native
        frames) and the tail of its log: what a test prints when an engine
        stops answering, so a hang on a CI machine names its place."""
        from shmkv.engines.owned_files import group_pids

        out = []
        pyspy = shutil.which("py-spy")
        try:
            pids = group_pids(os.getpgid(self.proc.pid))
        except OSError:
            pids = []
        if not pyspy:
            out.append("(py-spy is not installed: no stacks)")
            pids = []
        for pid in pids:
            try:
                dump = subprocess.run([pyspy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=60)
                out.append(f"--- py-spy dump of pid {pid}:\n{dump.stdout or dump.stderr}")
            except (OSError, subprocess.TimeoutExpired) as e:
                out.append(f"--- py-spy dump of pid {pid} failed: {e}")
        out.append(f"--- engine log tail ({self.log_path}):\n{self._log_tail(4000)}")
        return "\n".join(out)

    def _log_tail(self, chars: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"(unreadable: {e})"

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, salts: list[str | None] | None = None,
                 loras: list[tuple | None] | None = None, logprobs: int = 0) -> dict[str, Any]:
        """Greedy outputs, num_cached_tokens and the wall time of one batch;
        `loras`: per prompt (name, int id, path[, load_inplace]) of a LoRA adapter, or None
        (the engine needs llm_kwargs enable_lora=True); `logprobs` > 0: also
        "logprobs", per prompt and output position {token id: logprob} of
        the top `logprobs` tokens (and the one chosen)."""
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens, salts=salts, loras=loras,
                         logprobs=logprobs)

    def generate_embeds(self, specs: list[dict[str, int]], max_tokens: int = 16) -> dict[str, Any]:
        """Like generate, with prompts given as embeddings made in the engine:
        each spec {"seed", "n", "hidden"} is N(0, 0.02) bf16 rows, and an
        optional {"change_from", "change_seed"} redraws rows from that index
        (the engine needs llm_kwargs enable_prompt_embeds=True)."""
        return self.call(cmd="generate", embeds=specs, prompts=[[] for _ in specs], max_tokens=max_tokens,
                         salts=None)

    def ttft(self, prompt: list[int]) -> dict[str, Any]:
        """Time to first token of one prompt (max_tokens=1)."""
        return self.call(cmd="generate", prompts=[prompt], max_tokens=1, salts=None)

    def abort_after_tokens(self, prompt: list[int], tokens: int) -> dict[str, Any]:
        """Start one request, step the engine until it has computed `tokens`
        of its prompt (its own or loaded), then abort it (EngineCore in the
        engine's process: in_process=True)."""
        return self.call(cmd="abort_after_tokens", prompt=prompt, tokens=tokens)

    def metrics(self) -> dict[str, float]:
        """vLLM's counters and gauges (e.g. vllm:num_preemptions), summed over
        their labels, and per extra label set ("name{source=host}"); a
        histogram as its count ("name_count")."""
        return self.call(cmd="metrics")["metrics"]

    def reset_prefix_cache(self, connector: bool = False) -> bool:
        """Empty vLLM's own prefix cache; with `connector`, reset shmkv's connector too (it removes nothing)."""
        return self.call(cmd="reset_prefix_cache", connector=connector)["reset"]

    def pause_and_resume(self) -> dict[str, Any]:
        """What sleep(level >= 1) does to the connector: EngineCore's
        pause_scheduler(clear_cache=True) (its caches reset, the connector's
        too), then resume (EngineCore in this process only)."""
        return self.call(cmd="pause_and_resume")

    def negate_weight(self, name: str, through_loader: bool, reset: bool = True) -> dict[str, Any]:
        """Negate one parameter in memory on every worker (a collective_rpc):
        through the model's load_weights (how vLLM's reload_weights,
        weight-transfer engines and RLHF loaders update weights), or in place
        (then vLLM's default reset_prefix_cache(), unless `reset` is False)."""
        return self.call(cmd="negate_weight", name=name, through_loader=through_loader, reset=reset)

    def close(self, shutdown_timeout: float = 30.0) -> None:
        """Shut the engine down, giving EngineCore `shutdown_timeout` s for
        its teardown before vLLM kills it (vLLM's own default for LLM is 5 s;
        `vllm serve` gives --shutdown-timeout, default 0: killed at once)."""
        self.owned_files.sample()
        if not wait_exited(self.proc, 0):
            try:
                self.call(cmd="quit", shutdown_timeout=shutdown_timeout, timeout=shutdown_timeout + 60)
            except Exception:
                pass
        end_group(self.proc, timeout=60, first=None)  # then EngineCore/workers left behind are killed
        self._log.close()
        self.owned_files.remove()
        sweep_weights_boards()

    def kill(self) -> None:
        """End the engine as `vllm serve` does by default: no teardown (SIGKILL to every process of it)."""
        self.owned_files.sample()
        signal_group(self.proc, signal.SIGKILL)
        self.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sweep_weights_boards() -> None:
    """The weights bells and boards (runtime directory) of engines that
    ended without their teardown, killed or killed at shutdown, removed by
    shmkv's own sweep (which every engine's start runs too): only those no
    live process holds."""
    try:
        from shmkv.integration.vllm.weights_boards import sweep_stale

        sweep_stale("")
    except (ImportError, OSError):
        pass


def spawn_as_fork() -> None:
    """multiprocessing's "spawn" context handed out as "fork" in this process
    (and, inherited, in its forked children): vLLM-CPU sets spawn in its
    platform hook, and asks multiprocessing.get_context for it by name."""
    import multiprocessing

    asked = multiprocessing.get_context

    def get_context(method: str | None = None) -> Any:
        if method == "spawn" and not _cuda_initialized():  # vLLM's own reason to spawn is kept
            method = "fork"
        return asked(method)

    multiprocessing.get_context = get_context  # type: ignore[assignment]


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def note_start(label: str, seconds: float, kind: str = "") -> None:
    """Append "LABEL KIND TEST SECONDS" to the file PYTEST_ENGINE_START_LOG
    names, if any (the test suite's summary of time spent starting engines,
    by kind of start: forked, spawned, vLLM's process split, a server)."""
    path = os.environ.get("PYTEST_ENGINE_START_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{label} {kind or '-'} {test} {seconds:.2f}\n")


def _abort_after_tokens(llm: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Start one request, step the engine until vLLM's scheduler counts
    `tokens` of it computed (part of its prefill when chunked prefill is
    small; a step that only loads counts once the load landed), then abort it."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # EngineCore in this process (in_process=True)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.add_request("abort-me", {"prompt_token_ids": prompt}, sp)
    finished, computed = False, 0
    while not finished and computed < tokens:
        finished |= any(o.finished for o in engine.step())
        # NOTE: vLLM's front end gives the request id a suffix of its own
        req = next((r for rid, r in scheduler.requests.items() if rid.startswith("abort-me")), None)
        computed = req.num_computed_tokens if req is not None else computed
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        engine.step()
    _settle(llm)
    return {"aborted": not finished}


def _negate_weight(worker: Any, name: str, through_loader: bool) -> bool:
    """collective_rpc: negate parameter `name` of the worker's model."""
    import torch

    model = worker.model_runner.get_model()
    param = dict(model.named_parameters())[name]
    with torch.no_grad():
        if through_loader:
            model.load_weights([(name, param.detach().clone().neg())])
        else:
            param.neg_()
    return True


def _pause_and_resume(llm: Any) -> dict[str, Any]:
    """EngineCore's pause_scheduler(clear_cache=True), the first half of sleep(level >= 1), then resume."""
    core = llm.llm_engine.engine_core.engine_core  # EngineCore in this process
    paused = core.pause_scheduler(mode="abort", clear_cache=True)
    if paused is not None:
        paused.result(timeout=60)
    core.resume_scheduler()
    return {"paused": True}


def _attention_backends(worker: Any) -> list[str]:
    """The attention backends vLLM chose for this worker's layers (a collective_rpc function)."""
    layers = worker.vllm_config.compilation_config.static_forward_context.values()
    return sorted({m.get_attn_backend().get_name() for m in layers if hasattr(m, "get_attn_backend")})


def _negate_weight_everywhere(llm: Any, name: str, through_loader: bool, reset: bool = True) -> dict[str, Any]:
    done = llm.collective_rpc(_negate_weight, args=(name, through_loader))
    if not through_loader and reset:
        llm.reset_prefix_cache()  # vLLM's default: its own prefix cache only
    return {"negated": all(done)}


def _engine_core_here(llm: Any) -> Any:
    """vLLM's EngineCore when it runs in this process (in_process), else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def _settle(llm: Any, timeout_s: float = 120.0) -> None:
    """With EngineCore in this process nothing steps the engine between
    commands, while vLLM's engine process keeps stepping until every delayed
    free is done (its scheduler's has_requests() counts requests held for the
    connector). Do the same here, so that an idle engine is the same state in
    both: stores landed, blocks given back (reset_prefix_cache needs them)."""
    inproc = _engine_core_here(llm)
    if inproc is None:  # vLLM's process split: its own busy loop settles it
        return
    deadline = time.monotonic() + timeout_s
    while inproc.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still holds requests for the connector after {timeout_s:.0f} s")
        llm.llm_engine.step()
        time.sleep(0.001)  # a poll interval: the stores' copy threads need the cores


def _make_embeds(spec: dict[str, int]) -> Any:
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    e = torch.randn(spec["n"], spec["hidden"], generator=g) * 0.02
    if "change_from" in spec:
        g2 = torch.Generator().manual_seed(spec["change_seed"])
        e[spec["change_from"]:] = torch.randn(spec["n"] - spec["change_from"], spec["hidden"], generator=g2) * 0.02
    return e.to(torch.bfloat16)


@contextlib.contextmanager
def _no_garbage_collections() -> Iterator[None]:
    """vLLM's shutdown collects the whole heap twice to give memory back (the
    profiling KV cache's cleanup, then the distributed environment's): over a
    second of a 2-core machine per engine, for a process about to end. Its
    every other step (the connectors' shutdown, the process groups
    destroyed) runs; only gc.collect() returns at once meanwhile."""
    import gc

    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = collect


def serve_engine(spec: EngineSpec) -> None:
    import logging

    from vllm import LLM, SamplingParams

    if spec.fork_children:
        spawn_as_fork()

    kwargs: dict[str, Any] = dict(
        model=spec.model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=spec.max_model_len, enable_prefix_caching=spec.prefix_caching, seed=0,
    )
    if spec.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    kwargs.update(spec.llm_kwargs)
    if isinstance(kwargs.get("kv_events_config"), dict):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if spec.shmkv is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ShmKVConnector", kv_connector_module_path=spec.module_path,
            kv_role=spec.kv_role, kv_connector_extra_config=spec.shmkv,
            **({"engine_id": spec.engine_id} if spec.engine_id else {}),
        )
    llm = LLM(**kwargs)
    logging.getLogger("vllm").setLevel(logging.WARNING)

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
        sys.stdout.flush()

    one_call = {  # commands that run one function and say what it returns
        "abort_after_tokens": lambda c: _abort_after_tokens(llm, c["prompt"], c["tokens"]),
        "pause_and_resume": lambda c: _pause_and_resume(llm),
        "negate_weight": lambda c: _negate_weight_everywhere(llm, c["name"], bool(c["through_loader"]),
                                                             bool(c.get("reset", True))),
    }
    # NOTE: a function reaches the workers only from an EngineCore in this process (vLLM's process
    # split serialises calls with msgpack, which sends no function): [] there
    in_process = _engine_core_here(llm) is not None
    backends = sorted(set().union(*llm.collective_rpc(_attention_backends))) if in_process else []
    say({"ready": True, "pid": os.getpid(), "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
         "attention_backends": backends})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            # As `vllm serve --shutdown-timeout N` does: EngineCore gets N s to run its
            # teardown (the connectors' shutdown) before it is killed. LLM's own exit
            # path gives it 5 s, which the CPU worker's exit alone can use up.
            with _no_garbage_collections():
                llm.llm_engine.engine_core.shutdown(timeout=float(cmd.get("shutdown_timeout", 5.0)))
            say({"bye": True})
            return
        if cmd["cmd"] == "reset_prefix_cache":
            say({"reset": bool(llm.reset_prefix_cache(reset_connector=bool(cmd.get("connector"))))})
            continue
        if cmd["cmd"] == "metrics":  # needs llm_kwargs={"disable_log_stats": False}
            try:
                vals: dict[str, float] = {}
                for m in llm.get_metrics():
                    v = getattr(m, "value", None)
                    if v is None and hasattr(m, "count"):  # a histogram: its count of observations
                        name, v = m.name + "_count", m.count
                    else:
                        name = m.name
                    if isinstance(v, (int, float)):
                        vals[name] = vals.get(name, 0) + v  # summed over every label set
                        extra = {k: x for k, x in m.labels.items() if k not in ("model_name", "engine")}
                        if extra:  # and per label set beyond vLLM's own, e.g. name{source=host}
                            key = name + "{" + ",".join(f"{k}={x}" for k, x in sorted(extra.items())) + "}"
                            vals[key] = vals.get(key, 0) + v
                say({"metrics": vals})
            except Exception as e:
                say({"error": f"{type(e).__name__}: {e}"})
            continue
        if cmd["cmd"] in one_call:
            try:
                say(one_call[cmd["cmd"]](cmd))
            except Exception as e:
                say({"error": f"{type(e).__name__}: {e}"})
            continue
        try:
            salts = cmd.get("salts") or [None] * len(cmd["prompts"])
            prompts = []
            for i, (toks, salt) in enumerate(zip(cmd["prompts"], salts)):
                p: dict[str, Any] = ({"prompt_embeds": _make_embeds(cmd["embeds"][i])} if cmd.get("embeds")
                                     else {"prompt_token_ids": toks})
                if salt is not None:
                    p["cache_salt"] = salt
                prompts.append(p)
            sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                logprobs=cmd.get("logprobs") or None)
            loras = None
            if cmd.get("loras"):
                from vllm.lora.request import LoRARequest

                loras = [None if x is None else LoRARequest(x[0], x[1], x[2], load_inplace=bool(x[3:4] and x[3]))
                         for x in cmd["loras"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
            wall = time.perf_counter() - t0
            _settle(llm)
            reply: dict[str, Any] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                     "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                                     "wall_s": wall}
            if cmd.get("logprobs"):
                reply["logprobs"] = [[{str(t): float(lp.logprob) for t, lp in pos.items()}
                                      for pos in (o.outputs[0].logprobs or [])] for o in outs]
            say(reply)
        except Exception as e:  # report, keep serving
            say({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    serve_engine(EngineSpec(**json.loads(sys.argv[1])))
