"""The loopback Hub (tests/fake_hub.py) driven by the real clients: huggingface_hub and datasets.

Each test declares repos laid out as the real ones are (FineWeb-Edu's card and `sample/10BT/`, a script-only
OpenWebText with its `refs/convert/parquet` branch, HellaSwag's string labels, GPT-2 renamed to
openai-community/gpt2), runs the clients as a user's process does (a fresh process with HF_ENDPOINT set and
an HF_HOME of its own: both libraries read these once, at import), and checks what arrived against what was
declared and against the server's record of what it served. What these tests found is in docs/hub_reads.md.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fake_hub import FakeHub

# Prepended to every client program: `report(...)` sends a result back, `error(fn)` runs fn and describes
# what it raised (type, cause chain, message), or gives None.
CLIENT_PRELUDE = '''
import json
def report(**values):
    print("REPORT " + json.dumps(values, default=str), flush=True)
def error(fn):
    try:
        fn()
    except BaseException as err:
        chain, cause = [], err
        while cause is not None and len(chain) < 6:
            chain.append(type(cause).__name__)
            cause = cause.__cause__ or cause.__context__
        return {"type": type(err).__name__, "chain": chain, "message": str(err)}
    return None
'''
# Client-side only, for the fault tests that exhaust retries: no sleeping between huggingface_hub's retries
# (1, 2, 4, 8, 8 s) nor between datasets' (5 s or 20 s); the number of attempts is unchanged.
NO_BACKOFF_SLEEP = '''
import types, time, datasets, huggingface_hub.utils._http as hub_http
hub_http.time = types.SimpleNamespace(sleep=lambda seconds: None, time=time.time)
datasets.config.STREAMING_READ_RETRY_INTERVAL = datasets.config.STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL = 0
'''

FINEWEB = "HuggingFaceFW/fineweb-edu"
FINEWEB_CARD = """---
license: odc-by
pretty_name: FineWeb-Edu
configs:
  - config_name: default
    data_files:
      - split: train
        path: data/*/*
  - config_name: sample-10BT
    data_files:
      - split: train
        path: sample/10BT/*
---
# FineWeb-Edu (the layout of the real card, with two of its configs)
"""
SAMPLE_CARD = """---
configs:
  - config_name: sample-10BT
    data_files:
      - split: train
        path: sample/10BT/*
---
"""
OWT = "Skylion007/openwebtext"
OWT_CARD = """---
pretty_name: OpenWebText
dataset_info:
  config_name: plain_text
  features:
  - name: text
    dtype: string
---
# OpenWebText: a loading script, no data files on main
"""
HELLASWAG = "Rowan/hellaswag"
HELLASWAG_CARD = """---
pretty_name: HellaSwag
dataset_info:
  features:
  - {name: ind, dtype: int32}
  - {name: activity_label, dtype: string}
  - {name: ctx_a, dtype: string}
  - {name: ctx_b, dtype: string}
  - {name: ctx, dtype: string}
  - {name: endings, sequence: string}
  - {name: source_id, dtype: string}
  - {name: split, dtype: string}
  - {name: split_type, dtype: string}
  - {name: label, dtype: string}
configs:
- config_name: default
  data_files:
  - {split: train, path: data/train-*}
  - {split: test, path: data/test-*}
  - {split: validation, path: data/validation-*}
---
# HellaSwag
"""


def run_client(hub: FakeHub, hf_home: Path, program: str, extra_env: dict[str, str] | None = None,
               timeout: float = 300) -> dict:
    """Run `program` in a new Python process pointed at `hub`; return its reports merged into one dict."""
    env = {**os.environ, **hub.client_env(hf_home), **(extra_env or {})}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([sys.executable, "-c", CLIENT_PRELUDE + textwrap.dedent(program)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            reports.update(json.loads(line.removeprefix("REPORT ")))
    return reports


def docs_parquet(first: int, count: int, row_group_size: int = 50) -> bytes:
    """FineWeb-shaped rows (text, id, url); row i's text names i, so order and completeness can be checked."""
    rows = range(first, first + count)
    table = pa.table({"text": [f"Document {i}. " + "Some educational words. " * (i % 30) for i in rows],
                      "id": [f"<urn:uuid:{i:08d}>" for i in rows], "url": [f"https://example.org/{i}" for i in rows]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=row_group_size)
    return buffer.getvalue()


def hellaswag_parquet(n: int, split: str) -> bytes:
    """HellaSwag rows as the Hub's parquet holds them: `label` is a string ("" in the unlabelled test split)."""
    rows = [{"ind": i, "activity_label": "Cooking", "ctx_a": f"Context {i}.", "ctx_b": "then",
             "ctx": f"Context {i}. then", "endings": [f"ending {i}.{k}" for k in range(4)], "source_id": f"src~{i}",
             "split": split, "split_type": "indomain", "label": "" if split == "test" else str(i % 4)}
            for i in range(n)]
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server
    assert server.unknown == [], f"the clients called endpoints the fake hub does not know: {server.unknown}"


@pytest.fixture
def in_process_client(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """This process's huggingface_hub pointed at `hub` (conftest made the session offline; the constants were
    read at import, so they are patched, as tests/test_hub.py does)."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    resolve_url = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", resolve_url)
    monkeypatch.setattr(hf_constants, "HF_URL_HOSTS", hf_constants.HF_URL_HOSTS | {"127.0.0.1"})
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no_login_cache" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


@pytest.fixture(scope="module")
def gpt2_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small random GPT-2s saved by transformers: the repo's main, and an older revision."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folder = tmp_path_factory.mktemp(f"gpt2_seed{seed}")
        config = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=64, bos_token_id=0,
                            eos_token_id=0)
        GPT2LMHeadModel(config).save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1]


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- listing and metadata (this process's client, fast) --------------------------------------------------------

def test_the_parquet_conversion_branch_is_listed_through_its_encoded_ref(in_process_client: FakeHub):
    """`refs/convert/parquet` is listed through its encoded ref, paged as the Hub pages.

    Seen to catch: no `Link` header on a full page: the client lists 2 of 5 entries. Accepting only encoded special refs
    was not caught: the clients never send them unencoded, so the unencoded form was removed."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    hub = in_process_client
    converted = {f"plain_text/partial-train/{i:04d}.parquet": docs_parquet(10 * i, 10) for i in range(3)}
    hub.add_dataset(OWT, {"README.md": OWT_CARD, "openwebtext.py": "# script\n"},
                    revisions={"refs/convert/parquet": converted})
    api = HfApi(endpoint=hub.url)

    assert sorted(api.list_repo_files(OWT, repo_type="dataset", revision="refs/convert/parquet")) == sorted(converted)
    assert sorted(api.list_repo_files(OWT, repo_type="dataset")) == ["README.md", "openwebtext.py"]
    tree = list(api.list_repo_tree(OWT, path_in_repo="plain_text", recursive=True, repo_type="dataset",
                                   revision="refs/convert/parquet"))
    assert [(type(e), e.path) for e in tree if isinstance(e, RepoFolder)] == [(RepoFolder, "plain_text/partial-train")]
    files = {e.path: e for e in tree if isinstance(e, RepoFile)}
    assert {path: (e.size, e.lfs.sha256) for path, e in files.items()} == {
        path: (len(data), hashlib.sha256(data).hexdigest()) for path, data in converted.items()}
    # The clients send the ref URL-encoded, as one path segment.
    assert any("/tree/refs%2Fconvert%2Fparquet/plain_text" in r.path for r in hub.requests)
    refs = api.list_repo_refs(OWT, repo_type="dataset")
    assert [(c.name, c.ref) for c in refs.converts] == [("parquet", "refs/convert/parquet")]
    assert refs.converts[0].target_commit == hub.commit_sha(OWT, "refs/convert/parquet", repo_type="dataset")

    # Large trees come in pages (a Link header); the client follows them.
    hub.tree_page_size = 2
    before = len(hub.requests)
    assert sorted(api.list_repo_files(OWT, repo_type="dataset", revision="refs/convert/parquet")) == sorted(converted)
    assert len(hub.requests) - before == 3  # 5 entries (2 folders, 3 files) in pages of 2


def test_file_metadata_and_byte_ranges_through_the_client(in_process_client: FakeHub):
    """Streamed reads are byte ranges, and a range is served exactly.

    Seen to catch: the server ignoring `Range` (the whole file, 200): the client reads the wrong bytes."""
    from huggingface_hub import HfFileSystem, get_hf_file_metadata, hf_hub_url

    hub = in_process_client
    weights = bytes(range(256)) * 400  # 102,400 bytes, in LFS by its suffix
    sha = hub.add_model("openai-community/gpt2", {"config.json": '{"n_layer": 1}', "model.safetensors": weights})

    lfs = get_hf_file_metadata(hf_hub_url("openai-community/gpt2", "model.safetensors", endpoint=hub.url))
    assert (lfs.commit_hash, lfs.size, lfs.etag) == (sha, len(weights), hashlib.sha256(weights).hexdigest())
    assert lfs.location.startswith(hub.cdn_url + "/cdn/")  # another origin: the client keeps no token for it
    small = get_hf_file_metadata(hf_hub_url("openai-community/gpt2", "config.json", endpoint=hub.url))
    assert (small.commit_hash, small.size, small.location) == (
        sha, 14, f"{hub.url}/openai-community/gpt2/resolve/main/config.json")

    fs = HfFileSystem(endpoint=hub.url)
    assert fs.info("openai-community/gpt2/config.json", refresh=True)["size"] == 14  # asks paths-info
    assert [r.method for r in hub.requests if "/paths-info/" in r.path] == ["POST"]
    with fs.open("openai-community/gpt2/model.safetensors", "rb", block_size=4096) as f:
        f.seek(50_000)
        assert f.read(100) == weights[50_000:50_100]
    body_reads = [r for r in hub.served("openai-community/gpt2", "model.safetensors") if r.status == 206]
    assert [r.range for r in body_reads] == ["bytes=50000-54195"]  # the 100 bytes + fsspec's read-ahead block
    assert hub.bytes_served("openai-community/gpt2", "model.safetensors") == 4196


# --- weights: snapshot_download ------------------------------------------------------------------------------

@pytest.mark.slow  # a transformers import and three client processes
def test_snapshot_download_by_the_renamed_id_and_at_a_revision(hub: FakeHub, gpt2_folders, tmp_path: Path):
    """A renamed model id downloads through the Hub's 307s, at a tag and a sha, every byte from the server.

    Seen to catch: resolve requests of the old id not redirected (401 RepoNotFound); `X-Repo-Commit` left off file
    answers (FileMetadataError)."""
    new, old = gpt2_folders
    hub.add_model("openai-community/gpt2", new, revisions={"legacy": old}, tags={"v1.0": "legacy"})
    hub.rename("gpt2", "openai-community/gpt2")
    old_sha = hub.commit_sha("openai-community/gpt2", "v1.0")
    home = tmp_path / "hf_home"
    program = '''
    from huggingface_hub import snapshot_download
    report(main=snapshot_download("gpt2"), tag=snapshot_download("gpt2", revision="v1.0"),
           sha=snapshot_download("gpt2", revision="{old_sha}"))
    '''.replace("{old_sha}", old_sha)
    paths = run_client(hub, home, program)

    assert _folder_bytes(Path(paths["main"])) == _folder_bytes(new)
    assert _folder_bytes(Path(paths["tag"])) == _folder_bytes(old)
    assert paths["sha"] == paths["tag"] and Path(paths["tag"]).name == old_sha
    assert Path(paths["main"]).parent.parent.name == "models--gpt2"  # the cache is named after the id asked for
    # Every request named the old id first and was sent on: the Hub's 307 with a path-only Location.
    first_hops = [r for r in hub.requests if "/gpt2/" in r.path and "openai-community" not in r.path]
    assert first_hops and {r.status for r in first_hops} == {307}
    # Every byte came from here, each file once: a file both revisions share (same ETag) is one cached blob.
    new_files, old_files = _folder_bytes(new), _folder_bytes(old)
    expected = [(name, len(data)) for name, data in new_files.items()] + \
        [(name, len(data)) for name, data in old_files.items() if new_files.get(name) != data]
    downloads = [(r.file, r.bytes_sent) for r in hub.served("gpt2") if r.method == "GET" and r.status == 200]
    assert sorted(downloads) == sorted(expected)
    # A pinned commit skips the repo-info call; a second process on the same HF_HOME asks for metadata only.
    assert not any(r.path.endswith(f"/revision/{old_sha}") for r in hub.requests)
    before = len(hub.requests)
    again = run_client(hub, home, 'from huggingface_hub import snapshot_download\nreport(p=snapshot_download("gpt2"))')
    assert again["p"] == paths["main"]
    assert [r.status for r in hub.requests[before:] if r.status in (200, 206) and r.file] == []


# --- datasets: streaming ---------------------------------------------------------------------------------------

@pytest.mark.slow  # two client processes
def test_streaming_the_fineweb_edu_layout_reads_every_row_through_byte_ranges(hub: FakeHub, tmp_path: Path):
    sample = {f"sample/10BT/{i:03d}_00000.parquet": docs_parquet(150 * i, 150) for i in range(2)}
    dump = {"data/CC-MAIN-2024-10/train-00000-of-00001.parquet": docs_parquet(10_000, 20)}
    # datasets infers the builder from the card's first config (default: data/*/*), whatever config is asked
    # for: a revision needs files there too, or it is DataFilesNotFoundError.
    older = {"README.md": FINEWEB_CARD, "sample/10BT/000_00000.parquet": docs_parquet(50_000, 30),
             "data/CC-MAIN-2013-20/train-00000-of-00001.parquet": docs_parquet(60_000, 5)}
    hub.add_dataset(FINEWEB, {"README.md": FINEWEB_CARD, **sample, **dump}, revisions={"v1.0.0": older})
    ids = """
    import datasets
    def ids(**kwargs):
        rows = datasets.load_dataset("HuggingFaceFW/fineweb-edu", split="train", streaming=True, **kwargs)
        return [row["id"] for row in rows]
    """
    got = run_client(hub, tmp_path / "hf_home", ids + """
    report(sample=ids(name="sample-10BT"), default=ids(), pinned=ids(name="sample-10BT", revision="v1.0.0"))
    """)

    assert got["sample"] == [f"<urn:uuid:{i:08d}>" for i in range(300)]  # both files, in order, every row
    assert got["default"] == [f"<urn:uuid:{i:08d}>" for i in range(10_000, 10_020)]
    assert got["pinned"] == [f"<urn:uuid:{i:08d}>" for i in range(50_000, 50_030)]
    parquet_reads = [r for r in hub.served(FINEWEB, repo_type="dataset") if r.file.endswith(".parquet")]
    bodies = [r for r in parquet_reads if r.status in (200, 206)]
    assert bodies and all(r.status == 206 and r.range for r in bodies)  # byte ranges only, never a whole GET
    assert {r.file for r in bodies} == set(sample) | set(dump)  # the older sample file has the same name
    for name, data in sample.items():
        assert hub.bytes_served(FINEWEB, name, repo_type="dataset") >= len(data)
    # Streaming keeps no copy of the data: a second process reads every byte from the server again.
    before = hub.bytes_served(FINEWEB, repo_type="dataset")
    again = run_client(hub, tmp_path / "hf_home", ids + "report(sample=ids(name='sample-10BT'))")
    assert again["sample"] == got["sample"]
    assert hub.bytes_served(FINEWEB, repo_type="dataset") - before >= sum(len(d) for d in sample.values())


