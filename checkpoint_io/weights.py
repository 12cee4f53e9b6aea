"""Which weights a `--model`, `--init_from` or `GPT.from_pretrained` argument means, decided once.

`resolve_weights(spec, revision)` reads the folder (or asks the Hub) and returns a `Weights`; loaders,
evaluations and publishing act on that answer and never look at the path again. What a spec can be:

  - our training checkpoint (`gpt_config.json` + any engine's files, `checkpoint_io.reader`): `CHECKPOINT`;
    a LoRA run's checkpoint (`gpt_config.json` + `adapter_config.json`): `LORA_CHECKPOINT`, whose base
    weights (named in the adapter config) are resolved too;
  - a Hugging Face model folder (`config.json`), our `final/` export among them: `HF_FOLDER`;
  - one of our run folders: its newest weights (`final/` if it finished, else its newest complete
    checkpoint; `common.run_dir.RunDir.newest_weights`);
  - anything else that is not a local path: a Hub repo id, `id@revision` to pin a branch, tag or commit
    (`common.hub_ids`), downloaded (config and safetensors only: a pickle can run code when loaded) to a
    snapshot folder in the Hub cache, named after the commit it holds: `HUB`.

Every way a spec can name no weights is one `UserError` line here, and only here. So is a checkpoint whose weights'
files are no longer those its manifest records (`checkpoint_io.manifest`). Every command that reads a checkpoint
passes here and checks it as a resume does, naming the newest intact checkpoint to read instead. What can be wrong
inside files that no manifest vouches for is the reader's (`checkpoint_io.reader`, `model/pretrained.py`).
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.constants import (
    CONFIG_NAME,
    SAFETENSORS_INDEX_FILE,
    SAFETENSORS_SINGLE_FILE,
    SAFETENSORS_WEIGHTS_FILE_PATTERN,
)

from checkpoint_io.manifest import damage, weights_file
from common.errors import UserError
from common.hub_ids import is_repo_id, split_revision
from common.network import reaching_the_hub
from common.run_dir import ADAPTER_CONFIG, GPT_CONFIG, RunDir, checkpoint_step, kept_instead

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # the released GPT-2 weights' Hub names
# What a Hub download fetches: the config and the safetensors, one file or shards (model-00001-of-00002...).
HUB_FILES = (CONFIG_NAME, SAFETENSORS_SINGLE_FILE, SAFETENSORS_INDEX_FILE,
             SAFETENSORS_WEIGHTS_FILE_PATTERN.format(suffix="-*"))
_KNOWN = f"known names: {', '.join(GPT2_NAMES)}, any Hub repo of a GPT-2 model, or a local folder"


class Kind(enum.Enum):
    HF_FOLDER = "a Hugging Face model folder"
    HUB = "a Hub repo"
    CHECKPOINT = "a training checkpoint"
    LORA_CHECKPOINT = "a LoRA run's checkpoint"


@dataclass(frozen=True)
class Weights:
    """What a spec resolved to.

    Invariants: `folder` holds the files of `kind` (for `HUB`, the downloaded snapshot; None only when
    resolved with `download=False`); `run` is set exactly when `folder` is a run's `final/` or one of its
    `checkpoints/step_N`; `base` is set exactly for a `LORA_CHECKPOINT` (whose `folder` is its adapter);
    `revision` is only ever set for `HUB`, whose `spec` is the repo id without it."""

    kind: Kind
    spec: str  # as the user wrote it (a run folder stays the run folder here; `folder` is what it resolved to)
    folder: Path | None
    run: RunDir | None = None
    base: Weights | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        """How messages name these weights: a Hub repo by its id (never its cache path), the rest by folder."""
        if self.kind is Kind.HUB:
            return f"{self.spec}@{self.revision}" if self.revision else self.spec
        return str(self.folder)

    @property
    def commit(self) -> str | None:
        """The commit sha a Hub download holds (its snapshot folder's name), None for anything else."""
        return self.folder.name if self.kind is Kind.HUB and self.folder is not None else None

    @property
    def pinned(self) -> str:
        """The spec that names exactly these weights again: a Hub id at its commit, else the spec as given."""
        return f"{self.spec}@{self.commit}" if self.commit else self.spec

    @property
    def adapter(self) -> Path | None:
        """A LoRA checkpoint's adapter folder (adapter_config.json + adapter_model.safetensors)."""
        return self.folder if self.kind is Kind.LORA_CHECKPOINT else None

    @property
    def step(self) -> int | None:
        """The optimizer step of a run's checkpoint, None for anything else."""
        return checkpoint_step(self.folder) if self.run is not None else None

    @property
    def described(self) -> str:
        """Which weights these are, as a command that read them says: the folder (or Hub id at its commit), and for
        a run's weights whether they are its final/ or which checkpoint."""
        if self.kind is Kind.HUB:
            return f"{self.pinned} (from the Hub)"
        if self.run is None:
            return f"{self.folder} ({self.kind.value})"
        if self.folder == self.run.final:
            return f"{self.folder} (the finished run's final weights)"
        newest = self.run.latest_checkpoint()
        which = "the run's newest checkpoint" if newest == self.folder else "a checkpoint of the run"
        finished = ", which has no final/ yet" if which.startswith("the") and not self.run.has_final() else ""
        return f"{self.folder} (step {self.step}: {which}{finished})"


def resolve_weights(spec: str | Path, revision: str | None = None, *, download: bool = True) -> Weights:
    """The weights `spec` names (see the module docstring); a one-line `UserError` when it names none.

    `revision` (a branch, tag or commit) applies to a Hub id only, as does `id@revision` in `spec` (one of the
    two). `download=False` checks a Hub id but fetches nothing (`folder` None), for a consumer that downloads
    the repo itself (lm-eval)."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if revision is not None:
            raise UserError(f"{spec} is a local folder, and a revision ({revision}) applies to a Hub id only; "
                            "drop the revision or pass a Hub id")
        return _local(path, spec)
    if path.exists():
        raise UserError(f"{path} is a file; pass the folder that holds config.json and model.safetensors")
    if (kept := kept_instead(path)) is not None:
        raise UserError(f"no checkpoint {spec}: {kept}; pass one of those")
    parent = Path(path.parts[0]) if len(path.parts) > 1 and not path.is_absolute() else None
    if parent is not None and parent.is_dir():  # `out/my_rnu` while out/ exists: a typo, not a Hub id
        raise UserError(f"no folder {path} (though {parent}/ exists); check the path, or pass a Hub id such as gpt2")
    repo_id, at = split_revision(spec, "model")
    if at is not None and revision is not None and at != revision:
        raise UserError(f"{spec!r} names revision {at!r} and the revision {revision!r} is given too; pass one")
    revision = revision or at
    if not is_repo_id(repo_id):
        raise UserError(f"{spec!r} is not an existing folder nor a valid Hub model id; {_KNOWN}")
    folder = _download(repo_id, revision) if download else None
    return Weights(Kind.HUB, repo_id, folder, revision=revision)


def _local(path: Path, spec: str) -> Weights:
    """The weights in an existing local folder: a checkpoint, an HF folder, or a run's newest weights."""
    run = RunDir.holding(path)
    if (path / GPT_CONFIG).is_file():
        if (problem := damage(path, weights_file)) is not None:
            raise UserError(f"{problem}; {_intact_instead(path, run)}")
        if (path / ADAPTER_CONFIG).is_file():
            return Weights(Kind.LORA_CHECKPOINT, spec, path, run, base=_lora_base(path))
        return Weights(Kind.CHECKPOINT, spec, path, run)
    if (path / CONFIG_NAME).is_file():
        return Weights(Kind.HF_FOLDER, spec, path, run if run is not None and path == run.final else None)
    if run is not None and checkpoint_step(path) is not None:
        raise UserError(f"{path} is not a complete checkpoint (no {GPT_CONFIG}); pick another one")
    run = RunDir(path)
    if run.looks_like_run():
        newest = run.newest_weights()
        if newest is None:
            raise UserError(f"run folder {path} has no final/ export and no checkpoints/step_* yet; train longer "
                            "or pick another run")
        return _local(newest, spec)
    raise UserError(
        f"{path} is neither a model folder (config.json or gpt_config.json) nor a run folder "
        f"(final/ or checkpoints/); point at one of those"
    )


def _intact_instead(checkpoint: Path, run: RunDir | None) -> str:
    """The way out of a damaged checkpoint: the newest earlier checkpoint of its run whose weights are intact (each
    checked as this one was, newest first), else the run's final/, else what is left to do."""
    if run is None:
        return "restore the checkpoint from a copy, or pass another one"
    step = checkpoint_step(checkpoint)
    for earlier in reversed(run.list_checkpoints()):
        if checkpoint_step(earlier) < step and damage(earlier, weights_file) is None:
            return f"the newest intact checkpoint before it is {earlier}: pass that folder instead"
    if run.has_final():
        return f"the run's final weights are intact: pass {run.final} instead"
    return f"no earlier checkpoint of {run.path} is intact: restore the file from a copy, or train anew"


def _lora_base(checkpoint: Path) -> Weights:
    """The weights a LoRA checkpoint's adapter was trained on: peft's `base_model_name_or_path` (and `revision`)."""
    file = checkpoint / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text())
        base, revision = config["base_model_name_or_path"], config.get("revision")
        if not isinstance(base, str) or not base:
            raise ValueError("no base model named")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{file} is damaged ({type(err).__name__}: {err}); restore it from the run") from None
    try:
        return resolve_weights(base, revision)
    except UserError as err:
        raise UserError(f"{checkpoint} is a LoRA checkpoint whose base model {base} cannot be loaded ({err}); "
                        "restore the base, or use the run's final/ export") from None


