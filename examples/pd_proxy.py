"""A prefill/decode router for two vLLM OpenAI servers on kvstore, in the shape of vLLM's own
disaggregated-serving proxy: each completion goes to the prefill server with ``max_tokens`` 1,
and the ``kv_transfer_params`` it answers with (kvstore's announcement: the blocks its daemon
ships to the decode server's daemon) go with the original request to the decode server, whose
answer is streamed back. The decode server waits for the announced blocks (its connector's
``transfer_wait_s``), then loads them, or recomputes what did not arrive.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

The standard library only; one prefill and one decode server (the prefill connector's
``transfer_peer`` names the decode server's daemon). docs/vllm.md has the whole walkthrough.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=TIMEOUT_S)


class Handler(BaseHTTPRequestHandler):
    prefill = decode = ""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path not in ROUTES:
            return self._reply(404, {"error": f"only {', '.join(ROUTES)}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        except ValueError as e:
            return self._reply(400, {"error": f"request body is not JSON: {e}"})
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            with _post(self.prefill + self.path, first) as r:
                params = json.load(r).get("kv_transfer_params")
        except urllib.error.HTTPError as e:
            return self._reply(e.code, {"error": f"prefill server: {e.read().decode(errors='replace')}"})
        except OSError as e:
            return self._reply(502, {"error": f"prefill server unreachable: {e}"})
        if params:
            body["kv_transfer_params"] = params
        try:
            upstream = _post(self.decode + self.path, body)
        except urllib.error.HTTPError as e:
            return self._reply(e.code, {"error": f"decode server: {e.read().decode(errors='replace')}"})
        except OSError as e:
            return self._reply(502, {"error": f"decode server unreachable: {e}"})
        with upstream:
            self.send_response(upstream.status)
            self.send_header("content-type", upstream.headers.get("content-type", "application/json"))
            self.end_headers()
            while chunk := upstream.read1(65536):  # streamed answers pass as they come
                self.wfile.write(chunk)
                self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802 - /health and /v1/models answer for the decode server
        try:
            with urllib.request.urlopen(self.decode + self.path, timeout=10) as r:
                self._reply(r.status, json.loads(r.read() or b"{}"))
        except urllib.error.HTTPError as e:
            self._reply(e.code, {"error": e.reason})
        except OSError as e:
            self._reply(502, {"error": f"decode server unreachable: {e}"})

    def _reply(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill server's base URL")
    ap.add_argument("--decode", required=True, help="the decode server's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    Handler.prefill, Handler.decode = a.prefill.rstrip("/"), a.decode.rstrip("/")
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    print(f"pd_proxy on http://{a.host}:{a.port}: prefill {Handler.prefill}, decode {Handler.decode}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
