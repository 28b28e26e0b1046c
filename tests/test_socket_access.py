"""Who may connect to the ipc socket: ``[server] socket_mode`` and ``socket_group``, set
right after bind whatever the umask (cached/socketmode.py). Checked with real second
users: a forked child of the test takes another uid (and groups) and connects itself, so
nothing needs to exec a Python interpreter that other users may not reach."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cached.socketmode import resolve_group
from tests.daemon import ProcessDaemon, write_config

NOBODY = 65534
GROUP = 4242  # a gid no user has: only the children given it are in the group

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


def config(directory: Path, **server: Any) -> tuple[Path, str]:
    socket_url = f"ipc://{directory}/cached.sock"
    path = write_config(
        directory / "config.toml",
        {
            "server": {"socket": socket_url, "http": "127.0.0.1:0", **server},
            "cache": {"dir": str(directory / "hot"), "capacity": "1GiB", "min_free": "0"},
            # Nothing is fetched in these tests.
            "s3": {"endpoint_url": "http://127.0.0.1:9"},
        },
    )
    return path, socket_url


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(endpoint: str) -> str:
    return stat.filemode(os.stat(endpoint[len("ipc://") :]).st_mode)


def as_user(endpoint: str, uid: int, gid: int, groups: list[int]) -> dict[str, Any]:
    """Connect to ``endpoint`` as another user, in a forked child: a raw unix-socket connect
    (its errno), then the protocol's hello, or the client's explanation of the failure."""
    path = endpoint[len("ipc://") :]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        out: dict[str, Any] = {}
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out["uid"], out["groups"] = os.getuid(), os.getgroups()
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                out["connect"] = "ok"
            except OSError as exc:
                out["connect"] = errno.errorcode.get(exc.errno or 0, str(exc))
            finally:
                probe.close()
            out["hello"] = _hello(endpoint)
        except BaseException as exc:
            out["error"] = repr(exc)
        finally:
            try:  # a parent that gave up has closed the pipe: exit all the same
                os.write(write, json.dumps(out).encode())
            finally:
                os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(data)
    assert "error" not in result, result
    return result


def _hello(endpoint: str) -> str:
    """``"ok"``, or the message of the client's error (a fresh ZeroMQ context: the child
    must not use the parent's)."""
    from cached_client.errors import CachedClientError
    from cached_client.transport import Connection

    conn = Connection(endpoint, connect_timeout_s=2.0)
    try:
        conn.open()
        return "ok"
    except CachedClientError as exc:
        return str(exc)
    finally:
        conn.close()


def test_the_mode_is_set_whatever_the_umask(public_dir: Path) -> None:
    """The default 0660 under a permissive umask, 0666 under a private one."""
    (public_dir / "a").mkdir()
    path, endpoint = config(public_dir / "a")
    with umask(0o000), ProcessDaemon(path, endpoint):
        assert mode_of(endpoint) == "srw-rw----"
    (public_dir / "b").mkdir()
    path, endpoint = config(public_dir / "b", socket_mode="0666")
    with umask(0o077), ProcessDaemon(path, endpoint) as daemon:
        assert mode_of(endpoint) == "srw-rw-rw-"
        assert "mode 0666, group the daemon's" in daemon.log_tail()


@needs_root
def test_a_member_of_the_socket_group_connects_and_another_user_is_refused(
    public_dir: Path,
) -> None:
    path, endpoint = config(public_dir, socket_group=str(GROUP))
    with umask(0o000), ProcessDaemon(path, endpoint):
        st = os.stat(endpoint[len("ipc://") :])
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, GROUP)

        member = as_user(endpoint, NOBODY, NOBODY, [GROUP])
        assert member["uid"] == NOBODY and member["groups"] == [GROUP]
        assert member["connect"] == "ok" and member["hello"] == "ok", member

        other = as_user(endpoint, NOBODY, NOBODY, [])
        assert other["connect"] == "EACCES", other
        sock = endpoint[len("ipc://") :]
        assert f"permission denied on {sock} (srw-rw----" in other["hello"], other
        assert "ask the administrator to add you to the socket's group" in other["hello"]


@needs_root
def test_mode_0666_admits_any_local_user(public_dir: Path) -> None:
    path, endpoint = config(public_dir, socket_mode="0666")
    with umask(0o077), ProcessDaemon(path, endpoint):
        anyone = as_user(endpoint, NOBODY, NOBODY, [])
        assert anyone["connect"] == "ok" and anyone["hello"] == "ok", anyone


def serve(path: Path, *prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "cached", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("cached: error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_an_unknown_group_is_one_line_and_leaves_no_socket(tmp_path: Path) -> None:
    path, endpoint = config(tmp_path, socket_group="no-such-group-cached")
    line = one_line(serve(path))
    assert "[server] socket_group 'no-such-group-cached': no such group" in line
    assert not os.path.exists(endpoint[len("ipc://") :])


@needs_root
def test_a_group_the_daemon_may_not_give_is_one_line(tmp_path: Path) -> None:
    """Without CAP_CHOWN, a user may give its files only to groups it is a member of."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv")
    path, endpoint = config(tmp_path, socket_group=str(GROUP))
    line = one_line(serve(path, "setpriv", "--bounding-set=-chown"))
    sock = endpoint[len("ipc://") :]
    assert f"cannot give the socket {sock} to group {GROUP} ([server] socket_group)" in line
    assert "Operation not permitted" in line and "must be a member of that group" in line
    assert not os.path.exists(sock)  # not left behind with the umask's mode


@pytest.mark.parametrize("mode", ["660", "0660", "0666", "0600"])
def test_socket_mode_accepts_octal_digits(mode: str) -> None:
    from cached.config import load

    assert load(None, env={"CACHED_SERVER_SOCKET_MODE": mode}).server.socket_mode == mode


@pytest.mark.parametrize("mode", ["rw-rw----", "0999", "10660", "0o660", ""])
def test_a_bad_socket_mode_names_the_key(mode: str) -> None:
    from cached.config import load
    from cached.errors import ConfigError

    with pytest.raises(ConfigError, match=r"CACHED_SERVER_SOCKET_MODE|\[server\] socket_mode"):
        load(None, env={"CACHED_SERVER_SOCKET_MODE": mode})


def test_groups_resolve_by_name_or_number() -> None:
    assert resolve_group(None) is None
    assert resolve_group("root") == 0
    assert resolve_group("4242") == GROUP
