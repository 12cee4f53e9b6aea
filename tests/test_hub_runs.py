"""The commands a new user starts with, against the loopback Hub (tests/fake_hub.py) through the real clients.

Every command runs as a user's process does: a new process (1, or 2 through accelerate) with HF_ENDPOINT pointing
at the loopback Hub and an HF_HOME of its own, empty unless said otherwise. The Hub holds the real repos' layouts:
GPT-2 renamed to openai-community/gpt2 (a tiny one, with GPT-2's vocabulary), FineWeb-Edu's card (`configs:`
front matter) and `sample/10BT/*.parquet`, OpenWebText as a loading script whose data is only in its partial
parquet conversion (`refs/convert/parquet`, `plain_text/partial-train/`), HellaSwag with string labels. The
server's byte counts prove the data came through it, not from a cache; the references are independent runs
(an uninterrupted run for a resume, local files holding the same rows for the evaluation).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO_ROOT, TINY, assert_same_weights, free_port, launch, read_metrics, resume_copy
from fake_hub import FakeHub
from test_fake_hub import (
    FINEWEB,
    FINEWEB_CARD,
    HELLASWAG,
    HELLASWAG_CARD,
    OWT,
    OWT_CARD,
    docs_parquet,
    hellaswag_parquet,
)

from data import EOT_ID, get_tokenizer
from data.hub import PARQUET_BRANCH
from data.shards import open_shards

GPT2 = "openai-community/gpt2"
# Fine-tuning the tiny GPT-2 for 6 steps, a checkpoint every 2; resumed from step 2.
STEPS = ["--max_steps", "6", "--micro_batch_size", "2", "--total_batch_size", "128", "--save_every", "2",
         "--log_every", "1", "--eval_every", "3"]
FINETUNE = [*TINY, *STEPS, "--init_from", "gpt2"]


@pytest.fixture(scope="module")
def hub(tiny_hf_gpt2: Path):
    """One loopback Hub for the module, holding the four repos; its `gpt2` is the session's tiny GPT-2."""
    with FakeHub() as server:
        server.add_model(GPT2, tiny_hf_gpt2)
        server.rename("gpt2", GPT2)
        # 4 files: 2 ranks read whole files; the first 1,000 documents validate, so both ranks keep training ones.
        sample = {f"sample/10BT/{i:03d}_00000.parquet": docs_parquet(400 * i, 400) for i in range(4)}
        dump = {"data/CC-MAIN-2024-10/train-00000-of-00001.parquet": docs_parquet(90_000, 10)}
        server.add_dataset(FINEWEB, {"README.md": FINEWEB_CARD, **sample, **dump})
        converted = {f"plain_text/partial-train/{i:04d}.parquet": docs_parquet(10_000 + 500 * i, 500) for i in range(3)}
        server.add_dataset(OWT, {"README.md": OWT_CARD, "openwebtext.py": "# a loading script\n"},
                           revisions={PARQUET_BRANCH: converted})
        hellaswag = {s: hellaswag_parquet(n, s) for s, n in (("train", 4), ("validation", 12), ("test", 3))}
        server.add_dataset(HELLASWAG, {"README.md": HELLASWAG_CARD,
                                       **{f"data/{s}-00000-of-00001.parquet": d for s, d in hellaswag.items()}})
        yield server
    assert server.unknown == [], f"the clients called endpoints the fake hub does not know: {server.unknown}"


def env(hub: FakeHub, home: Path) -> dict[str, str]:
    return {**hub.client_env(home), "HF_TOKEN": ""}


def weights_served(hub: FakeHub) -> int:
    return hub.bytes_served(GPT2, "model.safetensors")


