"""Two network namespaces joined by a veth pair, for tests whose traffic must cross a real
(virtual) link. Made by the test where it has root and iproute2, skipped with the reason where
not. Only the test's own addresses inside its namespaces are used."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def veth_pair(tag: str, second_octet: int):
    """Yield ``((ns_a, addr_a), (ns_b, addr_b))`` on ``10.<second_octet>.N.1/.2``; remove both
    namespaces (and with them the veth pair) afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("netns test: the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("netns test: needs root to create network namespaces")
    sfx = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"{tag}-a-{sfx}", f"{tag}-b-{sfx}"
    net = f"10.{second_octet}.{os.getpid() % 250}"
    try:
        _ip("netns", "add", ns_a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"netns test: cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        dev_a, dev_b = f"{tag}a{sfx}", f"{tag}b{sfx}"
        _ip("netns", "add", ns_b)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        _ip("link", "set", dev_a, "netns", ns_a)
        _ip("link", "set", dev_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, f"{net}.1"), (ns_b, dev_b, f"{net}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        pytest.skip(f"netns test: cannot wire the namespaces: {exc.stderr.strip()}")
    try:
        yield (ns_a, f"{net}.1"), (ns_b, f"{net}.2")
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@contextlib.contextmanager
def star(tag: str, second_octet: int, n: int):
    """``n`` namespaces on one bridge, which lives in a hub namespace of its own (nothing is
    added to the host's network). Yield ``((hub_ns, hub_addr), [(ns, addr), ...])`` on
    ``10.<second_octet>.N.0/24``: the hub is ``.254``, the others ``.1`` to ``.n``. Skips as
    :func:`veth_pair` does."""
    if shutil.which("ip") is None:
        pytest.skip("netns test: the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("netns test: needs root to create network namespaces")
    sfx = f"{os.getpid() % 100000}"
    net = f"10.{second_octet}.{os.getpid() % 250}"
    hub = f"{tag}-hub-{sfx}"
    spokes = [(f"{tag}-{i}-{sfx}", f"{net}.{i}") for i in range(1, n + 1)]
    made = []
    try:
        for ns in [hub] + [s for s, _ in spokes]:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{net}.254/24", "dev", "br0")
        for ns in [hub] + [s for s, _ in spokes]:
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(spokes, 1):
            inner, outer = f"{tag}{i}i{sfx}", f"{tag}{i}o{sfx}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", hub)
            _ip("-n", hub, "link", "set", outer, "master", "br0")
            _ip("-n", hub, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
    except subprocess.CalledProcessError as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        pytest.skip(f"netns test: cannot wire the namespaces: {exc.stderr.strip()}")
    try:
        yield (hub, f"{net}.254"), spokes
    finally:
        for ns in made:  # deleting a namespace deletes its ends of the veth pairs (and the bridge)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
