"""Get a GPU window ready, here on a CPU machine: fill `.lease/` with what `gpu_acceptance.py --lease` needs on the
device and the device image lacks, and print the one call to make there.

    python -m benchmarks.prepare_lease               # the HellaSwag file and DeepSpeed's wheels (pip reaches PyPI)
    python -m benchmarks.prepare_lease --no_wheels   # the HellaSwag file only: zero3 and memory_plan are skipped

`.lease/` is ignored by git, so it travels only when the call names it in `carry`. It holds:
- hellaswag_val_approx.jsonl.gz (from ../shared/assets, or --hellaswag_data): the hellaswag and memory_plan stages.
- wheels/: for CPython 3.12 on x86-64 Linux, what the image lacks:
  - for zero3: DeepSpeed, built here from its source release with no op compiled (a pure-Python wheel: on the device
    it builds the ops it uses with the image's nvcc and ninja), and its requirements (DEEPSPEED_NEEDS);
  - for memory_plan: evaluate and datasets (EVALUATE_NEEDS), since train.py's HellaSwag evaluation inside its runs
    reports accuracies with evaluate; at the versions installed here (both are core requirements of the project).
  No other stage needs a wheel: Tiny Shakespeare ships in data/, bench_hellaswag times the same forward passes
  without the accuracy metric, and train.py imports wandb only when asked to log there.
- acc/: the report (acceptance.json, .md, and the sweep's rows, sweep.jsonl). Copy what a call brought back into it,
  and the next call goes on with the stages not yet passed. This script never deletes it.

The device takes at most 64 MiB of checkout (tracked files, untracked ones git does not ignore, and `.lease`): the
script adds them up and refuses a folder over that.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_acceptance import HELLASWAG_NAME, HELLASWAG_PLACES, LEASE_CALL_S, ROOT
from common.errors import print_error

LEASE_DIR = ROOT / ".lease"
DEVICE_TREE_LIMIT = 64 * 2**20
# DeepSpeed's requirements that the device image (docs/benchmarks.md) does not hold; pydantic-core is added at the
# version the pydantic wheel pins.
DEEPSPEED_NEEDS = ("hjson", "pydantic", "annotated-types", "typing-inspection")
# evaluate with what it needs that the image lacks (pyarrow, pandas, xxhash, fsspec and huggingface_hub are there).
EVALUATE_NEEDS = ("evaluate", "datasets", "dill", "multiprocess")
# pip download's target: the device image's Python and platform.
DEVICE_PYTHON = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
# Where the call installs the wheels there (the device README's recipe).
DEVICE_SITE = "/tmp/site"


class PrepareError(Exception):
    """What is wrong and what to do, in one line."""


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise PrepareError(f"pip {args[0]} {args[-1]} failed ({last}); check that pip reaches PyPI, or run with "
                           "--no_wheels (zero3 and memory_plan are then skipped on the device)")


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pinned_requirement(wheel: Path, name: str) -> str:
    """The `name==version` a wheel's METADATA pins (pydantic pins its pydantic-core exactly)."""
    import zipfile
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    pin = re.search(rf"^Requires-Dist: {re.escape(name)}\s*\(?==\s*([\w.]+)", text, re.M | re.I)
    if pin is None:
        raise PrepareError(f"{wheel.name} pins no version of {name}; pass --no_wheels and report this")
    return f"{name}=={pin[1]}"


def pinned(name: str) -> str:
    """`name==version` at the version installed here, else the newest `name`."""
    version = installed_version(name)
    return f"{name}=={version}" if version else name


