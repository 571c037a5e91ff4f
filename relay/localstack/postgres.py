"""A throw-away PostgreSQL cluster from the ``initdb`` and ``postgres`` binaries here.

When we run as root (containers, CI), PostgreSQL refuses to start, so ``initdb`` and
``postgres`` run as the ``postgres`` system user and the data directory is chowned to
it. Every ancestor directory of the data directory must then be searchable by that user
(``pytest``'s ``tmp_path`` is not: it lives under a 0700 directory).

No other user of the machine may use the server (issue #47): every TCP login needs the
password generated for the cluster, kept in a 0600 password file in its data directory
that the URLs name (``passfile=``), so no password shows in a URL, a process list or a
terminal; the Unix socket, trusted, is in the 0700 data directory, which only the server's
user (and root) can enter.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.adapters.postgres import db
from relay.core.log_fields import log_extra
from relay.errors import RelayError
from relay.localstack.process import (
    LocalServer,
    LocalServerError,
    free_port,
    log_tail,
    pid_alive,
    port_open,
    reaper,
    signal_and_wait,
    spawn,
    write_private,
)

__all__ = ["LocalPostgres"]

_log = logging.getLogger(__name__)

_PG_SYSTEM_USER = "postgres"
_PG_START_TIMEOUT = 30.0
_MAX_SOCKET_DIR_LEN = 80
# The superuser's password, as a libpq password file (host:port:database:user:password).
_PASSFILE = "outbox-relay.pgpass"
_SUPERUSER = "postgres"
# Written at every start, so a cluster made when the stack trusted every loopback login
# (before issue #47) loses that too.
_PG_HBA = """\
# Written by outbox-relay's local stack at every start (relay/localstack/postgres.py).
# TCP: the password only (scram-sha-256). The Unix socket is in the 0700 data directory:
# only the server's own OS user (and root) can reach it.
local   all          all                 trust
local   replication  all                 trust
host    all          all   127.0.0.1/32  scram-sha-256
host    replication  all   127.0.0.1/32  scram-sha-256
"""

# --------------------------------------------------------------------------- Postgres


def find_pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if candidates:
        return candidates[-1]
    raise LocalServerError(
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


class LocalPostgres(LocalServer):
    """A PostgreSQL server in ``data_dir``, listening on 127.0.0.1 only, with a password
    (``passfile``) for every TCP login.

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
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        # Extra server settings, e.g. {"wal_level": "logical"} for a Debezium connector.
        self.settings = dict(settings or {})
        self.port = port if port is not None else free_port()
        self.fsync = fsync
        self.log_path = (
            Path(log_path)
            if log_path is not None
            else self.data_dir.parent / f"{self.data_dir.name}.log"
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: Path | None = None
        self._tmp_socket_dir: Path | None = None
        self._run_as: str | None = _PG_SYSTEM_USER if os.geteuid() == 0 else None

    def __repr__(self) -> str:
        return f"LocalPostgres(data_dir={str(self.data_dir)!r}, port={self.port})"

    # -- public API

    @property
    def url(self) -> str:
        """Admin URL of the ``postgres`` database (superuser ``postgres``)."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """URL of database ``dbname`` on this server, as the superuser: its password
        is read from :attr:`passfile` (libpq's ``passfile``), never written in the URL."""
        return (
            f"postgresql://{_SUPERUSER}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"
            f"?passfile={quote(str(self.passfile), safe='/')}"
        )

    @property
    def passfile(self) -> Path:
        """The superuser's password, as a libpq password file (mode 0600)."""
        return self.data_dir / _PASSFILE

    @property
    def password(self) -> str:
        """The superuser's password, for clients that cannot read a password file."""
        return self.passfile.read_text(encoding="utf-8").strip().rsplit(":", 1)[1]

    def start(self) -> None:
        """Create the cluster if needed, start the server and wait until it accepts logins."""
        if self.running:
            return
        initdb = find_pg_binary("initdb")
        postgres = find_pg_binary("postgres")
        self._prepare_data_dir()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(initdb)
        self._write_private(self.data_dir / "pg_hba.conf", _PG_HBA)
        self._clear_stale_pidfile()
        self._check_port_free()
        socket_dir = self._socket_dir = self._make_socket_dir()

        sync = "on" if self.fsync else "off"
        argv = [
            postgres,
            "-D", str(self.data_dir),
            "-p", str(self.port),
            "-k", str(socket_dir),
            "-c", "listen_addresses=127.0.0.1",
            "-c", f"fsync={sync}",
            "-c", "max_connections=200",
            *[arg for n, v in self.settings.items() for arg in ("-c", f"{n}={v}")],
        ]  # fmt: skip
        _log.info(
            "starting postgres on 127.0.0.1:%s (data %s, log %s)",
            self.port,
            self.data_dir,
            self.log_path,
            extra=self._log_extra("local_postgres_starting"),
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self._proc = spawn(argv, log_file, user=self._run_as, cwd=self.data_dir)
        reaper.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self._kill_quietly()
            raise
        _log.info(
            "postgres ready on 127.0.0.1:%s (pid %s)",
            self.port,
            self._proc.pid,
            extra=self._log_extra("local_postgres_ready", pid=self._proc.pid),
        )

    def stop(self, timeout: float = 15.0) -> None:
        """Fast shutdown (SIGINT: roll back sessions, checkpoint); SIGKILL after ``timeout``."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                _log.info(
                    "stopping postgres on 127.0.0.1:%s (pid %s)",
                    self.port,
                    proc.pid,
                    extra=self._log_extra("local_postgres_stopping", pid=proc.pid),
                )
            signal_and_wait(proc, signal.SIGINT, timeout, "postgres")
            self._proc = None
        reaper.discard(self)
        if self._tmp_socket_dir is not None:
            shutil.rmtree(self._tmp_socket_dir, ignore_errors=True)
            self._tmp_socket_dir = None
        self._socket_dir = None

    # -- internals

    def _log_extra(self, event: str, **fields: object) -> dict[str, object]:
        """The ``extra`` of this server's log lines: the event, its port, then ``fields``."""
        return log_extra(event, port=self.port, **fields)

    def _ids(self) -> tuple[int, int] | None:
        if self._run_as is None:
            return None
        try:
            entry = pwd.getpwnam(self._run_as)
        except KeyError as exc:
            raise LocalServerError(
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
            self.data_dir.chmod(0o700)  # it holds the trusted socket and the password
            return
        uid, gid = ids
        gids = {gid, *os.getgrouplist(self._run_as or _PG_SYSTEM_USER, gid)}
        for ancestor in reversed(self.data_dir.parents):
            if not _searchable_by(ancestor, uid, gids):
                raise LocalServerError(
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

    def _write_private(self, path: Path, text: str) -> None:
        write_private(path, text, owner=self._ids())

    def _initdb(self, initdb: str) -> None:
        password = secrets.token_urlsafe(24)
        # initdb reads the password from a file the server's user can read, outside the
        # data directory (which must be empty): in a 0700 directory of its own.
        staging = Path(tempfile.mkdtemp(prefix="outbox-pw-"))
        try:
            self._chown(staging)
            self._write_private(staging / "password", password + "\n")
            self._run_initdb(initdb, staging / "password")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._save_password(password)

    def _save_password(self, password: str) -> None:
        # Any host, port and database: the port may change between starts.
        self._write_private(self.passfile, f"*:*:*:{_SUPERUSER}:{password}\n")

    def _run_initdb(self, initdb: str, password_file: Path) -> None:
        argv = [
            initdb,
            "-D", str(self.data_dir),
            "-U", _SUPERUSER,
            f"--pwfile={password_file}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]  # fmt: skip
        if not self.fsync:
            argv.append("--no-sync")
        _log.info(
            "initdb %s (log %s)",
            self.data_dir,
            self.log_path,
            extra=self._log_extra("local_postgres_initdb", data_dir=self.data_dir),
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            proc = spawn(argv, log_file, user=self._run_as, cwd=self.data_dir)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -signal.SIGKILL
        if rc != 0:
            raise LocalServerError(
                f"initdb {self.data_dir} failed with exit code {rc}; log {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            )

    def _clear_stale_pidfile(self) -> None:
        pidfile = self.data_dir / "postmaster.pid"
        try:
            first_line = pidfile.read_text(errors="replace").splitlines()[0]
            pid = int(first_line.strip())
        except FileNotFoundError:
            return
        except (OSError, IndexError, ValueError):
            _log.warning(
                "removing unreadable %s",
                pidfile,
                extra=self._log_extra("local_postgres_pidfile_removed", pidfile=pidfile),
            )
            pidfile.unlink(missing_ok=True)
            return
        if pid_alive(pid) and self._is_postgres(pid):
            raise LocalServerError(
                f"another postgres (pid {pid}) is already running on {self.data_dir}"
            )
        _log.info(
            "removing stale %s (pid %s is gone)",
            pidfile,
            pid,
            extra=self._log_extra("local_postgres_pidfile_removed", pidfile=pidfile, pid=pid),
        )
        pidfile.unlink(missing_ok=True)

    def _check_port_free(self) -> None:
        """Refuse a port another server holds: our postgres would fail to bind it and
        die while the readiness check logged in to the other one (issue #28)."""
        if port_open(self.port, timeout=0.2):
            raise LocalServerError(
                f"port {self.port} on 127.0.0.1 is in use, so the local Postgres in "
                f"{self.data_dir} cannot listen there. Stop whatever holds it, or choose "
                "another port (--postgres-port; none: a free one)"
            )

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
        """Until the server answers on its own socket; then a cluster without a password
        file (made before the stack had passwords) gets one, and a login over TCP, with
        the password, must reach this very server."""
        assert self._proc is not None and self._socket_dir is not None
        socket_login = make_conninfo(
            host=str(self._socket_dir), port=self.port, user=_SUPERUSER, dbname="postgres"
        )
        deadline = time.monotonic() + _PG_START_TIMEOUT
        last_error: Exception | None = None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise LocalServerError(
                    f"postgres exited with code {rc} during startup; log {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            try:
                with db.connect(socket_login, connect_timeout=2) as conn:
                    if not self.passfile.exists():
                        self._set_password(conn)
            except (psycopg.Error, RelayError) as exc:
                last_error = exc
            else:
                self._check_is_ours()
                return
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"postgres on 127.0.0.1:{self.port} not ready after {_PG_START_TIMEOUT:.0f}s "
                    f"(last error: {last_error}); log {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def _set_password(self, conn: psycopg.Connection[Any]) -> None:
        password = secrets.token_urlsafe(24)
        # The SCRAM verifier is computed here: the password never reaches the server,
        # nor its log.
        verifier = conn.pgconn.encrypt_password(
            password.encode(), _SUPERUSER.encode(), b"scram-sha-256"
        )
        role = sql.Identifier(_SUPERUSER)
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(role, sql.Literal(verifier.decode()))
        )
        self._save_password(password)
        _log.info(
            "local postgres %s: the superuser now logs in with the password in %s",
            self.data_dir,
            self.passfile,
            extra=self._log_extra("local_postgres_password_set", passfile=self.passfile),
        )

    def _check_is_ours(self) -> None:
        """The server a TCP login reaches must be the one we started, not another one
        that took the port before ours could bind it."""
        try:
            with db.connect(self.url, connect_timeout=5) as conn:
                row = conn.execute("SELECT pg_catalog.current_setting('data_directory')").fetchone()
        except (psycopg.Error, RelayError) as exc:
            raise LocalServerError(
                f"port {self.port} on 127.0.0.1 refuses the local Postgres' own login "
                f"({exc}): another server holds it, or {self.passfile} is not this "
                "cluster's password. Stop the other server or choose another port "
                "(--postgres-port); or delete the password file to have a new one set"
            ) from exc
        data_directory = row[0] if row else ""
        if Path(data_directory).resolve() != self.data_dir.resolve():
            raise LocalServerError(
                f"port {self.port} on 127.0.0.1 is in use by another Postgres (data "
                f"directory {data_directory}), so the local Postgres in {self.data_dir} "
                "cannot listen there. Stop it, or choose another port (--postgres-port)"
            )

    def _kill_quietly(self) -> None:
        if self._proc is not None:
            signal_and_wait(self._proc, signal.SIGKILL, 5.0, "postgres")
            self._proc = None
        self.stop()
