"""Child processes of the local stack: spawned in their own session, killed with us.

Every server of the local stack is a direct child of this Python process:

* it runs in its own session/process group, so a terminal Ctrl-C reaches only us, and
  we stop the servers in order (``with`` blocks, ``stop()``, or at interpreter exit);
* on Linux it gets ``PR_SET_PDEATHSIG(SIGKILL)``, so it never outlives us even when we
  are killed with SIGKILL. The kernel ties that signal to the *thread* that spawned the
  child: call ``start()`` from a thread that lives as long as the server should;
* its stdout/stderr go to a log file, never to our terminal.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from relay.core.log_fields import log_extra
from relay.errors import RelayError

__all__ = [
    "LocalServer",
    "LocalServerError",
    "free_port",
    "log_tail",
    "pid_alive",
    "port_open",
    "reaper",
    "signal_and_wait",
    "spawn",
    "write_private",
]


class LocalServerError(RelayError):
    """A local server (the dev and test stack) is missing, failed to start, or did not
    become ready."""


_log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_BYTES = 4000


def write_private(path: Path, text: str, *, owner: tuple[int, int] | None = None) -> None:
    """Write ``path`` whole, readable by its owner only (0600) from the first byte on:
    it holds a password. ``owner``: (uid, gid) to give it to (the server's user)."""
    staging = path.with_name(f".{path.name}.tmp")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    if owner is not None:
        os.chown(staging, *owner)
    staging.replace(path)


class LocalServer:
    """A server process of ours: ``start()`` it (or use ``with``), ``stop()`` it."""

    _proc: subprocess.Popen[bytes] | None = None
    log_path: Path  # where the server writes its log

    @property
    def pid(self) -> int | None:
        """The server's pid, or ``None`` when it is not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (ask the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(port: int, timeout: float = 0.5, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def log_tail(path: Path, max_bytes: int = _LOG_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = data.decode("utf-8", errors="replace").strip()
    return text if text else f"<log {path} is empty>"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent thread dies.

    ``subprocess`` switches uid/gid *before* running ``preexec_fn``; that matters,
    because a credential change clears the parent-death signal again.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _log.debug(
            "prctl() unavailable; child processes may outlive us",
            extra=log_extra("local_prctl_unavailable"),
        )
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork() and prctl(): nobody will signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def spawn(
    argv: list[str],
    log_file: IO[bytes],
    *,
    user: str | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    group: int | None = None
    if user is not None:
        group = pwd.getpwnam(user).pw_gid
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        user=user,
        group=group,
        extra_groups=[] if user is not None else None,
        start_new_session=True,
        # prctl must run after the uid switch, which only preexec_fn allows; it calls
        # nothing but prctl/getppid, so it is safe even with other threads running.
        preexec_fn=_make_pdeathsig_preexec(),  # noqa: PLW1509
        close_fds=True,
    )


def signal_and_wait(proc: subprocess.Popen[bytes], sig: int, timeout: float, name: str) -> None:
    """Send ``sig``, wait up to ``timeout`` seconds, then SIGKILL and reap."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _log.warning(
            "%s (pid %s) did not stop within %.1fs; killing it",
            name,
            proc.pid,
            timeout,
            extra=log_extra("local_server_killed", server=name, pid=proc.pid),
        )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


class _Reaper:
    """Stops still-running servers at normal interpreter exit, newest first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: list[LocalServer] = []
        atexit.register(self._stop_all)

    def add(self, server: LocalServer) -> None:
        with self._lock:
            if server not in self._servers:
                self._servers.append(server)

    def discard(self, server: LocalServer) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._servers.remove(server)

    def _stop_all(self) -> None:
        with self._lock:
            servers = list(reversed(self._servers))
        for server in servers:
            try:
                server.stop()
            except Exception:
                _log.exception(
                    "failed to stop %r at exit",
                    server,
                    extra=log_extra("local_server_stop_failed", server=repr(server)),
                )


reaper = _Reaper()