def run_module(hub: FakeHub, home: Path, module: str, args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    """`python -m module args` (or `accelerate launch -m` with 2 processes) pointed at the loopback Hub."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO_ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--num_processes", str(nproc),
                "--main_process_port", str(free_port()), "-m"] if nproc > 1 else [sys.executable, "-m"]
    proc = subprocess.run([*launcher, module, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env(hub, home)})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2])  # one process streams and resumes the same way: the OpenWebText test's
def test_fineweb_edu_fine_tune_of_gpt2_resumes_bit_exact(hub: FakeHub, tmp_path: Path, nproc: int):
    """`--init_from gpt2 --dataset HuggingFaceFW/fineweb-edu:sample-10BT`, every process starting at once on an
    empty cache; with 2 processes, HellaSwag from the Hub every 3 steps too.

    Resumed from its own checkpoint bit-exact; config.yaml and the card pin both commits. Resuming after the dataset's
    main moved is refused, naming `id[:config]@<saved sha>` (`[1]`). The one-process case was left out for CI time; a
    one-process streamed run resumes bit-exact in the OpenWebText test.

    Seen to catch: the stream read without its commit (main): after main moved, the resumed pinned run's weights
    differ."""
    args = [*FINETUNE, "--dataset", f"{FINEWEB}:sample-10BT"]
    if nproc == 2:
        args += ["--hellaswag_every", "3", "--hellaswag_limit", "8"]
    before, sample_before = weights_served(hub), hub.bytes_served(FINEWEB, repo_type="dataset")
    ref = tmp_path / "ref"
    launch([*args, "--out_dir", str(ref)], nproc=nproc, extra_env=env(hub, tmp_path / "hf_ref"))
    weights = (ref / "final" / "model.safetensors")
    assert weights_served(hub) - before >= (hub.files(GPT2)["model.safetensors"].__len__())  # through the server
    assert hub.bytes_served(FINEWEB, repo_type="dataset") - sample_before >= 4 * len(docs_parquet(0, 400)) // 2
    recorded = yaml.safe_load((ref / "config.yaml").read_text())
    commit, gpt2_commit = hub.commit_sha(FINEWEB, repo_type="dataset"), hub.commit_sha(GPT2)
    assert (recorded["dataset"], recorded["init_from"]) == (f"{FINEWEB}:sample-10BT@{commit}", f"gpt2@{gpt2_commit}")
    card = (ref / "final" / "README.md").read_text()
    assert f"base_model: {GPT2}" in card and f"](https://huggingface.co/{GPT2}/tree/{gpt2_commit}) at revision" in card
    if nproc == 2:
        assert [r["step"] for r in read_metrics(ref) if "hellaswag_acc" in r] == [3, 6]
    assert weights.is_file()

    # Resumed from its own checkpoint of step 2 (conftest.resume_copy), on an empty cache of its own.
    out = tmp_path / "run"
    resume = resume_copy(ref, 2, out)
    if nproc == 1:  # main moves on while the run is down: the saved position names the commit it read
        files = hub.files(FINEWEB, repo_type="dataset")
        hub.add_dataset(FINEWEB, {**files, "sample/10BT/002_00000.parquet": docs_parquet(5000, 400)})  # rewritten
        moved = launch([*args, *resume], check=False, extra_env=env(hub, tmp_path / "hf_run"))
        assert moved.returncode == 2 and moved.stderr.strip().splitlines()[-1] == (
            f"error: the streaming data position was saved reading commit {commit} of the dataset, which now reads "
            f"commit {hub.commit_sha(FINEWEB, repo_type='dataset')}; resume with --dataset pinned to it "
            f"(id[:config]@{commit})")
        args[args.index("--dataset") + 1] = recorded["dataset"]  # as config.yaml recorded it
    served = hub.bytes_served(FINEWEB, repo_type="dataset")
    launch([*args, *resume], nproc=nproc, extra_env=env(hub, tmp_path / "hf_run"))
    if nproc == 1:
        hub.add_dataset(FINEWEB, files)  # main as the other tests expect it
    assert hub.bytes_served(FINEWEB, repo_type="dataset") > served  # the resumed stream read the Hub again
    assert_same_weights(ref, out)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_openwebtext_trains_resumes_exactly_and_prepares_shards(hub: FakeHub, tmp_path: Path):
    """`--dataset Skylion007/openwebtext`: a script-only repo, read from its partial parquet conversion.

    It trains, resumes bit-exact and `data.prepare`s every token, in the stream's order, from the partial conversion,
    saying so in one line.

    Seen to catch: not broken on purpose: the conversion is what makes it run (without it, "Dataset scripts are no
    longer supported")."""
    args = [*TINY, *STEPS, "--dataset", OWT]
    ref = tmp_path / "ref"
    proc = launch([*args, "--out_dir", str(ref)], extra_env=env(hub, tmp_path / "hf"))
    assert f"{OWT} holds a loading script, which datasets no longer runs: reading its parquet conversion" in proc.stdout
    conversion = hub.commit_sha(OWT, PARQUET_BRANCH, repo_type="dataset")
    assert yaml.safe_load((ref / "config.yaml").read_text())["dataset"] == f"{OWT}:plain_text@{conversion}"
    out = tmp_path / "run"
    launch([*args, *resume_copy(ref, 2, out)], extra_env=env(hub, tmp_path / "hf"))
    assert_same_weights(ref, out)

    # data.prepare from the same Hub id: the same documents, in the stream's order.
    served = hub.bytes_served(OWT, repo_type="dataset")
    shards = tmp_path / "shards"
    prepared = run_module(hub, tmp_path / "hf", "data.prepare", ["--dataset", OWT, "--out", str(shards),
                                                                 "--val_tokens", "2000", "--shard_tokens", "20000"])
    assert hub.bytes_served(OWT, repo_type="dataset") - served >= sum(
        len(data) for data in hub.files(OWT, PARQUET_BRANCH, repo_type="dataset").values())
    assert prepared.stdout.startswith(f"{OWT} holds a loading script, which datasets no longer runs: reading its ")
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["complete"] and manifest["total_val_tokens"] == 2000 and len(manifest["train"]) >= 2
    texts = [t for name, data in sorted(hub.files(OWT, PARQUET_BRANCH, repo_type="dataset").items())
             for t in pq.read_table(io.BytesIO(data)).column("text").to_pylist()]
    enc = get_tokenizer()
    expected = [tok for t in texts for tok in enc.encode_ordinary(t) + [EOT_ID]]
    loaded = open_shards(shards)
    assert loaded.val.tolist() + [t for s in loaded.train for t in s.tolist()] == expected


@pytest.mark.slow
def test_hellaswag_from_the_hub_on_two_processes_and_sampling_gpt2(hub: FakeHub, tmp_path: Path):
    """`eval.hellaswag --model gpt2` with HellaSwag from the Hub (string labels) on 2 processes, against the same
    rows from a local file; `model.sample --model gpt2`.

    Seen to catch: not broken on purpose: the label conversion is `eval/hellaswag_data.check_item`'s, tested in
    test_eval_hellaswag."""
    rows = pq.read_table(io.BytesIO(hub.files(HELLASWAG, repo_type="dataset")[
        "data/validation-00000-of-00001.parquet"])).to_pylist()
    local = tmp_path / "hellaswag.jsonl"
    local.write_text("".join(json.dumps({**row, "label": int(row["label"])}) + "\n" for row in rows))
    served = hub.bytes_served(HELLASWAG, repo_type="dataset")
    from_hub = run_module(hub, tmp_path / "hf", "eval.hellaswag", ["--model", "gpt2", "--output",
                                                                   str(tmp_path / "hub.json")], nproc=2)
    assert hub.bytes_served(HELLASWAG, repo_type="dataset") > served, from_hub.stdout
    run_module(hub, tmp_path / "hf", "eval.hellaswag", ["--model", "gpt2", "--data", str(local), "--output",
                                                        str(tmp_path / "local.json")])
    got, want = (json.loads((tmp_path / name).read_text()) for name in ("hub.json", "local.json"))
    assert {k: got[k] for k in ("n", "acc", "acc_norm")} == {k: want[k] for k in ("n", "acc", "acc_norm")}
    assert got["n"] == 12

    before = weights_served(hub)
    sampled = run_module(hub, tmp_path / "hf_sample", "model.sample", ["--model", "gpt2", "--prompt", "Hello",
                                                                       "--max_new_tokens", "5", "--seed", "0"])
    assert sampled.stdout.startswith("Hello") and weights_served(hub) - before == len(
        hub.files(GPT2)["model.safetensors"])


# --- network faults during a long stream -------------------------------------------------------------------------

FAULTY = "faults/stream"
# 14 steps of 128 tokens; the first document batch (256 short documents after the 1,000 validation ones, in file
# 000) lasts about 10 steps, then file 001 is read, where the faults are: never by the setup's validation read.
FAULT_RUN = [*TINY, "--max_steps", "14", "--micro_batch_size", "2", "--total_batch_size", "128", "--save_every", "4",
             "--log_every", "1", "--dataset", f"{FAULTY}:sample-10BT"]


def text_parquet(texts: list[str]) -> bytes:
    import pyarrow as pa

    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buffer, row_group_size=100)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def fault_ref(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The faulty repo (FineWeb-Edu's layout) and its uninterrupted run: the reference of the fault tests."""
    def texts(first: int, count: int) -> list[str]:
        return pq.read_table(io.BytesIO(docs_parquet(first, count))).column("text").to_pylist()

    hub.add_dataset(FAULTY, {"README.md": FINEWEB_CARD,
                             "sample/10BT/000_00000.parquet": text_parquet(texts(0, 1000) + [f"Doc {i}." for i in
                                                                                             range(256)]),
                             "sample/10BT/001_00000.parquet": text_parquet(texts(2000, 300)),
                             "data/CC-MAIN-2024-10/train-00000-of-00001.parquet": text_parquet(texts(90_000, 10))})
    ref = tmp_path_factory.mktemp("fault_ref") / "run"
    launch([*FAULT_RUN, "--out_dir", str(ref)], extra_env=env(hub, ref.parent / "hf"))
    assert hub.bytes_served(FAULTY, "sample/10BT/001_00000.parquet", repo_type="dataset") > 0  # the run got there
    return ref


def faults_served(hub: FakeHub) -> int:
    return sum(r.fault is not None for r in hub.served(FAULTY, repo_type="dataset"))


@pytest.mark.slow
def test_5xx_and_a_dropped_connection_mid_stream_do_not_end_the_run(hub: FakeHub, fault_ref: Path, tmp_path: Path):
    # Eight 500s: six outlast huggingface_hub's retries and end datasets' iteration; the batch is read again.
    """8 x 500 and a dropped body mid-stream (more than huggingface_hub retries; datasets does not retry a 500) do not
    end a run, which stays bit-exact.

    Seen to catch: `READ_RETRIES = 0`: the run ends (exit 2, HfHubHTTPError 500)."""
    hub.fail_next(8, 500, repo=f"datasets/{FAULTY}", file="sample/10BT/001_*")
    hub.drop_next(1, repo=f"datasets/{FAULTY}", file="sample/10BT/001_*")
    before = faults_served(hub)
    out = tmp_path / "run"
    launch([*FAULT_RUN, "--out_dir", str(out)], extra_env={**env(hub, tmp_path / "hf"), "NO_RETRY_WAIT": "1"})
    hub.clear_faults()
    assert faults_served(hub) - before == 9
    assert_same_weights(fault_ref, out)


@pytest.mark.slow
def test_a_hub_that_stays_down_ends_the_run_with_a_checkpoint_to_resume(hub: FakeHub, fault_ref: Path,
                                                                      tmp_path: Path):
    """A Hub that stays down ends the run with the last completed step saved and one line naming `--resume latest`; the
    resume is bit-exact.

    Seen to catch: seen failing while written: the step saved is the one reached, 7, not a multiple of --save_every."""
    hub.fail_next(10**6, 503, repo=f"datasets/{FAULTY}", file="sample/10BT/001_*")
    out = tmp_path / "run"
    down = launch([*FAULT_RUN, "--out_dir", str(out)], check=False,
                  extra_env={**env(hub, tmp_path / "hf"), "NO_RETRY_WAIT": "1"})
    hub.clear_faults()
    saved = sorted((out / "checkpoints").glob("step_*"))[-1]
    step = int(saved.name.removeprefix("step_"))
    assert down.returncode == 2 and step % 4 and not (out / "final").exists()  # saved for the failure (not every 4)
    assert down.stderr.strip().splitlines()[-1] == (
        f"error: the training data could not be read (see the line above); step {step} is saved in {saved}: "
        "continue with --resume latest when the Hub answers again")
    assert f"rank 0: reading {FAULTY}:sample-10BT failed 6 times" in down.stdout
    launch([*FAULT_RUN, "--out_dir", str(out), "--resume", "latest"], extra_env=env(hub, tmp_path / "hf"))
    assert_same_weights(fault_ref, out)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 15))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_on_two_processes_one_ranks_unreadable_file_stops_both_in_one_line(hub: FakeHub, fault_ref: Path,
                                                                          tmp_path: Path):
    """Two ranks split the two files: only the rank that reads file 001 fails. The other must not wait for it in a
    collective: both stop at the same step, the run ends in one line (exit 2), and --resume latest finishes it.

    Seen to catch: the ranks not agreeing (`draw_step` returns None on the failing rank only): the other rank fails in
    the step's collective, no one-line error."""
    hub.fail_next(10**6, 503, repo=f"datasets/{FAULTY}", file="sample/10BT/001_*")
    out = tmp_path / "run"
    down = launch([*FAULT_RUN, "--out_dir", str(out)], nproc=2, check=False,
                  extra_env={**env(hub, tmp_path / "hf"), "NO_RETRY_WAIT": "1"})
    hub.clear_faults()
    assert down.returncode != 0  # the launcher's own code; each rank exits 2 (below)
    assert "exitcode  : 2" in down.stderr, down.stderr[-3000:]
    lines = [line for line in down.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: the training data could not be read"), lines
    failed = {rank for rank in (0, 1) if f"rank {rank}: reading {FAULTY}:sample-10BT failed" in down.stdout}
    assert len(failed) == 1  # one rank's data failed; the other stopped because they agreed
    assert not (out / "final").exists()
    launch([*FAULT_RUN, "--out_dir", str(out), "--resume", "latest"], nproc=2, extra_env=env(hub, tmp_path / "hf"))
    assert (out / "final" / "model.safetensors").is_file()
    assert sorted({r["step"] for r in read_metrics(out) if "loss" in r}) == list(range(1, 15))
