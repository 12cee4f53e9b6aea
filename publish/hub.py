"""Publish a training run to the Hugging Face Hub: HF-format weights, model card, optional training state.

    python -m publish.hub --run_dir out/my_run --hub_model_id user/name [--revision step-1000] [--private]
                        [--include_state]

The upload is staged in `<run_dir>/hub_export/model/` (a `save_pretrained` folder plus README.md and
loss_curve.png) and kept there, so a failed push is retried without redoing the export: the export
is only rebuilt when its source (the run's `final/` folder, or for an unfinished run its latest
checkpoint) has changed. The card is rewritten on every push. Everything goes up in one commit.

The token and endpoint are huggingface_hub's own settings (HF_TOKEN or `hf auth login`; HF_ENDPOINT):
this module never reads, prints or stores the token, it only asks whether one exists. Call it from
the main process only; every failure is a one-line `UserError` that leaves the run folder intact.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from checkpoint_io.manifest import damage
from checkpoint_io.weights import Weights, is_repo_id, resolve_weights
from common.atomic import rename_into_place, temp_path, write_failure
from common.cli import CliParser
from common.errors import UserError, run_cli
from common.network import network_failure
from common.run_dir import RunDir
from publish.card_content import write_model_card

STATE_PREFIX = "training_state"


def check_hub_access(hub_model_id: str) -> None:
    """Fail early, without any network call, when a push could not even start (bad id, offline, no token).

    The trainer can call this at start-up so that a missing token shows up before hours of training."""
    from huggingface_hub import constants, get_token

    if not is_repo_id(hub_model_id) or "/" not in hub_model_id:
        raise UserError(f"--hub_model_id {hub_model_id!r} is not a Hub repo id; use the form user/name or org/name")
    if constants.HF_HUB_OFFLINE:
        raise UserError("cannot push: HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to push")
    if not get_token():
        raise UserError("cannot push: no Hugging Face token found; set HF_TOKEN or run `hf auth login` "
                        "(a token with write access)")


def _fingerprint(folder: Path) -> list[list[Any]]:
    """Name, size and modification time of every file: enough to tell whether a source was rewritten."""
    return sorted([str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns]
                  for p in folder.rglob("*") if p.is_file())


def run_weights(run_dir: str | Path, source: Path | None = None) -> Weights:
    """The weights of a training run to publish: `source` (one of its checkpoints), else what `run_dir` names
    (a run folder: `final/` if it finished, else its newest checkpoint; or the run's final/ or a checkpoint)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"run folder {path} does not exist; pass the --out_dir of a training run as --run_dir")
    weights = resolve_weights(source or path)
    if weights.run is None:
        raise UserError(f"{path} is {weights.kind.value}, not a training run; pass the --out_dir of a training run "
                        "as --run_dir")
    return weights


def describe_weights(weights: Weights) -> str:
    """What a card says a run's weights are: the run's final weights or an unfinished run's checkpoint."""
    if weights.folder == weights.run.final:
        return "the final weights of the run"
    return f"checkpoint {weights.folder.name} (the run had not finished)"


ADAPTER_SUBFOLDER = "adapter"  # a LoRA run's final_adapter/ in the repo: PeftModel.from_pretrained(subfolder=)


def build_hf_folder(weights: Weights, dest: Path) -> None:
    """Make `dest` (absent) an HF model folder of a run's weights: `final/` copied as it is (with a LoRA run's
    `final_adapter/` as `adapter/`), a checkpoint converted (a LoRA checkpoint: merged)."""
    run = weights.run
    if weights.folder == run.final:
        shutil.copytree(run.final, dest)
        if run.final_adapter.is_dir():
            shutil.copytree(run.final_adapter, dest / ADAPTER_SUBFOLDER)
    else:
        from model import GPT

        GPT.from_pretrained(weights).save_pretrained(dest)


def stage_export(run_dir: str | Path, source: Path | None = None) -> tuple[Path, str]:
    """Make `<run>/hub_export/model/` hold the HF export of `source` (default: the run's newest weights).

    Reuses the folder when it was made from the same, unchanged source. Returns the folder and a
    description of what it holds (for the card)."""
    weights = run_weights(run_dir, source)
    run, source = weights.run, weights.folder
    what = describe_weights(weights)
    export, marker = run.hub_export / "model", run.hub_export / "export.json"
    adapter = run.final_adapter if source == run.final and run.final_adapter.is_dir() else None
    record = {"source": str(source.relative_to(run.path)), "files": _fingerprint(source),
              "adapter": _fingerprint(adapter) if adapter else None}
    if export.is_dir() and marker.is_file() and json.loads(marker.read_text()) == record:
        return export, what  # a retry: the export is already there

    # An interrupted export is never mistaken for a finished one: built aside, then published.
    run.hub_export.mkdir(exist_ok=True)
    tmp = temp_path(export)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build_hf_folder(weights, tmp)
        marker.unlink(missing_ok=True)
        rename_into_place(tmp, export)
        marker.write_text(json.dumps(record))
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, as each writer reports it
        if (reason := write_failure(err)) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write the Hub export in {run.hub_export} ({reason}); free disk space and push "
                        "again (the run's own files are intact)") from None
    return export, what