def _download(repo_id: str, revision: str | None) -> Path:
    """Fetch config and safetensors of a Hub repo at `revision` (or find them in the local Hub cache)."""
    from huggingface_hub import snapshot_download  # imported here: most specs are local folders
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" --revision {revision}" if revision else ""
    try:
        # Not cached and the Hub out of reach: snapshot_download's LocalEntryNotFoundError, caused by the request.
        with reaching_the_hub(f"download model {repo_id}{'@' + revision if revision else ''}", "pass a local folder"):
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        if isinstance(err.__cause__, HfHubHTTPError):  # the Hub answered with an error (a 5xx) and nothing is cached
            raise _download_failed(repo_id, err.__cause__) from None
        raise UserError(
            f"cannot fetch {repo_id!r} from the Hugging Face Hub: offline (HF_HUB_OFFLINE=1) and "
            f"not in the local Hub cache; download it once with network access "
            f"(`hf download {repo_id}{at}`) or pass a local folder"
        ) from None
    except GatedRepoError:
        raise UserError(f"{repo_id!r} is gated on the Hub; accept its terms and log in (`hf auth login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{repo_id!r} has no revision {revision!r} on the Hub; pass an existing branch, tag or "
                        "commit of it, or no revision for main") from None
    except RepositoryNotFoundError:
        raise UserError(f"unknown model {repo_id!r}: not a local folder and not a model on the Hub; {_KNOWN}") from None
    except HfHubHTTPError as err:
        raise _download_failed(repo_id, err) from None


def _download_failed(repo_id: str, err: Exception) -> UserError:
    return UserError(f"downloading {repo_id!r} from the Hub failed ({str(err).splitlines()[0]}); retry later")
