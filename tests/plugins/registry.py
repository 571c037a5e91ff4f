"""A real schema registry for the session (``schema_registry``): the Confluent-compatible
API of Apicurio Registry, built once from Maven Central and started as a local process
(:mod:`relay.localstack.registry`), or an external one named by
``OUTBOX_TEST_SCHEMA_REGISTRY_URL`` (any Confluent Schema Registry compatible URL).

The registry keeps its schemas in memory: it starts empty each session, and tests name
their own subjects (``topic_prefix``) because the session shares it.

``standin_registry``: a stand-in in front of it that misbehaves on cue (issues #47 and
#49: the relay against a broken or hostile registry), forwarding everything else.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from relay.localstack.registry import LocalRegistry

_log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of the session's schema registry, as ``schema.registry.url`` takes it."""
    external = os.environ.get("OUTBOX_TEST_SCHEMA_REGISTRY_URL")
    if external:
        yield external
        return
    registry = LocalRegistry(tmp_path_factory.mktemp("registry"))
    started = time.monotonic()
    with registry:
        _log.info("Apicurio Registry started in %.1fs", time.monotonic() - started)
        yield registry.ccompat_url


# -- a registry that misbehaves on cue ------------------------------------------------

# What the stand-in answers a request: a status and a JSON body, or a function of the
# request (method, path, body) that may reach the real registry (``StandinRegistry.forward``).
Answer = tuple[int, Any] | Callable[[str, str, bytes], tuple[int, bytes]]


@dataclass
class _Script:
    method: str
    path: re.Pattern[str]
    answers: list[Answer]
    until_healed: bool


class StandinRegistry:
    """A stand-in for a schema registry, on a free port: it answers what a test scripts
    (:meth:`script`: an id of -7, the id of another schema, a 500 with a hostile body,
    a 409) and forwards every other request to the real registry behind it, so that
    the relay, the stock deserializer and the test see one registry. The registry is a
    peer the relay does not control; this is how a broken or hostile one behaves."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request
        self._scripts: list[_Script] = []
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, reply = standin.answer(self.command, self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test's output is its own

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def script(self, method: str, path: str, *answers: Answer, until_healed: bool = True) -> None:
        """Answer requests of ``method`` whose path matches the regular expression
        ``path`` with ``answers`` in turn; the last one again until :meth:`heal` (or,
        without ``until_healed``, forward once they are used up)."""
        with self._lock:
            self._scripts.append(_Script(method, re.compile(path), list(answers), until_healed))

    def heal(self) -> None:
        """Forward every request from now on."""
        with self._lock:
            self._scripts.clear()

    def count(self, method: str, path: str) -> int:
        """Requests seen of ``method`` whose path matches ``path``."""
        with self._lock:
            return sum(1 for m, p in self.seen if m == method and re.search(path, p))

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        with self._lock:
            self.seen.append((method, path))
            chosen = self._next(method, path)
        if chosen is None:
            return self.forward(method, path, body)
        if callable(chosen):
            return chosen(method, path, body)
        status, document = chosen
        return status, json.dumps(document).encode()

    def _next(self, method: str, path: str) -> Answer | None:
        for script in self._scripts:
            if script.method == method and script.path.search(path) and script.answers:
                if len(script.answers) > 1 or not script.until_healed:
                    return script.answers.pop(0)
                return script.answers[0]
        return None

    def forward(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """The real registry's answer to the request."""
        request = urllib.request.Request(
            self.upstream + path,
            data=body or None,
            method=method,
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture
def standin_registry(schema_registry: str) -> Iterator[StandinRegistry]:
    """A :class:`StandinRegistry` in front of the session's real registry."""
    standin = StandinRegistry(schema_registry)
    yield standin
    standin.close()
