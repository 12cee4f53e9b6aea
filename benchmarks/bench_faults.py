"""The fault cases of issue 35, each run again and again: how often does each pass? (Not in CI, which runs each once.)

    python -m benchmarks.bench_faults [--rounds 10] [-k EXPR]

One round is one pytest session over the multi-process cases of tests/test_elastic.py (a worker killed between
checkpoints, in a save, in an evaluation; a hung worker; an error on one rank, with and without restarts; a crash on
one rank with restarts; a worker killed more often than the restarts allow) and the two-node SLURM restart of
tests/test_slurm.py, so that the uninterrupted references are built once per round. Each case bounds its own hangs
(the hung worker: the timeout + 60 s; every launch: 600 s). Prints, per case, the passes out of the rounds run, and
the failures' first lines. CPU-heavy (two training processes at a time): run it on a quiet machine; about 5 minutes
a round on 2 idle cores.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ["tests/test_elastic.py",
         "tests/test_slurm.py::test_a_worker_killed_on_node_1_restarts_both_nodes_and_ends_exactly"]


def one_round(k: str | None) -> dict[str, str]:
    """Each case's outcome (PASSED, FAILED, ERROR) in one pytest session."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "multiprocess", *CASES]
    if k:
        cmd += ["-k", k]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    outcomes = {}
    for line in proc.stdout.splitlines():
        if m := re.match(r"(PASSED|FAILED|ERROR) (\S+)", line):
            outcomes[m.group(2)] = m.group(1)
    if not outcomes:
        outcomes["(the session)"] = f"ERROR: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("-k", default=None, help="pytest -k expression: only these cases")
    args = parser.parse_args()
    passes: Counter[str] = Counter()
    runs: Counter[str] = Counter()
    for n in range(1, args.rounds + 1):
        start = time.monotonic()
        outcomes = one_round(args.k)
        for case, outcome in outcomes.items():
            runs[case] += 1
            passes[case] += outcome == "PASSED"
        failed = [c for c, o in outcomes.items() if o != "PASSED"]
        print(f"round {n}: {len(outcomes) - len(failed)}/{len(outcomes)} passed in {time.monotonic() - start:.0f} s"
              + (f"; not passed: {', '.join(failed)}" if failed else ""), flush=True)
    for case in sorted(runs):
        print(f"{passes[case]:3d}/{runs[case]:<3d} {case}")


if __name__ == "__main__":
    main()