def _operations(folder: Path, prefix: str = "") -> list[Any]:
    from huggingface_hub import CommitOperationAdd

    return [CommitOperationAdd(path_in_repo=prefix + p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
            for p in sorted(folder.rglob("*")) if p.is_file()]


def _explain(err: Exception, hub_model_id: str, endpoint: str) -> str | None:
    """A one-line reason for a Hub or network failure, or None for anything else (a bug: let it raise)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status == 401:
            return f"the Hub at {endpoint} rejected the token (401); log in again with `hf auth login` or set HF_TOKEN"
        if status == 403:
            return (f"no write access to {hub_model_id} on {endpoint} (403); use a token with write permission "
                    "for that user or organization")
        if status == 404:
            return (f"{hub_model_id} or its branch was not found on {endpoint} (404); check --hub_model_id and "
                    "--revision")
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"the Hub at {endpoint} answered {status} ({first})"
    if isinstance(err, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it to push"
    if (cause := network_failure(err)) is not None:
        return f"could not reach the Hub at {endpoint} ({type(cause).__name__}); check the network and HF_ENDPOINT"
    return None


def push_to_hub(
    run_dir: str | Path,
    hub_model_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    include_state: bool = False,
    commit_message: str | None = None,
) -> str:
    """Export (or reuse the export of) a run, write its card and push both; returns the repo URL.

    `revision` is a branch (created from main if missing), e.g. `step-1000`; `include_state` adds the
    latest checkpoint folder under `training_state/`. `private` only applies when the repo is created."""
    check_hub_access(hub_model_id)
    export, what = stage_export(run_dir)
    return upload_export(run_dir, export, what, hub_model_id, revision=revision, private=private,
                         include_state=include_state, commit_message=commit_message)


def upload_export(
    run_dir: str | Path,
    export: Path,
    what: str,
    hub_model_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    include_state: bool = False,
    commit_message: str | None = None,
) -> str:
    """Write the card into a staged `export` (see `stage_export`) and push it in one commit; returns the URL."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    state = RunDir(run_dir).latest_checkpoint() if include_state else None
    if include_state and state is None:
        raise UserError(f"--include_state: {run_dir} has no checkpoints/step_* folder to upload; push without it")
    if state is not None and (problem := damage(state)) is not None:  # every file: the state is what a resume reads
        raise UserError(f"--include_state: {problem}, so it would not resume; push without --include_state, or "
                        f"resume the run from the checkpoint before it to save an intact one")
    write_model_card(run_dir, export, hub_model_id, source=what, revision=revision,
                     state_step=state.name if state else None)

    api = HfApi()  # endpoint (HF_ENDPOINT) and token resolved by huggingface_hub itself
    operations = _operations(export) + (_operations(state, f"{STATE_PREFIX}/") if state else [])
    retry = (f"the export is kept in {export}; retry with: python -m publish.hub --run_dir {run_dir} "
             f"--hub_model_id {hub_model_id}" + (f" --revision {revision}" if revision else "")
             + (" --private" if private else "") + (" --include_state" if include_state else ""))
    try:
        repo_url = str(api.create_repo(hub_model_id, private=private, exist_ok=True))
        if revision and revision != "main":
            api.create_branch(hub_model_id, branch=revision, exist_ok=True)
        api.create_commit(hub_model_id, operations=operations, revision=revision,
                          commit_message=commit_message or f"Upload {what} (gpt2-accelerate)")
    except Exception as err:
        reason = _explain(err, hub_model_id, api.endpoint)
        if reason is None:
            raise
        raise UserError(f"push to {hub_model_id} failed: {reason}; {retry}") from None
    return f"{repo_url}/tree/{revision}" if revision else repo_url


def main(argv: list[str] | None = None) -> None:
    parser = CliParser(prog="python -m publish.hub",
                       description="Push a finished or interrupted training run to the Hugging Face Hub.")
    parser.add_argument("--run_dir", required=True, help="the training run's --out_dir")
    parser.add_argument("--hub_model_id", required=True, help="target repo, user/name or org/name")
    parser.add_argument("--revision", default=None,
                        help="branch to push to (created if missing), e.g. step-1000; default: main")
    parser.add_argument("--private", action="store_true", help="create the repo as private (if it does not exist)")
    parser.add_argument("--include_state", action="store_true",
                        help="also upload the latest checkpoint under training_state/ so the run can resume")
    parser.add_argument("--commit_message", default=None,
                        help="default: 'Upload <what> (gpt2-accelerate)'")
    args = parser.parse_args(argv)
    url = push_to_hub(args.run_dir, args.hub_model_id, revision=args.revision, private=args.private,
                      include_state=args.include_state, commit_message=args.commit_message)
    print(f"pushed {args.run_dir} to {url}")


if __name__ == "__main__":
    run_cli(main)
