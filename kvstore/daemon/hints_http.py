"""``POST /v1/route-hints``: RouteHints as HTTP/JSON, for routers not written in Python (or not
speaking gRPC), on ``server.hints_listen``.

Request body: ``{"namespace_id": "<64 hex>", "token_ids": [...]}`` or ``{"namespace_id": ...,
"keys": ["<64 hex>", ...]}``, optionally ``"max_nodes": n``. Answer: the RouteHintsResponse's
fields as JSON (``advice`` as ``"load"``, ``"pull"`` or ``"recompute"``), or
``{"error": "..."}`` with 400, 404, 413 or 503.

It is as closed as the gRPC control listener: TLS always, with the same certificate; a client
certificate from ``server.tls_client_ca_file`` and/or ``Authorization: Bearer <server.auth_token>``,
at least one of them required. Each connection is handshaken and read on a thread of its own,
with a deadline (``HANDSHAKE_S``), so a client that trickles bytes holds one thread, never the
listener; at most ``MAX_CONNECTIONS`` at once (more are closed at once).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvstore.daemon.hints import HintError, RouteHints
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.daemon")
PATH = "/v1/route-hints"
MAX_BODY = 8 << 20  # 65,536 keys in hex, or a 1M-token prompt's ids
HANDSHAKE_S = 5.0   # the TLS handshake, and each read of a request, must finish within this
CONNECTION_S = 30.0  # and a connection (its requests kept alive) lives at most this long
MAX_CONNECTIONS = 32
_ADVICE = {pb.ADVICE_LOAD: "load", pb.ADVICE_PULL: "pull", pb.ADVICE_RECOMPUTE: "recompute"}


def to_json(r: pb.RouteHintsResponse) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "recompute_s": r.recompute_s, "elsewhere_s": r.elsewhere_s,
            "reason": r.reason,
            "nodes": [{"node_id": n.node_id, "epoch": n.epoch, "local": n.local, "hbm_tokens": n.hbm_tokens,
                       "dram_tokens": n.dram_tokens, "nvme_tokens": n.nvme_tokens,
                       "advice": _ADVICE.get(n.advice, ""), "pull_from": n.pull_from,
                       "time_to_kv_s": n.time_to_kv_s} for n in r.nodes]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() does not wait on a client: each connection has its own deadline
    allow_reuse_address = True

    def __init__(self, addr, hints: RouteHints, tls: ssl.SSLContext, token: str) -> None:
        host = addr[0].strip("[]")
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.hints, self.tls, self.token = hints, tls, token
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((host, addr[1]), _Handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):  # full: this one is closed, the others go on
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request, client_address) -> None:
        """The TLS handshake here, on the connection's own thread. Each read waits at most
        ``HANDSHAKE_S``, and the whole connection lives at most ``CONNECTION_S``: then its
        socket is shut, whatever a slow client is in the middle of (a trickle of bytes holds
        one of the places for that long at most)."""
        request.settimeout(HANDSHAKE_S)
        cut = threading.Timer(CONNECTION_S, _shut, (request,))
        cut.daemon = True
        cut.start()
        try:
            try:
                tls = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as e:
                log.debug("route hints: TLS handshake from %s failed: %s", client_address, e)
                return
            try:
                self.RequestHandlerClass(tls, client_address, self)
            finally:
                try:
                    tls.close()
                except OSError:
                    pass
        finally:
            cut.cancel()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = HANDSHAKE_S
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # kvstore's log, at debug: one line per request is noise
        log.debug("route hints: %s %s", self.client_address[0], fmt % args)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.server.token and not hmac.compare_digest(
                self.headers.get("authorization", "").encode("utf-8", "replace"),
                f"Bearer {self.server.token}".encode()):
            self.close_connection = True  # before its body: an unauthenticated client is not read on
            return self._reply(401, {"error": "missing or wrong bearer token (server.auth_token)"})
        try:
            n = int(self.headers.get("content-length", ""))
        except ValueError:
            self.close_connection = True
            return self._reply(411, {"error": "a content-length is required"})
        if not 0 <= n <= MAX_BODY:
            self.close_connection = True
            return self._reply(413, {"error": f"body of {n} bytes; at most {MAX_BODY}"})
        raw = self.rfile.read(n)  # read whole before any answer: a socket closed unread resets the reply
        if self.path != PATH:
            return self._reply(404, {"error": f"only POST {PATH}"})
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            ns = bytes.fromhex(_str(body, "namespace_id"))
            keys = b"".join(bytes.fromhex(_str({"k": k}, "k")) for k in body.get("keys", []))
            tokens = body.get("token_ids", [])
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ValueError("token_ids: a list of integers")
            max_nodes = body.get("max_nodes", 0)
            if not isinstance(max_nodes, int) or max_nodes < 0:
                raise ValueError("max_nodes: an integer >= 0")
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            return self._reply(400, {"error": f"bad request: {type(e).__name__}: {str(e)[:200]}"})
        try:
            r = self.server.hints.answer(ns, keys, tokens, max_nodes)
        except HintError as e:
            return self._reply(404 if e.code == "not_found" else 400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - a bug answers 500, the listener goes on
            log.exception("route hints")
            return self._reply(500, {"error": f"internal error: {type(e).__name__}"})
        self._reply(200, to_json(r))

    def _reply(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _str(d: dict, key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{key}: a hex string")
    return v


class HintsListener:
    """The HTTP/JSON listener; :meth:`start` binds (OSError on a taken address) and serves on a
    thread, :meth:`stop` closes it."""

    def __init__(self, listen: str, hints: RouteHints, *, key_file: str, cert_file: str, ca_file: str,
                 token: str) -> None:
        host, _, port = listen.rpartition(":")
        self.addr = (host, int(port))
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        tls.load_cert_chain(cert_file, key_file)
        if ca_file:
            tls.load_verify_locations(ca_file)
            tls.verify_mode = ssl.CERT_REQUIRED
        self.tls, self.hints, self.token = tls, hints, token
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> int:
        self.server = _Server(self.addr, self.hints, self.tls, self.token)
        self.thread = threading.Thread(target=self.server.serve_forever, name="route-hints", daemon=True)
        self.thread.start()
        return self.server.server_address[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
