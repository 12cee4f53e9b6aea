"""Where a Hub dataset's documents are: the commit a revision points at, and for a repo that holds only a loading
script, its parquet conversion. Decided once per process (`locate_hub_dataset`), before anything is streamed.

`datasets` >= 4 refuses repos with a loading script (`Skylion007/openwebtext`: "Dataset scripts are no longer
supported"). The Hub converts such datasets to parquet on the branch `refs/convert/parquet`, one folder per
config and split: `<config>/<split>/NNNN.parquet`, or `<config>/partial-<split>/` when the split was larger than
the converter's limit and only its first part was converted. Which it is is read from the branch's file list,
never assumed. The same layout is recognised when the user pins that branch or one of its commits.

Every answer names the commit it was read at; the stream and the validation documents are read at that commit,
so a push to the repo during a run changes nothing, and the run records `id[:config]@commit` to read the same
data again. Everything a user can get wrong (unknown repo, revision, config or split, a repo with neither data
files nor a conversion, no network) is one `UserError` line here.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from common.errors import UserError
from common.network import reaching_the_hub

PARQUET_BRANCH = "refs/convert/parquet"
# The way to train on a Hub dataset from a machine that cannot reach the Hub.
PREPARE_ELSEWHERE = "run `python -m data.prepare` where the Hub is reachable and train on the shard folder"
# Files that describe a dataset repo rather than hold its data.
_METADATA = ("README.md", ".gitattributes", ".huggingface.yaml", "dataset_infos.json", "dataset_info.json")
# The converter's layout (its files are numbered: 0000.parquet, ...); a branch without a README whose every data file
# is laid out so is read as a conversion.
_CONVERTED = re.compile(r"^(?P<config>[^/]+)/(?P<partial>partial-)?(?P<split>[^/]+)/\d+\.parquet$")


@dataclass(frozen=True)
class HubData:
    """A Hub dataset located: `repo_id` (the current id of a renamed repo), the `commit` every read is made at,
    `config` (the one asked for, the card's default when None; for a conversion, its folder), and for a parquet
    conversion the files of each split (`data_files`, None when the card or datasets' own rules decide).
    `partial`: the conversion holds only the first part of a split too large for the converter."""

    repo_id: str
    commit: str
    config: str | None
    data_files: dict[str, list[str]] | None = None
    partial: bool = False

    @property
    def converted(self) -> bool:
        return self.data_files is not None

    def spec(self) -> str:
        """`--dataset` naming exactly this data again."""
        return f"{self.repo_id}{':' + self.config if self.config else ''}@{self.commit}"

    def note(self) -> str | None:
        """The one line that says a conversion is read instead of the repo's main branch, or None."""
        if not self.converted:
            return None
        files = sum(len(f) for f in self.data_files.values())
        part = "; the split was too large for the converter, only its first part is converted" if self.partial else ""
        return (f"{self.repo_id} holds a loading script, which datasets no longer runs: reading its parquet "
                f"conversion ({PARQUET_BRANCH} at {self.commit[:12]}, config {self.config}, {files} files{part})")

    def check_split(self, split: str) -> None:
        if self.data_files is not None and split not in self.data_files:
            raise UserError(f"the parquet conversion of {self.repo_id} (config {self.config}) has no split {split!r} "
                            f"(splits: {', '.join(sorted(self.data_files))}); pass one of those")


@functools.cache
def locate_hub_dataset(name: str, config: str | None, revision: str | None) -> HubData:
    """Where `name` (at `revision`, main when None) keeps the documents of `config`; see the module docstring."""
    shown = f"{name}:{config}" if config else name
    with reaching_the_hub(f"read Hub dataset {shown}", PREPARE_ELSEWHERE):
        return _locate(name, config, revision, shown)


def _locate(name: str, config: str | None, revision: str | None, shown: str) -> HubData:
    from huggingface_hub import HfApi

    api = HfApi()
    info = _info(api, name, revision, shown=shown)
    repo_id, files = info.id or name, [s.rfilename for s in info.siblings or []]
    data = [f for f in files if _is_data(f)]
    if data and "README.md" not in files and all(_CONVERTED.match(f) for f in data):
        return _conversion(repo_id, info.sha, config, data)  # the conversion branch itself, pinned by the user
    if data:
        _check_config(repo_id, config, info.card_data)
        return HubData(repo_id, info.sha, config)
    if not any(f.endswith(".py") and "/" not in f for f in files):
        raise UserError(f"Hub dataset {repo_id} has no data files{_at(revision)} (only {', '.join(files) or 'nothing'})"
                        f"; check the id, or pass a revision that has data (id@revision)")
    converted = _info(api, repo_id, PARQUET_BRANCH, no_revision=(
        f"Hub dataset {repo_id} holds only a loading script, which datasets no longer runs, and has no parquet "
        f"conversion ({PARQUET_BRANCH}); pick another dataset, or convert it yourself and train on the files"))
    listing = api.list_repo_files(repo_id, repo_type="dataset", revision=converted.sha)  # the tree, all pages
    return _conversion(repo_id, converted.sha, config, [f for f in listing if _is_data(f)])


def _info(api, name: str, revision: str | None, no_revision: str | None = None, shown: str | None = None):
    """The dataset's repo info at `revision`; every failure as one line (`no_revision` when it does not exist,
    the dataset `shown` as the user wrote it)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return api.dataset_info(name, revision=revision)
    except RevisionNotFoundError:
        raise UserError(no_revision or f"Hub dataset {name} has no revision {revision!r}; pass an existing branch, "
                        "tag or commit (id@revision), or none for main") from None
    except RepositoryNotFoundError:
        raise UserError(f"unknown Hub dataset {name!r} (not on the Hub, or private/gated without a login: "
                        "`hf auth login`); if you meant a local path, it does not exist") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise UserError(f"cannot stream Hub dataset {shown or name}: offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is "
                        f"set); unset it, or {PREPARE_ELSEWHERE}") from None
    except HfHubHTTPError as err:  # the Hub answered, with an error (a connection that failed: `locate_hub_dataset`)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"the Hub failed to answer for dataset {name!r} ({first}); retry later, or "
                        f"{PREPARE_ELSEWHERE}") from None


def _is_data(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name not in _METADATA and not name.endswith((".py", ".md")) and not name.startswith(".")


def _at(revision: str | None) -> str:
    return f" at revision {revision}" if revision else ""


def _check_config(repo_id: str, config: str | None, card) -> None:
    """A config the card does not declare is refused here (datasets would say so only as a ValueError)."""
    declared = [c.get("config_name", "default") for c in ((card or {}).get("configs") or []) if isinstance(c, dict)]
    if config is None or config in declared or (not declared and config == "default"):
        return
    offered = f"it declares {', '.join(declared)}" if declared else "it declares none"
    raise UserError(f"Hub dataset {repo_id} has no config {config!r} ({offered}); pass id:config with one of them, "
                    "or no config")


def _conversion(repo_id: str, commit: str, config: str | None, files: list[str]) -> HubData:
    """The files of each split of `config` in a parquet conversion's file list."""
    by_config: dict[str, dict[str, list[str]]] = {}
    partial = set()
    for path in sorted(files):
        match = _CONVERTED.match(path)
        if match:
            by_config.setdefault(match["config"], {}).setdefault(match["split"], []).append(path)
            if match["partial"]:
                partial.add((match["config"], match["split"]))
    if not by_config:
        raise UserError(f"the parquet conversion of {repo_id} ({commit[:12]}) holds no <config>/<split>/*.parquet "
                        "files; pick another dataset")
    if config is None:
        if len(by_config) > 1 and "default" not in by_config:
            raise UserError(f"the parquet conversion of {repo_id} has several configs ({', '.join(sorted(by_config))})"
                            f"; pass one as {repo_id}:config")
        config = "default" if "default" in by_config else next(iter(by_config))
    if config not in by_config:
        raise UserError(f"Hub dataset {repo_id} has no config {config!r} (its parquet conversion has "
                        f"{', '.join(sorted(by_config))}); pass id:config with one of them")
    return HubData(repo_id, commit, config, by_config[config], partial=any(c == config for c, _ in partial))
