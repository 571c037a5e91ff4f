"""Pinned jars from Maven Central, checksum-verified and cached in the user's cache.

The local stack and the Spark jobs need Java programs (Apache Kafka's broker, Debezium
Server, Spark's Kafka connector). Their jars are listed, with their SHA-256, in a *lock file* next to
this module (``<name>.lock``): one ``group:artifact:version sha256`` line per jar, the
whole transitive set already resolved. Fetching is then a plain download of each listed
file, so a user needs neither Maven nor any resolution at run time, and the checksums
come from this repository, not from the server that serves the jars.

``python -m relay.artifacts.maven lock NAME`` re-resolves a lock file from the root
coordinates in its header, with Maven (``dependency:copy-dependencies``). A header line
``# exclude group:artifact`` leaves that artifact (and what only it pulls in) out: jars
the program that loads the lock already ships, such as those in pyspark's ``jars/``.

Files are cached under ``$XDG_CACHE_HOME/outbox-relay/maven`` (default
``~/.cache/outbox-relay/maven``) in Maven's repository layout. Once every file of a
lock is there and verified, nothing is downloaded again. ``RELAY_MAVEN_REPOSITORY``
names a mirror instead of Maven Central; ``RELAY_CACHE_DIR`` moves the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from relay.core.log_fields import log_extra
from relay.errors import RelayError

__all__ = [
    "Artifact",
    "ArtifactFetchError",
    "Lock",
    "cache_dir",
    "fetch_lock",
    "repository_url",
]

logger = logging.getLogger(__name__)

MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"
_LOCK_DIR = Path(__file__).resolve().parent
_CHUNK = 256 * 1024
_TIMEOUT_S = 60.0


class ArtifactFetchError(RelayError):
    """A pinned jar could not be downloaded, or its checksum did not match."""


Progress = Callable[[str], None]


@dataclass(frozen=True)
class Artifact:
    """One jar: Maven coordinates plus the SHA-256 this repository pins for it."""

    group: str
    name: str
    version: str
    sha256: str
    extension: str = "jar"  # a distribution archive: "tar.gz" (group:name:tar.gz:version)

    @property
    def coordinates(self) -> str:
        if self.extension != "jar":
            return f"{self.group}:{self.name}:{self.extension}:{self.version}"
        return f"{self.group}:{self.name}:{self.version}"

    @property
    def path(self) -> str:
        """The file's path in a Maven repository layout."""
        return (
            f"{self.group.replace('.', '/')}/{self.name}/{self.version}/"
            f"{self.name}-{self.version}.{self.extension}"
        )


@dataclass(frozen=True)
class Lock:
    """A lock file: its root coordinates and the resolved jars."""

    name: str
    roots: tuple[str, ...]
    artifacts: tuple[Artifact, ...]
    excludes: tuple[str, ...] = ()

    @classmethod
    def load(cls, name: str) -> Lock:
        """The lock file ``<name>.lock`` shipped with this package."""
        return cls.read(_LOCK_DIR / f"{name}.lock")

    @classmethod
    def read(cls, path: Path) -> Lock:
        roots: list[str] = []
        excludes: list[str] = []
        artifacts: list[Artifact] = []
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if line.startswith("# root "):
                roots.append(line.removeprefix("# root ").strip())
            if line.startswith("# exclude "):
                excludes.append(line.removeprefix("# exclude ").strip())
            if not line or line.startswith("#"):
                continue
            try:
                coordinates, sha256 = line.split()
                group, artifact, *extension, version = coordinates.split(":")
                (extension_name,) = extension or ["jar"]
            except ValueError as exc:
                raise ArtifactFetchError(f"{path}:{number}: malformed line {raw!r}") from exc
            artifacts.append(Artifact(group, artifact, version, sha256.lower(), extension_name))
        return cls(path.stem, tuple(roots), tuple(artifacts), tuple(excludes))

    def version_of(self, group: str, artifact: str) -> str:
        for a in self.artifacts:
            if (a.group, a.name) == (group, artifact):
                return a.version
        raise KeyError(f"{group}:{artifact} is not in the {self.name} lock")


