"""A request router for vLLM OpenAI servers on a kvstore fleet: each completion goes to the
server whose daemon has the prompt's KV ready first, from kvstore's route hints (per node: the
cached tokens by tier and the modelled time to the prompt's KV, loading, pulling or
recomputing). Where no node stands apart (a prompt nobody holds), requests go round-robin.

    python examples/hint_router.py --port 8000 \\
        --server node-a=http://10.0.0.1:8000 --server node-b=http://10.0.0.2:8000 \\
        --hints https://10.0.0.1:9400 --namespace <64 hex> \\
        --cacert ca.crt --cert router.crt --key router.key [--policy hints|hit-count|round-robin]

``--server NODE=URL``: each OpenAI server, by the ``cluster.node_id`` of the daemon its
connector uses. ``--hints``: any daemon's ``server.hints_listen`` (TLS; a client certificate of
``server.tls_client_ca_file``, or ``--token-file`` for ``server.auth_token``). ``--namespace``:
the engines' namespace id (``kvstore ls`` on a daemon lists it, with its model). The prompt's token ids come
from the first server's ``/tokenize``. The answer carries ``x-kvstore-node``: the node chosen.
Standard library and kvstore's routing module only. docs/cluster.md, "Routers", has the figures.
"""

from __future__ import annotations

import argparse
import json
import ssl
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvstore.cluster.routing import ROUTERS

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600


def _post(url: str, body: dict, *, context=None, headers=None, timeout=TIMEOUT_S):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})})
    return urllib.request.urlopen(req, timeout=timeout, context=context)


class Router:
    def __init__(self, a) -> None:
        self.servers = dict(s.split("=", 1) for s in a.server)
        self.policy = ROUTERS[a.policy](list(self.servers))
        self.lock = threading.Lock()  # the policy's round-robin turn
        self.hints_url = a.hints.rstrip("/") + "/v1/route-hints"
        self.namespace = a.namespace
        self.tls = ssl.create_default_context(cafile=a.cacert)
        self.tls.check_hostname = False  # the fleet's CA is the trust boundary; daemons are dialled by address
        if a.cert:
            self.tls.load_cert_chain(a.cert, a.key)
        self.auth = {}
        if a.token_file:
            with open(a.token_file) as f:
                self.auth = {"authorization": f"Bearer {f.read().strip()}"}

    def tokens(self, path: str, body: dict) -> list[int]:
        """The prompt's token ids, from vLLM's /tokenize (prompt or chat messages)."""
        first = next(iter(self.servers.values()))
        req = {"model": body.get("model")}
        if path.endswith("chat/completions"):
            req["messages"] = body.get("messages", [])
        else:
            req["prompt"] = body.get("prompt", "")
        with _post(first + "/tokenize", req, timeout=30) as r:
            return json.load(r)["tokens"]

    def pick(self, path: str, body: dict) -> str:
        hints = None
        if self.policy.needs_hints:
            try:
                toks = self.tokens(path, body)
                with _post(self.hints_url, {"namespace_id": self.namespace, "token_ids": toks},
                           context=self.tls, headers=self.auth, timeout=5) as r:
                    hints = json.load(r)
            except (OSError, ValueError, KeyError):
                hints = {"nodes": []}  # no hints: the request still goes somewhere (round-robin)
        with self.lock:
            return self.policy.pick(hints)


class Handler(BaseHTTPRequestHandler):
    router: Router

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path not in ROUTES:
            return self._reply(404, {"error": f"only {', '.join(ROUTES)}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        except ValueError as e:
            return self._reply(400, {"error": f"request body is not JSON: {e}"})
        node = self.router.pick(self.path, body)
        try:
            upstream = _post(self.router.servers[node] + self.path, body)
        except urllib.error.HTTPError as e:
            return self._reply(e.code, {"error": f"server {node}: {e.read().decode(errors='replace')}"}, node)
        except OSError as e:
            return self._reply(502, {"error": f"server {node} unreachable: {e}"}, node)
        with upstream:
            self.send_response(upstream.status)
            for k in ("content-type",):
                if upstream.headers.get(k):
                    self.send_header(k, upstream.headers[k])
            self.send_header("x-kvstore-node", node)
            self.end_headers()
            while chunk := upstream.read1(65536):  # streamed answers pass through as they come
                self.wfile.write(chunk)
                self.wfile.flush()

    def _reply(self, code: int, obj: dict, node: str = "") -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if node:
            self.send_header("x-kvstore-node", node)
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, metavar="NODE=URL",
                    help="an OpenAI server and the node id of its daemon (repeat)")
    ap.add_argument("--hints", required=True, help="https://host:port of a daemon's server.hints_listen")
    ap.add_argument("--namespace", required=True, help="the engines' namespace id (64 hex digits)")
    ap.add_argument("--cacert", required=True, help="CA of the daemons' certificates")
    ap.add_argument("--cert", default="", help="this router's client certificate")
    ap.add_argument("--key", default="", help="its private key")
    ap.add_argument("--token-file", default="", help="a file holding server.auth_token, instead of a certificate")
    ap.add_argument("--policy", default="hints", choices=sorted(ROUTERS))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    if any("=" not in s for s in a.server):
        ap.error("--server takes NODE=URL")
    Handler.router = Router(a)
    ThreadingHTTPServer((a.host, a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
