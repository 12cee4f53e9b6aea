"""The model card and training curves of a run, on disk, without the Hub.

    python -m publish.card --run_dir out/my_run                         # into out/my_run/final/
    python -m publish.card --run_dir out/my_run --output export/        # an unfinished run: newest checkpoint
    python -m publish.card --run_dir out/my_run/checkpoints/step_000500 --output export/

Writes README.md and loss_curve.png (train/val loss, HellaSwag when measured, learning rate), the same
files a Hub push uploads (`publish.card_content`), into a finished run's `final/`; or exports an unfinished
run's newest checkpoint, or a given checkpoint, as an HF model folder with its card into `--output`.
The trainer calls `write_card` at the end of every finished run. Offline: with no `--hub_model_id` the
card is named after the run and its usage example loads the folder from disk.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common.atomic import fresh_temp_dir, rename_into_place
from common.errors import UserError, run_cli
from publish.card_content import write_model_card
from publish.hub import build_hf_folder, describe_weights, run_weights


def write_card(run_dir: str | Path, output: str | Path | None = None, hub_model_id: str | None = None) -> Path:
    """Write the card and curves beside the run's weights; returns the folder that holds them.

    Without `output` they go into the run's `final/` (the run must have finished). With `output`, that
    folder becomes an HF model folder of the weights plus the card, built aside and renamed into place;
    an existing folder is only replaced if it already holds a model (config.json)."""
    weights = run_weights(run_dir)
    run, source = weights.run, weights.folder
    what = describe_weights(weights)
    if output is None:
        if source != run.final:
            raise UserError(f"{run.path} has not finished (no final/); pass --output DIR to export {source.name} "
                            "there with its card")
        write_model_card(run.path, run.final, hub_model_id, source=what)
        return run.final
    dest = Path(output)
    if dest.resolve() == source.resolve():
        if source != run.final:
            raise UserError(f"--output {dest} is the checkpoint itself; checkpoints are not HF folders, choose "
                            "another folder")
        write_model_card(run.path, dest, hub_model_id, source=what)
        return dest
    if dest.is_file() or (dest.is_dir() and any(dest.iterdir()) and not (dest / "config.json").is_file()):
        raise UserError(f"--output {dest} exists and holds no model; choose a new or empty folder")
    tmp = fresh_temp_dir(dest)
    shutil.rmtree(tmp)  # build_hf_folder creates it
    try:
        build_hf_folder(weights, tmp)
        write_model_card(run.path, tmp, hub_model_id, source=what, local_path=dest)  # named as it will be
        rename_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Write a run's model card and training curves (offline).")
    parser.add_argument("--run_dir", required=True, help="the training run's --out_dir, or one of its checkpoints")
    parser.add_argument("--output", default=None,
                        help="folder for an HF export with the card (default: the run's final/, if it finished)")
    parser.add_argument("--hub_model_id", default=None,
                        help="name the card after this Hub repo (nothing is uploaded; default: the run's name)")
    args = parser.parse_args(argv)
    folder = write_card(args.run_dir, args.output, args.hub_model_id)
    print(f"model card and curves written to {folder}")
    return folder


if __name__ == "__main__":
    run_cli(main)
