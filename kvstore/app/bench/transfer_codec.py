"""``kvstore bench transfer --compress``: daemon-to-daemon transfers of a trained model's KV
(all-MiniLM-L6-v2, bf16, see :mod:`kvstore.app.bench.codec`) with ``transport.compress`` off and
on, over a link held to ``--link-rate`` bytes/s by a relay in this process (a token bucket per
direction), next to a raw TCP socket moving the same bytes through the same relay in the same
round. Loopback itself runs faster than the codec, where ``compress auto`` sends raw; the relay
stands for a slower network (a 10 GbE link runs at 1.25 GB/s).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

from kvstore.app.local import free_port, start_daemon

PIECE = 64 << 10


class Relay:
    """Forwards TCP connections from a local port to ``target``, each direction held to ``rate``
    bytes/s (a token bucket with ``PIECE``-byte bursts). Threads, closed with :meth:`close`."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target, self.rate = target, rate
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        due = time.perf_counter()  # when the bytes forwarded so far may have left at the rate
        try:
            while data := src.recv(PIECE):
                dst.sendall(data)
                now = time.perf_counter()
                # an idle connection earns no credit beyond one piece: no burst after a pause
                due = max(due, now - PIECE / self.rate) + len(data) / self.rate
                if due > now:
                    time.sleep(due - now)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.srv.close()
        for s in self._socks:
            s.close()


def run(kv, layout, a) -> dict:
    """Rounds of: raw socket, daemon with compress off, daemon with compress on, through one
    relay at ``a.link_rate`` bytes/s; each transfer's blocks are read back from B and compared."""
    import torch

    from kvstore.clients import KVStoreClient
    from kvstore.config import parse_size

    rate = float(parse_size(a.link_rate))
    work = tempfile.mkdtemp(prefix="kvstore-bench-wire-")
    procs, rounds = [], []
    try:
        port_b = free_port()
        common = ("--dram-capacity-bytes", "128MiB", "--transport-backend", "tcp")
        db = start_daemon(work, "b", *common, "--transport-listen", f"127.0.0.1:{port_b}")
        procs.append(db)
        senders = {}
        for mode in ("off", "on"):
            d = start_daemon(work, f"a-{mode}", *common, "--transport-listen", f"127.0.0.1:{free_port()}",
                             "--transport-compress", mode)
            procs.append(d)
            senders[mode] = KVStoreClient(d.socket_path, timeout_s=120)
            senders[mode].register(layout, "bench-wire")
        cb = KVStoreClient(db.socket_path, timeout_s=120)
        cb.register(layout, "bench-wire")
        relay = Relay(("127.0.0.1", port_b), rate)
        # a raw reference through the same relay: its own sink behind it
        ref = socket.create_server(("127.0.0.1", 0))
        ref_relay = Relay(ref.getsockname(), rate)
        nbytes = kv.numel() * kv.element_size()

        def ref_sink() -> None:
            while True:
                try:
                    c, _ = ref.accept()
                except OSError:
                    return
                left = nbytes
                while left > 0 and (got := c.recv(1 << 20)):
                    left -= len(got)
                c.sendall(b"k")
                c.close()
        threading.Thread(target=ref_sink, daemon=True).start()
        tokens = kv.shape[2]
        out = torch.empty_like(kv)
        for r in range(a.repeat + 1):  # the first round warms the connections up
            row = {}
            s = socket.create_connection(("127.0.0.1", ref_relay.port))
            chunk = bytes(1 << 20)
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                s.sendall(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
            s.recv(1)
            row["raw_link_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
            s.close()
            ok = True
            for mode, c in senders.items():
                toks = list(range(r * 1_000_000 + (mode == "on") * 500_000, r * 1_000_000 + (mode == "on") * 500_000 + tokens))
                c.put(toks, kv)
                t0 = time.perf_counter()
                c.transfer(c.keys(toks), f"127.0.0.1:{relay.port}", deadline_s=300)
                row[f"{mode}_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
                out.zero_()
                ok &= cb.get(toks, out) == tokens and torch.equal(out.view(torch.int16), kv.view(torch.int16))
                cb.delete(cb.keys(toks))
                c.delete(c.keys(toks))
            row["verified"] = ok
            if r:
                rounds.append(row)
        wire = {}  # each sender's wire bytes per block byte sent, from its counters
        for mode, c in senders.items():
            n = c.stats().counters
            wire[mode] = n["kvstore_transfer_wire_bytes_total"] / n["kvstore_transfer_bytes_total"]
        for c in (*senders.values(), cb):
            c.close()
        relay.close()
        ref_relay.close()
        ref.close()
    finally:
        for d in procs:
            d.stop(30)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: round(statistics.median(x[k] for x in rounds), 3) for k in ("raw_link_GBps", "off_GBps", "on_GBps")}
    return {"link_rate_GBps": rate / 1e9, "bytes": nbytes, "rounds": rounds, **med,
            "speedup": round(med["on_GBps"] / med["off_GBps"], 3),
            "on_vs_raw_link": round(med["on_GBps"] / med["raw_link_GBps"], 3),
            "wire_fraction": {k: round(v, 3) for k, v in wire.items()},
            "verified": all(x["verified"] for x in rounds)}


def table(r: dict) -> str:
    lines = [f"Transfers between two daemons through a relay held to {r['link_rate_GBps']:.3f} GB/s, "
             f"{r['bytes'] / 1e6:.1f} MB of trained bf16 KV each (GB/s of raw block bytes; GB = 10^9 bytes)",
             "round  raw link  compress off  compress on  verified"]
    for i, x in enumerate(r["rounds"]):
        lines.append(f"{i:5d}  {x['raw_link_GBps']:8.3f}  {x['off_GBps']:12.3f}  {x['on_GBps']:11.3f}  {x['verified']}")
    lines.append(f"median: compress on {r['speedup']:.2f}x compress off, {r['on_vs_raw_link']:.2f}x the raw link; "
                 f"wire bytes per block byte: off {r['wire_fraction']['off']}, on {r['wire_fraction']['on']}")
    return "\n".join(lines)
