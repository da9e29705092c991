"""examples/hint_router.py in front of two vLLM OpenAI servers, each on its own daemon of a fleet
(real etcd, the cluster directory from the daemons' KV events): a prompt nobody holds goes
round-robin; once a server's engine has stored it, the router sends it back to that server
(round-robin would alternate), from the hints of the daemon it asks over mutual TLS."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the real vLLM is installed by scripts/install_vllm.sh")
pytest.importorskip("zmq")

from kvstore.app.bench.cluster import fleet_certificates  # noqa: E402
from kvstore.app.bench.vllm_engine import save_llama, save_tokenizer, words  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from tests.daemon_util import free_port  # noqa: E402
from tests.etcd_util import EtcdServer, node  # noqa: E402
from tests.test_vllm_openai import BT, Server, _up  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

NAMES = ("route-a", "route-b")
PROMPT = words((7 * i) % 500 + 1 for i in range(200))   # 6 whole blocks of 32
OTHER = words((11 * i) % 500 + 1 for i in range(200))


def test_the_hint_router_sends_a_prompt_back_to_the_server_holding_it(daemons, tmp_path):
    etcd = EtcdServer(tmp_path).start()
    model = save_tokenizer(save_llama(tmp_path / "tiny", "tiny"), 512)
    pki = fleet_certificates(tmp_path / "pki", (*NAMES, "router"), ips={"127.0.0.1"})
    hints = free_port()
    specs = [node(etcd, n, "--server-tcp-listen", f"127.0.0.1:{free_port()}",
                  "--server-tls-cert-file", str(pki / f"{n}.crt"), "--server-tls-key-file", str(pki / f"{n}.key"),
                  "--server-tls-client-ca-file", str(pki / "ca.crt"),
                  "--events-publish", f"tcp://127.0.0.1:{free_port()}", "--events-replay", f"tcp://127.0.0.1:{free_port()}",
                  "--events-heartbeat-s", "0.2", *(("--server-hints-listen", f"127.0.0.1:{hints}") if n == NAMES[0] else ()),
                  dram="256MiB", transfer_addr=f"127.0.0.1:{free_port()}") for n in NAMES]
    da, db = daemons.start(*specs)
    servers = [Server(model, tmp_path / f"{n}.log", d.socket_path) for n, d in zip(NAMES, (da, db))]
    router = None
    try:
        for s in servers:
            s.ready()
        with KVStoreClient(da.socket_path) as c:
            ns = next(n.namespace_id.hex() for n in c.stats().namespaces if "tiny" in n.model_id)
        port = free_port()
        router = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "examples" / "hint_router.py"),
                                   "--port", str(port), "--hints", f"https://127.0.0.1:{hints}", "--namespace", ns,
                                   "--cacert", str(pki / "ca.crt"), "--cert", str(pki / "router.crt"),
                                   "--key", str(pki / "router.key"),
                                   *(f"--server={n}=http://127.0.0.1:{s.port}" for n, s in zip(NAMES, servers))])
        wait_for(lambda: _up(port), 30, "the router to listen")

        def ask(prompt: str) -> tuple[str, str]:
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.headers["x-kvstore-node"], json.load(r)["choices"][0]["text"]

        def held(prompt: str) -> dict[str, int]:
            """Cached tokens per node in the hints of the daemon the router asks."""
            req = urllib.request.Request(f"http://127.0.0.1:{servers[0].port}/tokenize",
                                         json.dumps({"model": "tiny", "prompt": prompt}).encode(),
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                toks = json.load(r)["tokens"]
            with KVStoreClient(da.socket_path) as c:
                r = c.call("RouteHints", pb.RouteHintsRequest(namespace_id=bytes.fromhex(ns), token_ids=toks))
            return {n.node_id: n.dram_tokens + n.nvme_tokens for n in r.nodes if n.dram_tokens + n.nvme_tokens}

        # Nobody holds either prompt: they go round-robin, the first to A, the second to B.
        assert ask(PROMPT)[0] == NAMES[0]
        wait_for(lambda: held(PROMPT) == {NAMES[0]: 6 * BT}, 30, "A holding the first prompt")
        assert ask(OTHER)[0] == NAMES[1]
        wait_for(lambda: held(OTHER) == {NAMES[1]: 6 * BT}, 30, "A's directory: B holds the second")
        # Now each goes back to its holder, twice in a row (round-robin would alternate).
        answers = {}
        for prompt, holder in ((PROMPT, NAMES[0]), (OTHER, NAMES[1])):
            for _ in range(2):
                got, text = ask(prompt)
                assert got == holder, prompt[:20]
                assert answers.setdefault(prompt, text) == text
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for s in servers:
            s.stop()
        etcd.stop()