@pytest.mark.slow  # one client process
def test_a_script_only_repo_is_refused_and_its_parquet_conversion_streams(hub: FakeHub, tmp_path: Path):
    converted = {"plain_text/partial-train/0000.parquet": docs_parquet(0, 120),
                 "plain_text/partial-train/0001.parquet": docs_parquet(120, 80)}
    hub.add_dataset(OWT, {"README.md": OWT_CARD, "openwebtext.py": "# a loading script\n"},
                    revisions={"refs/convert/parquet": converted})
    hub.rename("openwebtext", OWT, repo_type="dataset")
    program = '''
    import datasets
    def stream(path, **kwargs):
        return [row["id"] for row in datasets.load_dataset(path, split="train", streaming=True, **kwargs)]
    report(script=error(lambda: stream("Skylion007/openwebtext")), renamed=error(lambda: stream("openwebtext")))
    report(converted=stream("Skylion007/openwebtext", revision="refs/convert/parquet",
                            data_files={"train": "plain_text/partial-train/*.parquet"}))
    report(guessed_layout=error(lambda: stream("Skylion007/openwebtext", revision="refs/convert/parquet",
                                               data_files={"train": "plain_text/train/*.parquet"})))
    report(hf_uri=stream("parquet", data_files="hf://datasets/Skylion007/openwebtext@refs%2Fconvert%2Fparquet/"
                                               "plain_text/partial-train/*.parquet"))
    '''
    got = run_client(hub, tmp_path / "hf_home", program)

    for case in ("script", "renamed"):
        assert (got[case]["type"], got[case]["message"]) == (
            "RuntimeError", "Dataset scripts are no longer supported, but found openwebtext.py")
    assert got["converted"] == got["hf_uri"] == [f"<urn:uuid:{i:08d}>" for i in range(200)]
    assert got["guessed_layout"]["type"] == "DataFilesNotFoundError"  # large datasets are under partial-<split>
    # The script was downloaded to learn that it exists; the conversion was read by ranges.
    assert hub.bytes_served(OWT, "openwebtext.py", repo_type="dataset") > 0
    assert all(hub.bytes_served(OWT, name, repo_type="dataset") >= len(data) for name, data in converted.items())