def cache_dir() -> Path:
    """Where downloaded jars live (a Maven repository layout)."""
    explicit = os.environ.get("RELAY_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "maven"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-relay" / "maven"


def repository_url() -> str:
    return os.environ.get("RELAY_MAVEN_REPOSITORY", MAVEN_CENTRAL).rstrip("/")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stderr_progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fetch_lock(lock: str | Lock, *, progress: Progress | None = _stderr_progress) -> list[Path]:
    """Every jar of ``lock`` (a name or a Lock), downloaded if missing and verified; their
    local paths."""
    if isinstance(lock, str):
        lock = Lock.load(lock)
    name = lock.name
    root = cache_dir()
    paths = [root / a.path for a in lock.artifacts]
    missing = [(a, p) for a, p in zip(lock.artifacts, paths, strict=True) if not _verified(a, p)]
    if missing:
        total = len(missing)
        if progress:
            progress(f"fetching {total} jars for {name} from {repository_url()} into {root}")
        for done, (artifact, path) in enumerate(missing, start=1):
            _download(artifact, path, f"[{done}/{total}]", progress)
    return paths


def _verified(artifact: Artifact, path: Path) -> bool:
    """True when ``path`` exists with the pinned checksum (remembered in a sidecar)."""
    sidecar = path.with_name(path.name + ".sha256")
    try:
        if sidecar.read_text().strip() == artifact.sha256 and path.exists():
            return sidecar.stat().st_mtime >= path.stat().st_mtime
    except OSError:
        return False
    return False


def _download(artifact: Artifact, path: Path, label: str, progress: Progress | None) -> None:
    url = f"{repository_url()}/{artifact.path}"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".part-")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            size = _copy_url(url, out, artifact, label, progress)
        actual = _sha256(tmp)
        if actual != artifact.sha256:
            raise ArtifactFetchError(
                f"checksum mismatch for {artifact.coordinates} from {url}: expected "
                f"sha256 {artifact.sha256}, got {actual}; the download was discarded"
            )
        tmp.replace(path)
        path.with_name(path.name + ".sha256").write_text(artifact.sha256 + "\n")
        logger.debug(
            "fetched %s (%s bytes)",
            artifact.coordinates,
            size,
            extra=log_extra("artifact_fetched", artifact=artifact.coordinates, size=size),
        )
    finally:
        tmp.unlink(missing_ok=True)


def _copy_url(
    url: str, out: BinaryIO, artifact: Artifact, label: str, progress: Progress | None
) -> int:
    try:
        response = urllib.request.urlopen(url, timeout=_TIMEOUT_S)
    except (urllib.error.URLError, OSError) as exc:
        raise ArtifactFetchError(
            f"cannot download {artifact.coordinates} from {url}: {exc}. Is Maven Central "
            "reachable? Set RELAY_MAVEN_REPOSITORY to a mirror, or use a Kafka you already "
            "run instead of the local one (--bootstrap-servers, or "
            "OUTBOX_TEST_BOOTSTRAP_SERVERS for the tests)"
        ) from exc
    with response:
        total = int(response.headers.get("Content-Length") or 0)
        copied = 0
        last_report = 0.0
        while chunk := response.read(_CHUNK):
            out.write(chunk)
            copied += len(chunk)
            now = time.monotonic()
            if progress and (now - last_report > 1.0 or copied == total):
                last_report = now
                share = f"{100 * copied // total:3d}%" if total else f"{copied >> 10} KiB"
                progress(f"  {label} {artifact.coordinates}: {share} of {total >> 10} KiB")
    return copied


# --------------------------------------------------------------------------- re-locking


def relock(name: str) -> Path:
    """Resolve the roots of lock ``name`` with Maven and rewrite the lock file."""
    lock = Lock.load(name)
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ArtifactFetchError("re-locking needs Maven (mvn) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "pom.xml").write_text(_pom(lock.roots, lock.excludes))
        subprocess.run(
            [mvn, "-B", "-q", "-C", "-Dstyle.color=never", "dependency:copy-dependencies",
             f"-DoutputDirectory={work / 'libs'}", "-DincludeScope=runtime",
             "-Dmdep.useRepositoryLayout=true"],
            cwd=work, check=True,
        )  # fmt: skip
        artifacts = [
            _artifact_of(work / "libs", jar) for jar in sorted((work / "libs").rglob("*.jar"))
        ]
    path = _LOCK_DIR / f"{name}.lock"
    header = [f"# {name}: resolved by `python -m relay.artifacts.maven lock {name}`"]
    header += [f"# root {r}" for r in lock.roots]
    header += [f"# exclude {e}" for e in lock.excludes]
    body = [f"{a.coordinates} {a.sha256}" for a in sorted(artifacts, key=lambda a: a.coordinates)]
    path.write_text("\n".join(header + body) + "\n")
    return path


def _artifact_of(libs: Path, jar: Path) -> Artifact:
    parts = jar.relative_to(libs).parts
    group, name, version = ".".join(parts[:-3]), parts[-3], parts[-2]
    return Artifact(group, name, version, _sha256(jar))


def _pom(roots: tuple[str, ...], excludes: tuple[str, ...] = ()) -> str:
    exclusions = "".join(
        f"<exclusion><groupId>{group}</groupId><artifactId>{artifact}</artifactId></exclusion>"
        for group, artifact in (e.split(":") for e in excludes)
    )
    deps = []
    for root in roots:
        group, artifact, version = root.split(":")
        deps.append(
            f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
            f"<version>{version}</version><exclusions>{exclusions}</exclusions></dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>outbox-relay</groupId><artifactId>lock</artifactId><version>1</version>"
        f"<packaging>pom</packaging><dependencies>{''.join(deps)}</dependencies></project>"
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "lock":
        sys.stdout.write(f"{relock(argv[1])}\n")
        return 0
    if len(argv) == 2 and argv[0] == "fetch":
        sys.stdout.writelines(f"{path}\n" for path in fetch_lock(argv[1]))
        return 0
    sys.stderr.write("usage: python -m relay.artifacts.maven lock|fetch NAME\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
