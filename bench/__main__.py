"""Run the benchmarks on the embedded stack and report every figure against its baseline.

    ./dev.sh bench [--scale quick|default|full] [--only throughput,latency,...]
    ./dev.sh bench --only soak [--scale quick]     # the retention soak, on request
    ./dev.sh bench --only cluster [--scale quick]  # broker faults on 3 nodes, on request
    ./dev.sh bench --only cut [--scale quick]      # one relay cut off, on request
    ./dev.sh bench --only spark_sinks [--scale quick]  # Delta vs Parquet on a Spark cluster

Prints a table and writes bench/results/bench-<time>.json and bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Figure, Scale, Stack, report

logger = logging.getLogger("bench")
BENCHMARKS = (
    "throughput",
    "latency",
    "debezium",
    "writes",
    "write_path",
    "probe_load",
    "write_costs",
    "growth",
    "fanout",
    "fanout_fetch",
    "bounded",
    "sharding",
    "spark",
    "large_rows",
    "deadletters",
    "soak",
    "tracing",
    "cluster",
    "cut",
    "eos_phases",
    "levers",
    "fetch_cost",
    "spark_sinks",
)
# Run only when named (--only soak): the soak takes 8 minutes at the default scale, the
# cluster's faults about 20, the cuts about 15, spark_sinks 10 spark-submits to a Spark
# cluster of its own; eos_phases, levers and fetch_cost are diagnoses (bench/RESULTS.md),
# not figures with targets.
ON_REQUEST = ("soak", "cluster", "cut", "eos_phases", "levers", "fetch_cost", "spark_sinks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=("quick", "default", "full"), default="default")
    parser.add_argument(
        "--only",
        default=",".join(b for b in BENCHMARKS if b not in ON_REQUEST),
        help=f"comma-separated subset of {', '.join(BENCHMARKS)} (default: all but "
        f"{', '.join(ON_REQUEST)})",
    )
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="run Postgres with fsync off (faster, less like production)",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(
            f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    scale = Scale.named(args.scale)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    workdir.chmod(0o755)
    figures: list[Figure] = []
    failed: list[str] = []
    try:
        with Stack(workdir, fsync=not args.no_fsync) as stack:
            for name in chosen:
                print(f"== {name}", file=sys.stderr, flush=True)
                module = importlib.import_module(f"bench.{name}")
                try:
                    stack.fresh_broker()
                    figures.extend(module.run(stack, scale))
                except Exception:
                    logger.exception("benchmark %s failed", name)
                    failed.append(name)
    finally:
        # The stack's data (16 GB after a default-scale throughput run): left behind by
        # every run, it filled /tmp within days.
        shutil.rmtree(workdir, ignore_errors=True)
    path = report(figures, scale=args.scale, started=started)
    print(f"\nresults: {path}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
