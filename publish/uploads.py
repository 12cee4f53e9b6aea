"""The Hub pushes a training run makes (`--push_to_hub`): every K-th checkpoint to branch `step-N` while
training goes on, and the final model to `main` at the end. Main process only; a failed push is a
warning that leaves the run intact and names the retry command."""
from __future__ import annotations

import threading
from pathlib import Path

from common.errors import UserError
from common.network import hub_unreachable, network_failure
from common.run_dir import RunDir
from configs import HubConfig
from publish.hub import check_hub_access, push_to_hub, stage_export, upload_export


def check_hub_reachable(hub_model_id: str) -> None:
    """One request before a run that pushes trains: the Hub answers at HF_ENDPOINT. A push that can never start is
    refused now, in one line, rather than warned about after the run (issue 44). A repo not created yet answers
    404, which is an answer; whether the token may write is known only at the push."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().repo_info(hub_model_id)
    except HfHubHTTPError:
        return  # the Hub answered (a repo to be created, a private one, ...)
    except Exception as err:
        if network_failure(err) is None:
            raise
        raise hub_unreachable(err, f"push to {hub_model_id}", "leave out --push_to_hub and push the finished run "
                              "later with python -m publish.hub", cached_copy=False) from None


class HubUploads:
    """Pushes of one run; construct it before training so a missing token fails before the first step."""

    def __init__(self, cfg: HubConfig, run: RunDir, save_every: int, is_main_process: bool) -> None:
        self.cfg, self.run, self.save_every = cfg, run, save_every
        self.enabled = cfg.push_to_hub and is_main_process
        self._upload: threading.Thread | None = None  # the step-N upload in flight, at most one
        if cfg.push_to_hub:
            check_hub_access(cfg.hub_model_id)
            if is_main_process:  # the one that pushes
                check_hub_reachable(cfg.hub_model_id)

    def checkpoint_saved(self, step: int, checkpoint: Path) -> None:
        """After each save: every `hub_push_every`-th checkpoint goes to branch `step-N`."""
        cfg = self.cfg
        if not (self.enabled and cfg.hub_push_every and step % (self.save_every * cfg.hub_push_every) == 0):
            return
        self.wait()  # one upload at a time: the next export reuses the staging folder
        try:
            # Staged now, from this very checkpoint: the branch holds step N even if rotation deletes
            # the checkpoint or a newer one appears while the upload runs.
            export, what = stage_export(self.run.path, source=checkpoint)
        except UserError as err:
            print(f"warning: {err}", flush=True)
            return
        # In a thread: the other ranks would otherwise wait for the upload in their next collective
        # (and time out on a slow link).
        self._upload = threading.Thread(target=self._push, args=(export, what, f"step-{step}"),
                                        name=f"push-step-{step}")
        self._upload.start()

    def _push(self, export: Path, what: str, revision: str) -> None:
        try:
            url = upload_export(self.run.path, export, what, self.cfg.hub_model_id, revision=revision)
            print(f"pushed to {url}", flush=True)
        except UserError as err:
            print(f"warning: {err}", flush=True)

    def wait(self) -> None:
        """Let the upload in flight finish."""
        if self._upload is not None:
            self._upload.join()
            self._upload = None

    def push_final(self) -> None:
        """Push the finished run to `main` (call after the process group is closed: no rank waits in a
        collective timeout during the upload)."""
        self.wait()
        if not self.enabled:
            return
        try:
            print(f"pushed to {push_to_hub(self.run.path, self.cfg.hub_model_id)}", flush=True)
        except UserError as err:  # an error, not a warning: the exit status tells a job script the push failed
            raise UserError(f"the run finished ({self.run.final} holds it) but {err}; push it again with python -m "
                            f"publish.hub --run_dir {self.run.path} --hub_model_id {self.cfg.hub_model_id}") from None