@pytest.mark.slow  # one client process
def test_hellaswag_loads_its_validation_split_with_string_labels(hub: FakeHub, tmp_path: Path):
    splits = {"train": hellaswag_parquet(8, "train"), "validation": hellaswag_parquet(12, "val"),
              "test": hellaswag_parquet(5, "test")}
    hub.add_dataset(HELLASWAG, {"README.md": HELLASWAG_CARD,
                                **{f"data/{s}-00000-of-00001.parquet": d for s, d in splits.items()}})
    hub.rename("hellaswag", HELLASWAG, repo_type="dataset")
    program = '''
    import datasets
    ds = datasets.load_dataset("Rowan/hellaswag", split="validation")
    report(rows=len(ds), labels=list(ds["label"]), label_feature=repr(ds.features["label"]), endings=ds[0]["endings"])
    report(renamed=error(lambda: datasets.load_dataset("hellaswag", split="validation")))
    from huggingface_hub import HfApi
    report(canonical=HfApi().dataset_info("hellaswag").id)
    '''
    got = run_client(hub, tmp_path / "hf_home", program)

    assert got["rows"] == 12 and got["labels"] == [str(i % 4) for i in range(12)]
    assert got["label_feature"] == "Value('string')" and got["endings"] == [f"ending 0.{k}" for k in range(4)]
    # Not streamed: every split's file is downloaded whole (no Range), even for split="validation".
    for split, data in splits.items():
        name = f"data/{split}-00000-of-00001.parquet"
        assert [(r.range, r.bytes_sent) for r in hub.served(HELLASWAG, name, repo_type="dataset")
                if r.status == 200] == [(None, len(data))]
    # A renamed 1-segment dataset id passes the first redirects, then HfFileSystem refuses it; the repo info
    # (through the same redirect) names the current id.
    assert got["renamed"]["type"] == "HfUriError" and "must be 'namespace/name'" in got["renamed"]["message"]
    assert got["canonical"] == HELLASWAG


