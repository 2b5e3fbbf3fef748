"""The benchmark's proxy in front of several servers: round-robin sends each
inference request to the next server; the affinity router keeps a key (a
conversation) on the server it first went to and gives each new key the
server holding the fewest; the trace benchmark's replay of that rule (used
for its per-arm ceilings) is the rule the proxy applies."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shmkv.engines.vllm_server import RoundRobinProxy, StickyRouter


class _Named(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"server": self.server.label}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def two_servers():
    servers = []
    for label in ("a", "b"):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        srv.label = label  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def _ask(url: str, conversation: str) -> str:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": conversation}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["server"]


def test_the_sticky_rule_keeps_keys_and_balances_new_ones():
    r = StickyRouter(2)
    assert [r.home(k) for k in ("x", "y", "x", "z", "y", "w", "z")] == [0, 1, 0, 0, 1, 1, 0]
    r3 = StickyRouter(3)
    assert [r3.home(k) for k in "abcd"] == [0, 1, 2, 0]


def test_round_robin_alternates(two_servers):
    proxy = RoundRobinProxy(two_servers)
    try:
        assert [_ask(proxy.url, "same") for _ in range(4)] == ["a", "b", "a", "b"]
        assert proxy.sent == [2, 2]
    finally:
        proxy.close()


def test_the_affinity_proxy_applies_the_sticky_rule(two_servers):
    proxy = RoundRobinProxy(two_servers, affinity=lambda body: json.loads(body)["prompt"])
    try:
        asked = ["x", "y", "x", "z", "y", "w", "z"]
        got = [_ask(proxy.url, k) for k in asked]
        rule = StickyRouter(2)
        assert got == ["ab"[rule.home(k)] for k in asked]
        assert got == ["a", "b", "a", "a", "b", "b", "a"]
    finally:
        proxy.close()
