#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs, then
#   ./dev.sh demo   the embedded stack (local Postgres + broker, relay, demo writer, live output)
#   ./dev.sh test   lint, type checks and the whole test suite (what CI runs)
#                   (./dev.sh test -m unit: only the tests that need no server; tests/README.md)
#   ./dev.sh bench  the benchmarks (bench/), each figure against a same-run baseline
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"

ensure_venv() {
    if [[ ! -x .venv/bin/python || pyproject.toml -nt .venv/.installed ]]; then
        "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
        "$PYTHON" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e '.[dev,spark,bench,tracing]'
        touch .venv/.installed
    fi
}

command="${1:-}"
[[ $# -gt 0 ]] && shift
case "$command" in
    demo)
        ensure_venv
        exec .venv/bin/outbox-relay dev "$@"
        ;;
    test)
        ensure_venv
        if [[ $# -eq 0 ]]; then  # the whole suite: the rules' and the chart's tests need
            # promtool and helm, built once (one after the other: two cores)
            (.venv/bin/python -m tests.plugins.promtool; .venv/bin/python -m tests.plugins.helm) >/dev/null 2>&1 &
        fi
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        .venv/bin/mypy
        exec .venv/bin/python -m pytest "$@"
        ;;
    bench)
        ensure_venv
        exec .venv/bin/python -m bench "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo [outbox-relay dev options] | ./dev.sh test [pytest options] | ./dev.sh bench [--scale quick|default|full] [--only ...]" >&2
        exit 2
        ;;
esac