# --- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # two client processes
def test_what_the_clients_raise_for_unknown_repos_revisions_configs_and_offline(hub: FakeHub, tmp_path: Path):
    """The exception each client raises for an unknown repo, a private repo, revision, file, config or split, and
    offline.

    Seen to catch: RevisionNotFound answered without its `X-Error-Code` (a plain HfHubHTTPError)."""
    hub.add_model("openai-community/gpt2", {"config.json": "{}", "model.safetensors": b"\0" * 64})
    hub.add_model("alice/private", {"config.json": "{}"}, private=True)
    hub.add_dataset(FINEWEB, {"README.md": FINEWEB_CARD, "sample/10BT/000_00000.parquet": docs_parquet(0, 5),
                              "data/CC-MAIN-2024-10/train-00000-of-00001.parquet": docs_parquet(5, 5)})
    online = '''
    import datasets
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    def stream(path, **kwargs):
        return datasets.load_dataset(path, split=kwargs.pop("split", "train"), streaming=True, **kwargs)
    report(model_repo=error(lambda: snapshot_download("nobody/nothing")),
           model_private=error(lambda: snapshot_download("alice/private")),
           model_revision=error(lambda: snapshot_download("openai-community/gpt2", revision="v9")),
           model_file=error(lambda: hf_hub_download("openai-community/gpt2", "nope.json")),
           listing_revision=error(lambda: HfApi().list_repo_files("openai-community/gpt2", revision="v9")),
           dataset_repo=error(lambda: stream("nobody/nothing")),
           dataset_revision=error(lambda: stream("HuggingFaceFW/fineweb-edu", name="sample-10BT", revision="v9")),
           dataset_config=error(lambda: stream("HuggingFaceFW/fineweb-edu", name="sample-99BT")),
           dataset_split=error(lambda: stream("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="validation")))
    snapshot_download("openai-community/gpt2")
    '''
    home = tmp_path / "hf_home"
    got = run_client(hub, home, online)
    kinds = {case: (e["type"], e["chain"][1] if len(e["chain"]) > 1 else None) for case, e in got.items()}
    assert kinds == {
        "model_repo": ("RepositoryNotFoundError", "HTTPStatusError"),  # a 401 without a token, 404 with one
        "model_private": ("RepositoryNotFoundError", "HTTPStatusError"),  # no token: as if it did not exist
        "model_revision": ("RevisionNotFoundError", "HTTPStatusError"),
        "model_file": ("RemoteEntryNotFoundError", "HTTPStatusError"),
        "listing_revision": ("RevisionNotFoundError", "HTTPStatusError"),
        "dataset_repo": ("DatasetNotFoundError", "FileNotFoundError"),
        "dataset_revision": ("DatasetNotFoundError", "RevisionNotFoundError"),
        "dataset_config": ("ValueError", None),
        "dataset_split": ("ValueError", None),
    }
    assert got["dataset_config"]["message"] == "BuilderConfig 'sample-99BT' not found. Available: ['default', " \
                                               "'sample-10BT']"
    assert got["dataset_revision"]["message"] == "Revision 'v9' doesn't exist for dataset 'HuggingFaceFW/fineweb-edu'" \
                                                 " on the Hub."

    offline = '''
    import datasets
    from huggingface_hub import snapshot_download
    report(cached=error(lambda: snapshot_download("openai-community/gpt2")),
           uncached=error(lambda: snapshot_download("openai-community/gpt2", revision="v9")),
           dataset=error(lambda: datasets.load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT",
                                                       split="train", streaming=True)))
    '''
    before = len(hub.requests)
    got = run_client(hub, home, offline, extra_env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert len(hub.requests) == before  # offline means no request at all
    assert got["cached"] is None  # a snapshot downloaded once is found offline
    assert got["uncached"]["chain"][:2] == ["LocalEntryNotFoundError", "OfflineModeIsEnabled"]
    assert (got["dataset"]["type"], got["dataset"]["message"]) == (
        "ConnectionError", "Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (OfflineModeIsEnabled)")


# --- faults ----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # one client process
def test_what_streaming_does_on_5xx_and_dropped_connections(hub: FakeHub, tmp_path: Path):
    # One repo per case, each with its own fault, so that one client process runs them all.
    data = docs_parquet(0, 200)
    cases = ["two-503", "one-drop", "six-500", "eight-504", "eight-drops"]
    for case in cases:
        hub.add_dataset(f"faults/{case}", {"README.md": SAMPLE_CARD, "sample/10BT/000_00000.parquet": data})
    parquet = {"method": "GET", "file": "*.parquet"}
    hub.fail_next(2, 503, repo="datasets/faults/two-503", **parquet)
    hub.drop_next(1, repo="datasets/faults/one-drop", **parquet)  # half-way through the parquet body (on the CDN)
    hub.fail_next(6, 500, repo="datasets/faults/six-500", **parquet)
    hub.fail_next(8, 504, repo="datasets/faults/eight-504", **parquet)
    hub.drop_next(8, repo="datasets/faults/eight-drops", **parquet)
    program = NO_BACKOFF_SLEEP + textwrap.dedent(f"""
    for case in {cases!r}:
        def stream():
            rows = datasets.load_dataset(f"faults/{{case}}", name="sample-10BT", split="train", streaming=True)
            report(**{{case: len(list(rows))}})
        failure = error(stream)
        if failure:
            report(**{{case: failure}})
    """)
    got = run_client(hub, tmp_path / "hf_home", program)

    assert got["two-503"] == 200  # huggingface_hub retries a 5xx (5 times, 1-8 s apart)
    assert got["one-drop"] == 200  # ... and a connection cut mid-body (httpx's RemoteProtocolError)
    # Six 500s outlast huggingface_hub's 5 retries; datasets does not retry a 500: it ends the iteration.
    assert got["six-500"]["type"] == "HfHubHTTPError" and "500" in got["six-500"]["message"]
    assert got["eight-504"] == 200  # a 504 is retried again by datasets (its own 20 tries), after hub's 5
    assert got["eight-drops"] == 200  # as is a connection error
    for case, n in {"two-503": 2, "six-500": 6, "eight-504": 8, "one-drop": 1, "eight-drops": 8}.items():
        assert sum(r.fault is not None for r in hub.served(f"faults/{case}", repo_type="dataset")) == n, case


@pytest.mark.slow  # one client process
def test_what_snapshot_download_does_on_5xx_and_dropped_connections(hub: FakeHub, tmp_path: Path):
    """What each client retries: a 5xx, a body cut short (also
    `test_what_streaming_does_on_5xx_and_dropped_connections`).

    Seen to catch: a drop that sends the whole body; a fault never used up (the retried HEAD fails again)."""
    weights = os.urandom(300_000)
    cases = ["info-500", "head-500", "get-500", "drop"]
    for case in cases:
        hub.add_model(f"faults/{case}", {"config.json": "{}", "model.safetensors": weights})
    hub.fail_next(1, 500, path="/api/models/faults/info-500/revision/*")
    hub.fail_next(1, 500, method="HEAD", repo="faults/head-500", file="model.safetensors")
    hub.fail_next(1, 500, method="GET", repo="faults/get-500", file="model.safetensors")
    hub.drop_next(1, repo="faults/drop", file="model.safetensors")
    program = f"""
    from huggingface_hub import snapshot_download
    for case in {cases!r}:
        report(**{{case: error(lambda: snapshot_download(f"faults/{{case}}")) or "ok"}})
    report(dropped_file=open(snapshot_download("faults/drop") + "/model.safetensors", "rb").read().hex())
    """
    got = run_client(hub, tmp_path / "hf_home", program)

    # The repo-info call is not retried: one 500 on an empty cache ends snapshot_download.
    assert got["info-500"]["chain"][:2] == ["LocalEntryNotFoundError", "HfHubHTTPError"]
    assert [r.status for r in hub.requests if "/api/models/faults/info-500/" in r.path] == [500]
    assert got["head-500"] == "ok"  # a failed HEAD is asked again, with retries
    # A 5xx on the file's body is not retried (http_get retries only 408/429): the error surfaces.
    assert got["get-500"]["type"] == "HfHubHTTPError" and "500" in got["get-500"]["message"]
    # A cut body is resumed; below 10 MiB nothing was written yet, so the whole file comes again.
    assert got["drop"] == "ok" and bytes.fromhex(got["dropped_file"]) == weights
    assert [(r.range, r.bytes_sent) for r in hub.served("faults/drop", "model.safetensors") if r.status == 200] == \
        [(None, 150_000), (None, 300_000)]
