#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs, then
#   ./dev.sh demo   the embedded stack (local Postgres + broker, relay, demo writer, live output)
#   ./dev.sh test   lint, type checks and the whole test suite (what CI runs)
#                   (./dev.sh test -m unit: only the tests that need no server; tests/README.md)
#   ./dev.sh bench  the benchmarks (bench/), each figure against a same-run baseline
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"

# What a command needs installed: the demo the relay alone (no Spark, no benchmark
# baselines: a fraction of the download); the tests and benchmarks every extra. Each set
# is installed once (again when pyproject.toml changes), pip saying what it fetches.
installed() {  # $1: a set's name; true when it (or everything) is installed and current
    local set
    for set in "$1" all; do
        [[ -f ".venv/.installed-$set" && ! pyproject.toml -nt ".venv/.installed-$set" ]] && return 0
    done
    return 1
}

ensure_venv() {  # $1: demo | all
    local set="$1" extras=""
    [[ "$set" == all ]] && extras="[dev,spark,bench,tracing]"
    [[ -x .venv/bin/python ]] && installed "$set" && return 0
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
    if [[ ! -x .venv/bin/python ]]; then
        echo "dev.sh: creating .venv" >&2
        "$PYTHON" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    echo "dev.sh: installing outbox-relay$extras into .venv (minutes the first time)" >&2
    .venv/bin/python -m pip install --progress-bar off --disable-pip-version-check -e ".$extras"
    touch ".venv/.installed-$set"
}

command="${1:-}"
[[ $# -gt 0 ]] && shift
case "$command" in
    demo)
        ensure_venv demo
        exec .venv/bin/outbox-relay dev "$@"
        ;;
    test)
        ensure_venv all
        if [[ $# -eq 0 ]]; then  # the whole suite: the rules' and the chart's tests need
            # promtool and helm, built once (one after the other: two cores)
            (.venv/bin/python -m tests.plugins.promtool; .venv/bin/python -m tests.plugins.helm) >/dev/null 2>&1 &
            set -- --durations=40  # CI's log names the slowest tests: the suite's time budget
        fi
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        .venv/bin/mypy
        exec .venv/bin/python -m pytest "$@"
        ;;
    bench)
        ensure_venv all
        exec .venv/bin/python -m bench "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo [outbox-relay dev options] | ./dev.sh test [pytest options] | ./dev.sh bench [--scale quick|default|full] [--only ...]" >&2
        exit 2
        ;;
esac
