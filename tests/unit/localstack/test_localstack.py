"""The local stack's Apache Kafka: jars fetched once and verified, and clear errors that
name the fix, without a JVM (tests/integration/test_localstack.py runs the broker)."""

from __future__ import annotations

import hashlib
import http.server
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.artifacts.maven import ArtifactFetchError, Lock, fetch_lock
from relay.localstack import LocalKafka, LocalServerError
from relay.localstack.kafka import find_java

JAR = b"PK\x03\x04 not really a jar, but bytes with a known checksum"


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """A tiny Maven repository over HTTP on loopback; yields its URL and the paths served."""
    root = tmp_path / "repo"
    target = root / "org/example/demo/1.0/demo-1.0.jar"
    target.parent.mkdir(parents=True)
    target.write_bytes(JAR)
    served: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            served.append(self.path)
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()


def _lock(tmp_path: Path, sha256: str) -> Lock:
    path = tmp_path / "demo.lock"
    path.write_text(f"# root org.example:demo:1.0\norg.example:demo:1.0 {sha256}\n")
    return Lock.read(path)


@pytest.fixture
def served(
    tmp_path: Path, repository: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """Jars come from ``repository`` into a cache of this test's own; the paths asked for."""
    url, paths = repository
    monkeypatch.setenv("RELAY_MAVEN_REPOSITORY", url)
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))
    return paths


def test_jars_are_fetched_once_verified_and_then_served_from_the_cache(
    tmp_path: Path, served: list[str]
) -> None:
    lock = _lock(tmp_path, hashlib.sha256(JAR).hexdigest())
    lines: list[str] = []

    first = fetch_lock(lock, progress=lines.append)
    again = fetch_lock(lock, progress=lines.append)

    assert first == again
    assert first[0].read_bytes() == JAR
    assert served == ["/org/example/demo/1.0/demo-1.0.jar"]  # once
    assert any("org.example:demo:1.0" in line and "100%" in line for line in lines)


def test_a_jar_with_the_wrong_checksum_is_refused_and_not_cached(
    tmp_path: Path, served: list[str]
) -> None:
    lock = _lock(tmp_path, "0" * 64)

    with pytest.raises(ArtifactFetchError, match=r"checksum mismatch for org\.example:demo:1\.0"):
        fetch_lock(lock, progress=None)
    assert not list((tmp_path / "cache").rglob("*.jar"))


def test_an_unreachable_repository_says_how_to_use_an_existing_kafka(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    monkeypatch.setenv("RELAY_MAVEN_REPOSITORY", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))

    with pytest.raises(ArtifactFetchError) as caught:
        fetch_lock(_lock(tmp_path, "0" * 64), progress=None)
    message = str(caught.value)
    assert "cannot download org.example:demo:1.0" in message
    assert "RELAY_MAVEN_REPOSITORY" in message
    assert "--bootstrap-servers" in message


def _fake_java(tmp_path: Path, version: str) -> Path:
    home = tmp_path / f"jdk-{version}"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2020-01-01' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return home


def test_too_old_or_missing_java_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path, "11.0.2")))
    with pytest.raises(LocalServerError, match=r"is Java 11; Apache Kafka .* needs Java 17"):
        LocalKafka(tmp_path / "k").start()

    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path, "1.8.0_392")))
    with pytest.raises(LocalServerError, match="is Java 8"):
        find_java()

    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(LocalServerError, match=r"no Java found .* set JAVA_HOME"):
        find_java()
