"""The Apicurio Registry build is pinned: its lock file parses, and a built application
whose jars differ from the lock is refused (relay/localstack/registry.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from relay.localstack import registry
from relay.localstack.process import LocalServerError
from relay.localstack.registry import REGISTRY_VERSION, RegistryLock


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _build(tmp_path: Path, jars: dict[str, bytes], app: bytes = b"app") -> tuple[Path, Path]:
    target, repo = tmp_path / "target", tmp_path / "m2"
    (target / "lib").mkdir(parents=True)
    for name, data in jars.items():
        (target / "lib" / name).write_bytes(data)
    app_jar = registry._app_jar(repo)
    app_jar.parent.mkdir(parents=True)
    app_jar.write_bytes(app)
    return target, repo


def test_the_shipped_lock_pins_the_versions_and_every_jar() -> None:
    lock = RegistryLock.load()
    assert lock.versions["apicurio-registry"] == REGISTRY_VERSION
    assert {"quarkus", "config-index", "everit-json-schema"} <= set(lock.versions)
    assert registry._APP_JAR in lock.files
    assert len(lock.files) > 100
    assert all(len(sha) == 64 for sha in lock.files.values())


def test_a_build_matching_the_lock_is_accepted(tmp_path: Path) -> None:
    target, repo = _build(tmp_path, {"a-1.jar": b"a"})
    lock = RegistryLock({}, {"a-1.jar": _sha(b"a"), registry._APP_JAR: _sha(b"app")})
    registry._verify(target, repo, lock)


@pytest.mark.parametrize(
    ("jars", "what"),
    [
        ({"a-1.jar": b"tampered"}, "a-1.jar"),  # changed bytes
        ({"a-1.jar": b"a", "extra-2.jar": b"x"}, "extra-2.jar"),  # not pinned
        ({}, "a-1.jar"),  # missing
    ],
)
def test_a_build_that_differs_from_the_lock_is_refused(
    tmp_path: Path, jars: dict[str, bytes], what: str
) -> None:
    target, repo = _build(tmp_path, jars)
    lock = RegistryLock({}, {"a-1.jar": _sha(b"a"), registry._APP_JAR: _sha(b"app")})
    with pytest.raises(LocalServerError, match=what):
        registry._verify(target, repo, lock)
