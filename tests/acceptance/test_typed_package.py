"""The library is typed for applications (#34 item 7): ``relay`` ships a ``py.typed``
marker, so an application's mypy reads ``from relay import Outbox`` as the real class
instead of skipping the package as untyped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

APP = """\
from relay import Outbox, SchemaFolder


def publish(outbox: Outbox, schemas: SchemaFolder) -> None:
    reveal_type(outbox)
"""


def test_an_applications_mypy_sees_the_outbox_as_typed(tmp_path: Path) -> None:
    # The app lives outside the repository, so mypy finds relay as an installed package
    # (the only way an application finds it), not as source beside the app.
    (tmp_path / "app.py").write_text(APP)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--python-executable", sys.executable, "app.py"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "missing library stubs or py.typed marker" not in run.stdout, run.stdout
    assert 'Revealed type is "relay.write.outbox.Outbox"' in run.stdout, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
