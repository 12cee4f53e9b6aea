"""How long train.py's command line takes to answer: `python train.py --help` and a mistyped flag's one line, each a
whole process (the interpreter's start, the imports, the parse), timed from outside.

    python -m benchmarks.bench_cli [--runs 10] [--against OTHER_CHECKOUT]

Each command runs `--runs` times after one warm-up run (the files it reads in the page cache), in this checkout, and
with `--against` in another one too (e.g. `git worktree add /tmp/before <commit>`), the two in turn (A B A B ...), so
that a machine whose speed drifts slows both alike. Per command: the median wall and CPU seconds (user + sys, the
kernel's accounting of the finished child, `resource.getrusage(RUSAGE_CHILDREN)`), their range, and with `--against`
the median of the per-pair ratios A/B. CPU seconds are what a busy machine inflates least: quote them beside the wall.
docs/benchmarks.md has the figures ("The command line").
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {"--help": ["--help"], "a mistyped flag": ["--lerning_rate", "1"]}


def timed(checkout: Path, args: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of `python train.py *args` run in `checkout`, its output thrown away."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *args], cwd=checkout, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} s (min {min(values):.3f}, max {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="counted runs of each command in each checkout")
    parser.add_argument("--against", type=Path, default=None, help="another checkout, timed in turn with this one")
    args = parser.parse_args()
    checkouts = {"A": REPO} | ({"B": args.against.resolve()} if args.against else {})
    for name, path in checkouts.items():
        print(f"{name} = {path}")
    for label, command in COMMANDS.items():
        for path in checkouts.values():  # the warm-up
            timed(path, command)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in checkouts}
        for _ in range(args.runs):
            for name, path in checkouts.items():
                runs[name].append(timed(path, command))
        for name in checkouts:
            walls, cpus = [w for w, _ in runs[name]], [c for _, c in runs[name]]
            print(f"{label:16s} {name}: wall {spread(walls)} | cpu {spread(cpus)}")
        if "B" in runs:
            ratio = [a[0] / b[0] for a, b in zip(runs["A"], runs["B"])]
            cpu_ratio = [a[1] / b[1] for a, b in zip(runs["A"], runs["B"])]
            print(f"{label:16s} A/B: wall x{statistics.median(ratio):.3f}, cpu x{statistics.median(cpu_ratio):.3f} "
                  f"(medians of {args.runs} pairs)")


if __name__ == "__main__":
    main()
