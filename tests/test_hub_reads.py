"""The project's Hub read paths against the loopback Hub (tests/fake_hub.py), through the real clients.

In this process (huggingface_hub only, its constants patched): where a Hub dataset's data is (`data.hub`: the
commit a revision points at, the parquet conversion of a script-only repo, the one-line refusals) and what a
pinned `--init_from id@revision` downloads. The runs of train.py, data.prepare, the evaluations and the sampler
through both clients are in tests/test_hub_runs.py.
"""
from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
from fake_hub import FakeHub
from test_fake_hub import (  # noqa: F401 (gpt2_folders, hub, in_process_client: fixtures)
    FINEWEB,
    FINEWEB_CARD,
    OWT,
    OWT_CARD,
    docs_parquet,
    gpt2_folders,
    hub,
    in_process_client,
)

from checkpoint_io.weights import Kind, resolve_weights
from common.errors import UserError
from data.hub import PARQUET_BRANCH, HubData, locate_hub_dataset
from data.settings import DataConfig
from data.source import open_source


@pytest.fixture
def client(in_process_client: FakeHub,  # noqa: F811
            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """`in_process_client` with an empty Hub cache of its own and no dataset located yet."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    locate_hub_dataset.cache_clear()
    yield in_process_client
    locate_hub_dataset.cache_clear()


def locate(dataset: str) -> HubData:
    """`--dataset` parsed as training parses it, then located."""
    return open_source(DataConfig(dataset=dataset)).location()


def refused(dataset: str) -> str:
    with pytest.raises(UserError) as err:
        locate(dataset)
    assert "\n" not in str(err.value)
    return str(err.value)


def fineweb(server: FakeHub) -> dict[str, bytes]:
    """FineWeb-Edu as the real card lays it out (`configs:` front matter, sample/10BT/*), and a tag v1.0.0."""
    sample = {f"sample/10BT/{i:03d}_00000.parquet": docs_parquet(100 * i, 100) for i in range(2)}
    dump = {"data/CC-MAIN-2024-10/train-00000-of-00001.parquet": docs_parquet(10_000, 20)}
    older = {"README.md": FINEWEB_CARD, "sample/10BT/000_00000.parquet": docs_parquet(50_000, 30), **dump}
    server.add_dataset(FINEWEB, {"README.md": FINEWEB_CARD, **sample, **dump}, revisions={"old": older},
                       tags={"v1.0.0": "old"})
    return sample


def openwebtext(server: FakeHub) -> dict[str, bytes]:
    """A script-only repo whose conversion is partial, as OpenWebText's (`plain_text/partial-train/`)."""
    converted = {f"plain_text/partial-train/{i:04d}.parquet": docs_parquet(60 * i, 60) for i in range(3)}
    server.add_dataset(OWT, {"README.md": OWT_CARD, "openwebtext.py": "# a loading script\n"},
                       revisions={PARQUET_BRANCH: converted})
    server.rename("openwebtext", OWT, repo_type="dataset")
    return converted


def test_a_revision_is_read_at_the_commit_it_points_at(client: FakeHub):
    """A Hub dataset is read at one commit, the revision's; what a run records reads it again.

    Seen to catch: the breaks of `test_unknown_revisions_configs_and_repos_are_one_line`."""
    fineweb(client)
    main, tag = locate(f"{FINEWEB}:sample-10BT"), locate(f"{FINEWEB}:sample-10BT@v1.0.0")
    assert main == HubData(FINEWEB, client.commit_sha(FINEWEB, repo_type="dataset"), "sample-10BT")
    assert tag.commit == client.commit_sha(FINEWEB, "v1.0.0", repo_type="dataset") != main.commit
    assert tag.spec() == f"{FINEWEB}:sample-10BT@{tag.commit}" and not tag.converted
    assert locate(tag.spec()) == tag  # what a run records reads the same commit again


def test_unknown_revisions_configs_and_repos_are_one_line(client: FakeHub):
    """An unknown revision, an undeclared config, an unknown repo, a repo without data files, a script-only repo without
    conversion: one line each.

    Seen to catch: the config check disabled: `DID NOT RAISE`."""
    fineweb(client)
    client.add_dataset("someone/empty", {"README.md": "# nothing yet\n"})
    client.add_dataset("someone/script-only", {"README.md": "# a script\n", "script-only.py": "# loads from afar\n"})
    assert refused(f"{FINEWEB}:sample-10BT@v9") == (
        f"Hub dataset {FINEWEB} has no revision 'v9'; pass an existing branch, tag or commit (id@revision), or none "
        "for main")
    assert refused(f"{FINEWEB}:sample-99BT") == (
        f"Hub dataset {FINEWEB} has no config 'sample-99BT' (it declares default, sample-10BT); pass id:config with "
        "one of them, or no config")
    assert refused("nobody/nothing").startswith("unknown Hub dataset 'nobody/nothing' (not on the Hub, or private")
    assert refused("someone/empty").startswith("Hub dataset someone/empty has no data files (only README.md)")
    assert refused("someone/script-only") == (
        "Hub dataset someone/script-only holds only a loading script, which datasets no longer runs, and has no "
        f"parquet conversion ({PARQUET_BRANCH}); pick another dataset, or convert it yourself and train on the files")


def test_a_script_only_repo_is_read_from_its_conversion_listing(client: FakeHub):
    """A script-only repo is read from its conversion's file list (`partial-<split>`), under a renamed id and at a
    pinned conversion commit.

    Seen to catch: the `partial-` prefix not recognised: fails."""
    converted = openwebtext(client)
    where = locate(OWT)
    commit = client.commit_sha(OWT, PARQUET_BRANCH, repo_type="dataset")
    assert where == HubData(OWT, commit, "plain_text", {"train": sorted(converted)}, partial=True)
    assert where.note().startswith(f"{OWT} holds a loading script, which datasets no longer runs: reading its parquet "
                                   f"conversion ({PARQUET_BRANCH} at {commit[:12]}, config plain_text, 3 files; ")
    assert locate("openwebtext") == where  # the renamed id, read under its current one (HfFileSystem needs it)
    assert locate(where.spec()) == where  # the recorded commit of the conversion branch: the same files
    assert locate(f"{OWT}@{PARQUET_BRANCH}") == where
    assert refused(f"{OWT}:en") == (f"Hub dataset {OWT} has no config 'en' (its parquet conversion has plain_text); "
                                    "pass id:config with one of them")
    # The layout comes from the branch's listing, all pages of it.
    assert any(f"/tree/{commit}" in r.path for r in client.requests)
    with pytest.raises(UserError, match=f"^the parquet conversion of {OWT} .* has no split 'validation'"):
        where.check_split("validation")


def test_init_from_at_a_revision_downloads_that_commit(client: FakeHub, gpt2_folders):  # noqa: F811
    """`--init_from id@revision` downloads that commit through the server and records `id@sha`; conflicting revisions
    are refused.

    Seen to catch: the revision after `@` dropped: main's weights are read."""
    new, old = gpt2_folders
    client.add_model("openai-community/gpt2", new, revisions={"legacy": old}, tags={"v1.0": "legacy"})
    client.rename("gpt2", "openai-community/gpt2")
    weights = resolve_weights("gpt2@v1.0")
    commit = client.commit_sha("openai-community/gpt2", "v1.0")
    assert (weights.kind, weights.spec, weights.revision, weights.commit) == (Kind.HUB, "gpt2", "v1.0", commit)
    assert weights.pinned == f"gpt2@{commit}" and weights.name == "gpt2@v1.0"
    assert (weights.folder / "model.safetensors").read_bytes() == (old / "model.safetensors").read_bytes()
    assert client.bytes_served("gpt2", "model.safetensors") == (old / "model.safetensors").stat().st_size
    assert resolve_weights(weights.pinned).folder == weights.folder  # the recorded spec: the same snapshot
    with pytest.raises(UserError, match="^'gpt2' has no revision 'v9' on the Hub; pass an existing branch"):
        resolve_weights("gpt2@v9")
    with pytest.raises(UserError, match="^'gpt2@v1.0' names revision 'v1.0' and the revision 'main' is given too"):
        resolve_weights("gpt2@v1.0", revision="main")
