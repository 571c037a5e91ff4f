"""deploy/prometheus/alerts.yml under Prometheus's own checker, promtool (the ``promtool``
fixture, tests/plugins/promtool.py): the rules load, and their unit tests in
alerts.test.yml pass (each alert fires when its cause is there, and not otherwise), as
the deploy README tells operators to run them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.plugins.promtool import run_promtool

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"

# The first use builds promtool (tests/plugins/promtool.py): minutes on a busy machine.
pytestmark = pytest.mark.timeout(1800)


def test_the_rules_load_and_pass_their_unit_tests(promtool: Path) -> None:
    checked = run_promtool(promtool, "check", "rules", PROMETHEUS / "alerts.yml")
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    tested = run_promtool(promtool, "test", "rules", PROMETHEUS / "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_unit_tests_fail_a_rule_that_misses_a_dead_letter(
    promtool: Path, tmp_path: Path
) -> None:
    """Without its second clause, the dead-letter rule misses the dead letters a relay
    counted before the first scrape of a part's series (a takeover, a new pod): the
    unit tests say so."""
    rules = (PROMETHEUS / "alerts.yml").read_text()
    second_clause = rules.index("          or sum by (subscriber) (\n")
    end = rules.index("          ) > 0\n", second_clause) + len("          ) > 0\n")
    (tmp_path / "alerts.yml").write_text(rules[:second_clause] + rules[end:])
    shutil.copy(PROMETHEUS / "alerts.test.yml", tmp_path)
    assert run_promtool(promtool, "check", "rules", tmp_path / "alerts.yml").returncode == 0
    tested = run_promtool(promtool, "test", "rules", tmp_path / "alerts.test.yml")
    assert tested.returncode != 0
    assert 'subscriber="billing"' in tested.stdout + tested.stderr
