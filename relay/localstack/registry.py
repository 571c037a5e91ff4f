"""Apicurio Registry as a local process: a real schema registry, with the Confluent
compatible API (``/apis/ccompat/v7``), for the tests of the schema-registry value format.

Apicurio publishes its application to Maven Central as a plain jar (no runnable
distribution), so it is *built* here once with Quarkus's Maven plugin: a generated
``pom.xml`` depends on ``apicurio-registry-app``, unpacks it as its own classes and runs
``quarkus:build``. The build is pinned by ``apicurio-registry.lock`` beside this module:
its header names the versions, and every jar of the built application (``lib/``) plus the
application jar itself must have the SHA-256 listed there, or the build is discarded.
Maven runs with ``--strict-checksums`` (Central's published checksums) and a mirror that
sends every repository a POM declares to Maven Central (or ``RELAY_MAVEN_REPOSITORY``).

Why 2.4.2.Final, not the 3.x the issue asked for: Apicurio 3.x cannot be built here.
``io.apicurio:apicurio-registry-app:3.3.3`` resolves from Maven Central, but its
dependency tree does not: ``io.apicurio:apicurio-registry-schema-util-provider:3.3.3``
and ``io.quarkus:quarkus-undertow:3.33.3.1`` answer 404, and 2.6.13.Final fails the same
way. 2.4.2.Final is the newest release whose whole dependency set Maven Central serves,
and it serves the same Confluent-compatible API (``/apis/ccompat/v7``) the relay and the
tests use. Two adjustments make it
resolvable from Central alone: ``org.everit.json.schema`` (JitPack only) is replaced by
the same library's Central coordinates ``com.github.erosb:everit-json-schema``, and the
``config-index`` Quarkus extension is taken at 0.1.10.Final, the one version whose
deployment module is on Central. Storage is the default of that version: H2 in memory,
so each start is an empty registry.

Costs (2 cores): the first build downloads ~800 jars (~300 MB) into
``<cache>/apicurio-registry/<version>/m2`` and takes a few minutes; the built application
(~130 MB) is kept in ``<cache>/apicurio-registry/<version>/app`` and later builds are
skipped. A start takes some 15-40 s of JVM and Quarkus boot. Needs Maven (``mvn``) for
the one build and Java 17 or newer to run.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from relay.artifacts.maven import cache_dir, repository_url
from relay.core.log_fields import log_extra
from relay.localstack.kafka import find_java
from relay.localstack.process import (
    LocalServer,
    LocalServerError,
    free_port,
    log_tail,
    reaper,
    signal_and_wait,
    spawn,
)

__all__ = ["REGISTRY_VERSION", "LocalRegistry", "RegistryLock", "registry_app"]

_log = logging.getLogger(__name__)

_LOCK_PATH = Path(__file__).resolve().parent / "apicurio-registry.lock"
_APP_JAR = "app:apicurio-registry-app.jar"  # the lock's name for the application jar
_CHUNK = 256 * 1024
_JVM_OPTIONS = ("-Xmx384m", "-XX:+ExitOnOutOfMemoryError", "-XX:TieredStopAtLevel=1")
_BUILD_TIMEOUT_S = 1800.0
_START_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RegistryLock:
    """``apicurio-registry.lock``: the pinned versions (``# key value`` header lines) and
    the SHA-256 of each file of the built application (``name sha256`` lines)."""

    versions: dict[str, str]
    files: dict[str, str]

    @classmethod
    def load(cls, path: Path = _LOCK_PATH) -> RegistryLock:
        versions: dict[str, str] = {}
        files: dict[str, str] = {}
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if line.startswith("# pin "):
                key, value = line.removeprefix("# pin ").split()
                versions[key] = value
            if not line or line.startswith("#"):
                continue
            try:
                name, sha256 = line.split()
            except ValueError as exc:
                raise LocalServerError(f"{path}:{number}: malformed line {raw!r}") from exc
            files[name] = sha256.lower()
        return cls(versions, files)


_LOCK = RegistryLock.load()
REGISTRY_VERSION = _LOCK.versions["apicurio-registry"]


def _home() -> Path:
    return cache_dir().parent / "apicurio-registry" / REGISTRY_VERSION


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- build


def _pom(pins: dict[str, str]) -> str:
    app = f"<groupId>io.apicurio</groupId><artifactId>apicurio-registry-app</artifactId><version>{pins['apicurio-registry']}</version>"
    index = "<groupId>io.apicurio</groupId><artifactId>apicurio-common-app-components-config-index"
    index_version = f"<version>{pins['config-index']}</version>"
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>outbox-relay</groupId><artifactId>apicurio-registry-local</artifactId><version>1</version>
<properties><project.build.sourceEncoding>UTF-8</project.build.sourceEncoding></properties>
<dependencyManagement><dependencies>
<dependency>{index}</artifactId>{index_version}</dependency>
<dependency>{index}-deployment</artifactId>{index_version}</dependency>
<dependency><groupId>io.apicurio</groupId><artifactId>apicurio-registry</artifactId><version>{pins["apicurio-registry"]}</version><type>pom</type><scope>import</scope></dependency>
</dependencies></dependencyManagement>
<dependencies>
<dependency>{app}<exclusions><exclusion><groupId>com.github.everit-org.json-schema</groupId><artifactId>org.everit.json.schema</artifactId></exclusion></exclusions></dependency>
<dependency><groupId>com.github.erosb</groupId><artifactId>everit-json-schema</artifactId><version>{pins["everit-json-schema"]}</version></dependency>
</dependencies>
<build><plugins>
<plugin><groupId>org.apache.maven.plugins</groupId><artifactId>maven-dependency-plugin</artifactId><version>{pins["maven-dependency-plugin"]}</version>
<executions><execution><id>unpack-app</id><phase>process-classes</phase><goals><goal>unpack</goal></goals>
<configuration><artifactItems><artifactItem>{app}<outputDirectory>${{project.build.outputDirectory}}</outputDirectory></artifactItem></artifactItems></configuration>
</execution></executions></plugin>
<plugin><groupId>io.quarkus</groupId><artifactId>quarkus-maven-plugin</artifactId><version>{pins["quarkus"]}</version>
<executions><execution><goals><goal>build</goal></goals></execution></executions></plugin>
</plugins></build></project>
"""


def _settings() -> str:
    # Some POMs of the tree declare other repositories (JitPack, Eclipse's): one mirror
    # for all of them keeps every download on the registry the project may use.
    return (
        "<settings><mirrors><mirror><id>relay-central</id><mirrorOf>*</mirrorOf>"
        f"<url>{repository_url()}</url></mirror></mirrors></settings>\n"
    )


def registry_app() -> Path:
    """The built application's directory (runner jar + ``lib/``), built on first use.

    Builds are serialised with a file lock: the cache is shared by every session and
    test run of the machine."""
    home = _home()
    app = home / "app"
    if _marker_matches(app / ".verified", _lock_digest()):
        return app
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalServerError(
            "building Apicurio Registry needs Maven (mvn) on PATH, once; "
            "install it (Debian: apt-get install maven)"
        )
    home.mkdir(parents=True, exist_ok=True)
    with (home / ".build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes
        if _marker_matches(app / ".verified", _lock_digest()):
            return app  # another process built it meanwhile
        _build_into(app, mvn, home, verify_lock=True)
    return app


def _build_into(app: Path, mvn: str, home: Path, *, verify_lock: bool) -> None:
    staging = Path(tempfile.mkdtemp(dir=home, prefix=".build-"))
    try:
        target = _maven_build(mvn, staging, home / "m2")
        if verify_lock:
            _verify(target, home / "m2", _LOCK)
        built = staging / "app"
        built.mkdir()
        (target / "lib").rename(built / "lib")
        (target / "apicurio-registry-local-1-runner.jar").rename(built / "registry-runner.jar")
        (built / ".verified").write_text(_lock_digest())
        shutil.rmtree(app, ignore_errors=True)
        built.rename(app)  # a half-built tree is never taken for a whole one
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _lock_digest() -> str:
    return hashlib.sha256(_LOCK_PATH.read_bytes()).hexdigest()


def _pins_digest() -> str:
    return hashlib.sha256(repr(sorted(_LOCK.versions.items())).encode()).hexdigest()


def _marker_matches(marker: Path, digest: str) -> bool:
    try:
        return marker.read_text().strip() == digest
    except OSError:
        return False


def _maven_build(mvn: str, work: Path, repo: Path) -> Path:
    (work / "pom.xml").write_text(_pom(_LOCK.versions))
    (work / "settings.xml").write_text(_settings())
    # Offline once a build with these pins completed: the repository holds every file.
    offline = ["--offline"] if _marker_matches(repo / ".complete", _pins_digest()) else []
    argv = [mvn, "-B", "-q", "--strict-checksums", "-Dstyle.color=never", *offline,
            "-s", str(work / "settings.xml"), f"-Dmaven.repo.local={repo}",
            "-DskipTests", "-Dquarkus.analytics.disabled=true", "package"]  # fmt: skip
    _log.info(
        "building Apicurio Registry %s with Maven (first use: minutes)",
        REGISTRY_VERSION,
        extra=log_extra("local_registry_building", version=REGISTRY_VERSION),
    )
    log = work / "maven.log"
    with log.open("wb") as out:
        try:
            done = subprocess.run(
                argv,
                check=False,
                cwd=work,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=_BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalServerError(f"Maven build timed out; its log:\n{log_tail(log)}") from exc
    if done.returncode != 0:
        raise LocalServerError(
            f"building Apicurio Registry {REGISTRY_VERSION} failed (mvn exit "
            f"{done.returncode}); its log:\n{log_tail(log)}"
        )
    repo.joinpath(".complete").write_text(_pins_digest())
    return work / "target"


def _app_jar(repo: Path) -> Path:
    version = REGISTRY_VERSION
    return repo / f"io/apicurio/apicurio-registry-app/{version}/apicurio-registry-app-{version}.jar"


def _verify(target: Path, repo: Path, lock: RegistryLock) -> None:
    """Every file of the built application has its pinned SHA-256, and none is missing."""
    actual = {jar.name: _sha256(jar) for jar in (target / "lib").glob("*.jar")}
    actual[_APP_JAR] = _sha256(_app_jar(repo))
    wrong = sorted(n for n in actual if lock.files.get(n) != actual[n])
    missing = sorted(set(lock.files) - set(actual))
    if wrong or missing:
        raise LocalServerError(
            f"the Apicurio Registry build does not match {_LOCK_PATH.name}: unpinned or "
            f"changed {wrong[:10]}, missing {missing[:10]}; the build was discarded"
        )


def relock() -> Path:
    """Rebuild without the check and rewrite the lock's file lines from the result."""
    header = [line for line in _LOCK_PATH.read_text().splitlines() if line.startswith("#")]
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalServerError("re-locking needs Maven (mvn) on PATH")
    home = _home()
    home.mkdir(parents=True, exist_ok=True)
    app = home / "app"
    _build_into(app, mvn, home, verify_lock=False)
    files = {jar.name: _sha256(jar) for jar in sorted((app / "lib").glob("*.jar"))}
    files[_APP_JAR] = _sha256(_app_jar(home / "m2"))
    _LOCK_PATH.write_text("\n".join(header + [f"{n} {s}" for n, s in files.items()]) + "\n")
    (app / ".verified").write_text(_lock_digest())
    return _LOCK_PATH


# --------------------------------------------------------------------------- server


class LocalRegistry(LocalServer):
    """Apicurio Registry on 127.0.0.1 (a free port), storage in memory; its log in
    ``work_dir``. :attr:`ccompat_url` is the Confluent-compatible API."""

    def __init__(self, work_dir: Path, port: int | None = None) -> None:
        self.work_dir = Path(work_dir).absolute()
        self.port = port or free_port()
        self.log_path = self.work_dir / "registry.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"LocalRegistry(port={self.port}, work_dir={str(self.work_dir)!r})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ccompat_url(self) -> str:
        """The Confluent Schema Registry compatible API (``schema.registry.url``)."""
        return f"{self.url}/apis/ccompat/v7"

    def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Start the registry and wait until it reports ready."""
        if self.running:
            return
        app = registry_app()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        java, _ = find_java()
        argv = [java, *_JVM_OPTIONS,
                "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={self.port}",
                "-jar", str(app / "registry-runner.jar")]  # fmt: skip
        _log.info(
            "starting Apicurio Registry %s on %s",
            REGISTRY_VERSION,
            self.url,
            extra=log_extra("local_registry_starting", version=REGISTRY_VERSION, url=self.url),
        )
        with self.log_path.open("ab") as out:
            self._proc = spawn(argv, out, cwd=self.work_dir)
        reaper.add(self)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not _answers(f"{self.url}/health/ready"):
            if self._proc is None or self._proc.poll() is not None:
                raise LocalServerError(
                    f"Apicurio Registry exited before it was ready; its log:\n"
                    f"{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"Apicurio Registry was not ready within {timeout:.0f}s; its log:\n"
                    f"{log_tail(self.log_path)}"
                )
            time.sleep(0.3)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        if self._proc is not None:
            signal_and_wait(self._proc, signal.SIGTERM, timeout, "apicurio-registry")
            self._proc = None
        reaper.discard(self)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    if argv == ["lock"]:
        sys.stdout.write(f"{relock()}\n")
        return 0
    if argv == ["build"]:
        sys.stdout.write(f"{registry_app()}\n")
        return 0
    sys.stderr.write("usage: python -m relay.localstack.registry build|lock\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
