"""The daemon's files are private whatever the umask, it refuses directories another user could
write into, and it never prints a secret (issue 17, findings 5 and 7)."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout

LAYOUT = KVLayout(4, 2, 64, "fp16")
NOBODY = 65534


def nvme_args(d):
    return ("--nvme-dir", str(d), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
            "--nvme-durable-commit", "true", "--dram-prefault", "false")


def with_umask(mask: str) -> list[str]:
    return ["sh", "-c", f'umask {mask} && exec "$@"', "sh"]


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def fill(sock: str) -> None:
    c = KVStoreClient(sock)
    c.register(LAYOUT, "m", tenant_salt="tenant-secret")
    tokens = list(range(4 * 16))
    assert c.put(tokens, np.ones(LAYOUT.tensor_shape(len(tokens)), np.float16)) == 4
    c.close()


@pytest.mark.parametrize("umask", ["022", "000"])
def test_files_and_directories_are_private_whatever_the_umask(tmp_path, umask):
    sock = tmp_path / "run" / "sub" / "k.sock"  # neither directory exists yet
    nvme = tmp_path / "data" / "nvme"
    d = start_daemon(tmp_path, *nvme_args(nvme), socket_path=str(sock), prefix=with_umask(umask))
    try:
        fill(d.socket_path)
    finally:
        assert d.stop() == 0
    for p in (tmp_path / "run", sock.parent):
        assert mode(p) == 0o700, p
    seen = []
    for root, dirs, files in os.walk(nvme):
        assert mode(root) == 0o700, root
        for f in files:
            seen.append(f)
            assert mode(os.path.join(root, f)) == 0o600, (f, oct(mode(os.path.join(root, f))))
    assert {"namespaces.json", "data.mdb", "lock.mdb", "data-00000.kvd"} <= set(seen), seen


def test_files_left_open_by_an_older_daemon_are_made_private(tmp_path):
    """A directory an older daemon wrote under umask 022 (0755 dirs, 0644 files) is tightened."""
    nvme = tmp_path / "nvme"
    d = start_daemon(tmp_path, *nvme_args(nvme))
    try:
        fill(d.socket_path)
    finally:
        assert d.stop() == 0
    for root, dirs, files in os.walk(nvme):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    d = start_daemon(tmp_path, *nvme_args(nvme))
    assert d.stop() == 0
    for root, dirs, files in os.walk(nvme):
        assert mode(root) == 0o700, root
        for f in files:
            assert mode(os.path.join(root, f)) == 0o600, f


def refused(tmp_path, *args, sock=None, left=False):
    """``kvstore serve`` exits 2 before it builds the arena, leaving no socket (or the path in
    the way as it was, ``left``); returns what it said."""
    sock = sock or tmp_path / "k.sock"
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", str(sock),
                        "--dram-capacity-bytes", "64MiB", "--metrics-port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "DRAM arena" not in p.stderr, "the check must come before the arena is built:\n" + p.stderr
    assert os.path.exists(sock) == left
    return p.stderr


def test_a_socket_path_in_the_way_is_refused_before_the_arena(tmp_path):
    sock = tmp_path / "k.sock"
    sock.write_text("a file")
    assert "is not a socket" in refused(tmp_path, sock=sock, left=True)
    sock.unlink()
    d = start_daemon(tmp_path, "--dram-prefault", "false", socket_path=str(sock))
    try:
        assert "another daemon is serving" in refused(tmp_path, sock=sock, left=True)
    finally:
        assert d.stop() == 0


def test_a_socket_directory_others_can_write_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for bits, who in ((0o777, "group and others"), (0o770, "group"), (0o1777, "group and others"), (0o757, "others")):
        os.chmod(run, bits)
        err = refused(tmp_path, sock=run / "k.sock")
        assert "server.socket_path" in err and str(run) in err and f"writable by {who}" in err, err


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user owns needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    err = refused(tmp_path, sock=run / "k.sock")
    assert "server.socket_path" in err and f"uid {NOBODY}" in err, err
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    os.chown(nvme, NOBODY, NOBODY)
    err = refused(tmp_path, *nvme_args(nvme))
    assert "nvme.dir" in err and f"uid {NOBODY}" in err, err


def test_a_data_directory_others_can_write_is_refused(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    os.chmod(nvme, 0o777)
    err = refused(tmp_path, *nvme_args(nvme))
    assert "nvme.dir" in err and str(nvme) in err and "writable by group and others" in err, err
    assert not (nvme / "namespaces.json").exists()


def test_print_config_and_help_show_no_secret(tmp_path):
    env = {**os.environ, "KVSTORE_SERVER_AUTH_TOKEN": "env-s3cret"}
    for args in (["--print-config"], ["--print-config", "--server-auth-token", "flag-s3cret"], ["--help"]):
        p = subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], capture_output=True, text=True,
                           timeout=30, env=env)
        assert p.returncode == 0, p.stderr
        assert "s3cret" not in p.stdout + p.stderr, p.stdout
        if "--print-config" in args:
            assert 'auth_token = "<redacted>"' in p.stdout, p.stdout
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--print-config"], capture_output=True, text=True,
                       timeout=30, env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")})
    assert 'auth_token = ""' in p.stdout  # no secret set: nothing to hide, and it says so