def fill_wheels(wheels: Path) -> list[Path]:
    """DeepSpeed (the version installed here, else the newest) as a pure-Python wheel, evaluate, and what they need
    that the image lacks; an earlier call's wheels are replaced, since two versions of one package stop the install."""
    for missing in ("setuptools", "wheel"):
        if installed_version(missing) is None:
            raise PrepareError(f"building DeepSpeed's wheel needs {missing} here; pip install setuptools wheel "
                               "(the dev extra has both), or run with --no_wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    # DS_BUILD_OPS=0: no op compiled here (they would be this CPU's); its setup.py imports the torch installed here.
    pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), pinned("deepspeed"),
        env={"DS_BUILD_OPS": "0"})
    names = [pinned(n) for n in DEEPSPEED_NEEDS + EVALUATE_NEEDS]
    pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *DEVICE_PYTHON, "-d", str(wheels), *names)
    pydantic_wheel = next(wheels.glob("pydantic-*.whl"))
    pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *DEVICE_PYTHON, "-d", str(wheels),
        pinned_requirement(pydantic_wheel, "pydantic-core"))
    return sorted(wheels.glob("*.whl"))


def travelling_bytes(folder: Path) -> int:
    """What a device call sends: the checkout's tracked files, the untracked ones git does not ignore, and `folder`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    total = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    return total + sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def device_command(folder: str, with_wheels: bool) -> str:
    """The command for the device tool's `run`, from the repo root there."""
    install = ""
    if with_wheels:
        install = (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                   f"{DEVICE_SITE} {folder}/wheels/*.whl && export PYTHONPATH={DEVICE_SITE} || exit; ")
    return (f"{install}PYTHONUNBUFFERED=1 python3 benchmarks/gpu_acceptance.py --lease --out {folder}/acc "
            f"--hellaswag_data {folder}/{HELLASWAG_NAME}; cp {folder}/acc/* $OUT/")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hellaswag_data",
                   help=f"the HellaSwag file to carry; default: {HELLASWAG_NAME} in ../shared/assets")
    p.add_argument("--no_wheels", action="store_true",
                   help="carry no wheel: the zero3 and memory_plan stages are skipped there")
    p.add_argument("--folder", default=str(LEASE_DIR), help=argparse.SUPPRESS)  # tests: a folder outside the checkout
    args = p.parse_args(argv)
    folder = Path(args.folder)
    try:
        source = Path(args.hellaswag_data) if args.hellaswag_data else next(
            (q for q in HELLASWAG_PLACES if q.exists()), HELLASWAG_PLACES[0])
        if not source.is_file():
            raise PrepareError(f"no HellaSwag file at {source}; pass --hellaswag_data PATH "
                               f"(the shared assets hold {HELLASWAG_NAME})")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "acc").mkdir(exist_ok=True)
        shutil.copyfile(source, folder / HELLASWAG_NAME)
        wheels = [] if args.no_wheels else fill_wheels(folder / "wheels")
        if args.no_wheels:
            shutil.rmtree(folder / "wheels", ignore_errors=True)  # a wheel left from before would still travel
        size = travelling_bytes(folder)
        if size > DEVICE_TREE_LIMIT:
            raise PrepareError(f"the checkout and {folder.name}/ come to {size / 2**20:.1f} MiB, over the device's "
                               f"{DEVICE_TREE_LIMIT / 2**20:.0f} MiB; run with --no_wheels or remove large untracked "
                               "files")
    except PrepareError as err:
        print_error(str(err))
        return 2
    rel = os.path.relpath(folder, ROOT) if folder.is_relative_to(ROOT) else str(folder)
    print(f"Filled {folder}: {HELLASWAG_NAME}" + "".join(f", {w.name}" for w in wheels))
    print(f"What travels: {size / 2**20:.1f} MiB of {DEVICE_TREE_LIMIT / 2**20:.0f}.")
    print("On the device tool, one call (run):")
    print(f"  command:   {device_command(rel, bool(wheels))}")
    print(f'  carry:     ["{rel}"]')
    print(f"  timeout_s: {LEASE_CALL_S:.0f} (the stages end a minute before it)")
    print(f"Then copy the returned acceptance.json and sweep.jsonl into {rel}/acc/: the same command again goes on "
          "from them (a window's first call runs the sweep, its second the acceptance stages; add --budget S to the "
          "second for the device time left).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
