"""The config schema and the shipped presets."""
import dataclasses
import re
from pathlib import Path

import pytest
from conftest import project_files

from common.errors import UserError
from configs import PRESETS_DIR, PresetConfig, TrainConfig, parse_config
from training.evaluations import registry as evaluations  # noqa: F401  their own flags, as train.py reads them
from training.optimizers import registry  # noqa: F401  the optimizers' own flags, as train.py reads them


@pytest.mark.parametrize("preset", [p.name for p in project_files(suffix=".yaml") if p.parent == PRESETS_DIR])
def test_every_preset_parses(preset):
    cfg = parse_config(["--config", preset])
    assert cfg.training.total_batch_size % (cfg.training.micro_batch_size * cfg.model.block_size) == 0


def test_shakespeare_preset_is_the_default():
    cfg = parse_config(["--config", "shakespeare.yaml"])
    assert dataclasses.replace(cfg, preset=PresetConfig()) == TrainConfig()


def test_flags_override_the_preset(tmp_path: Path):
    preset = tmp_path / "p.yaml"
    preset.write_text("lr: 6e-4\nmax_steps: 5\nbias: false\nhellaswag_limit: 3\n")  # YAML reads 6e-4 as a string
    cfg = parse_config(["--config", str(preset), "--max_steps", "7"])
    assert (cfg.optim.lr, cfg.training.max_steps, cfg.model.bias, cfg.added["hellaswag"].hellaswag_limit) == \
        (6e-4, 7, False, 3)


def test_gpt2_124m_preset_is_the_build_nanogpt_recipe():
    cfg = parse_config(["--config", "gpt2_124m_fineweb_edu.yaml"])
    model, training = cfg.model, cfg.training
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size) == (12, 12, 768, 1024)
    hellaswag = cfg.added["hellaswag"]
    assert (training.total_batch_size, cfg.optim.lr, cfg.optim.warmup_steps, hellaswag.hellaswag_every) == \
        (524_288, 6e-4, 715, 250)
    assert training.max_steps * training.total_batch_size == pytest.approx(10e9, rel=1e-3)  # one pass over 10B


def _bad_paths(tmp: Path) -> dict[str, str]:
    """Paths of the wrong kind under tmp: a file, a folder, a missing name."""
    (tmp / "file.txt").write_text("x")
    (tmp / "folder").mkdir()
    return {"file": str(tmp / "file.txt"), "folder": str(tmp / "folder"), "missing": str(tmp / "missing")}


# (flags, fragment of the one-line message); {file}/{folder}/{missing} are filled with paths under tmp_path.
BAD_VALUES = [
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--lr=-1e-3"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--min_lr_ratio", "1.5"], "--min_lr_ratio must be in [0, 1]"),
    (["--min_lr_ratio", "-0.1"], "--min_lr_ratio must be in [0, 1]"),
    (["--warmup_steps", "-1"], "--warmup_steps must be 0 or more, got -1"),
    (["--weight_decay", "-0.1"], "--weight_decay must be 0 or more"),
    (["--beta1", "1.0"], "--beta1 must be in [0, 1), got 1.0"),
    (["--beta2", "-0.5"], "--beta2 must be in [0, 1)"),
    (["--grad_clip", "-1"], "--grad_clip must be 0 (no clipping) or more"),
    (["--dropout", "1.0"], "dropout must be in [0, 1)"),
    (["--hellaswag_every", "-5"], "--hellaswag_every must be 0 or more"),
    (["--hellaswag_limit", "0"], "--hellaswag_limit must be at least 1, got 0"),
    (["--sample_tokens", "-1"], "--sample_tokens must be 0 or more"),
    (["--hub_push_every", "-2"], "--hub_push_every must be 0 or more"),
    (["--mfu_peak_flops", "0"], "--mfu_peak_flops must be positive"),
    (["--mfu_peak_flops=-1e12"], "--mfu_peak_flops must be positive"),
    (["--max_steps", "0"], "--max_steps must be positive, got 0"),
    (["--keep_last", "0"], "--keep_last must be positive"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["--val_tokens", "100", "--block_size", "128"], "--val_tokens 100 is less than one validation window (block_size "
     "+ 1 = 129); pass --val_tokens 129 or more, or a --block_size of at most 99"),
    (["--block_size", "100000"], "--block_size 100000 needs a validation window of block_size + 1 = 100001 tokens, "
     "more than --val_tokens 8192; pass a --block_size of at most 8191, or --val_tokens 100001 or more"),  # issue 55
    (["--n_embd", "130"], "--n_embd (130) must be divisible by --n_head (4)"),
    (["--text_column", ""], "--text_column is empty"),
    (["--dataset", " "], "--dataset is empty"),
    (["--out_dir", ""], "--out_dir is empty"),
    (["--run_name", ""], "--run_name is empty"),
    (["--dataset_config", ""], "--dataset_config is empty"),
    (["--sample_prompt", ""], "sample_prompt is empty"),
    (["--on_nan", "ignore"], "on_nan must be 'stop' or 'skip'"),
    (["--report_to", "mlflow"], "report_to must be one of"),
    (["--push_to_hub", "true"], "--push_to_hub needs --hub_model_id"),
    (["--out_dir", "{file}"], "is an existing file, not a folder; choose another --out_dir"),
    (["--resume", "{file}"], "is a file; pass 'latest'"),
    (["--resume", "{missing}"], "no such folder; pass 'latest'"),
    (["--init_from", "{file}"], "is a file; pass 'scratch'"),
    (["--init_from", "./no/such/model"], "--init_from ./no/such/model: no such folder"),
    (["--hellaswag_data", "{folder}"], "is a folder; pass a HellaSwag .jsonl"),
    (["--hellaswag_data", "{missing}"], "is not an existing file; pass a HellaSwag .jsonl"),
]


@pytest.mark.parametrize("flags,fragment", BAD_VALUES, ids=[" ".join(f)[:40] for f, _ in BAD_VALUES])
def test_bad_values_are_one_line_user_errors(tmp_path: Path, flags, fragment):
    """Each bad value is one UserError line. A window longer than the validation cap names both ways out, leading with
    `--block_size` where the cap is at its default (`--block_size 100000` used to advise only `--val_tokens 100001`).

    Seen to catch: `block_changed` always False: the `--block_size 100000` case fails (the val_tokens-first line)."""
    paths = _bad_paths(tmp_path)
    argv = [f.format(**paths) for f in flags]
    with pytest.raises(UserError) as err:
        parse_config(["--out_dir", str(tmp_path / "run"), *argv])
    message = str(err.value)
    assert fragment in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_every_bad_value_names_its_flag(tmp_path: Path):
    """Each refusal above spells the flag it refuses as the user types it, `--name` (issue 55: "report_to must be one
    of", "dropout must be in", without their --).

    A preset's unknown key suggests the key and its flag (`lr for learning_rate, the flag --lr`):
    `test_cli.py::test_unknown_preset_fields_suggest_the_field`.

    Seen to catch: `--report_to`'s `--` removed again: the rule test lists its message."""
    paths = _bad_paths(tmp_path)
    unnamed = []
    for flags, _ in BAD_VALUES:
        with pytest.raises(UserError) as err:
            parse_config(["--out_dir", str(tmp_path / "run"), *[f.format(**paths) for f in flags]])
        if flags[0].split("=")[0] not in str(err.value):
            unnamed.append(str(err.value))
    assert unnamed == []


@pytest.mark.parametrize("yaml_text,fragment", [
    ("max_steps: 2.5\n", "p.yaml: max_steps: 2.5 is not an int; fix that key in the file"),
    ("max_steps: true\n", "p.yaml: max_steps: True is not an int"),
    ("n_layer: two\n", "p.yaml: n_layer: 'two' is not an int"),  # was argparse's "argument --n_layer: invalid ..."
    ("lr: [1, 2]\n", "p.yaml: lr: [1, 2] is not a float"),
    ("dataset: null\n", "p.yaml: dataset: None is not a str"),
    ("run_name: 7\n", "p.yaml: run_name: 7 is not a str"),
    ("grad_clip: .nan\n", "--grad_clip must be a finite number"),
])
def test_bad_preset_types(tmp_path: Path, yaml_text, fragment):
    """A value of the wrong type is named where it is: the preset file and its key, not a flag never passed.

    Seen to catch: the string handed on to argparse again: `argument --n_layer/--n-layer: invalid int value: 'two'`."""
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml_text)
    with pytest.raises(UserError, match=re.escape(fragment)) as err:
        parse_config(["--config", str(preset), "--out_dir", str(tmp_path / "run")])
    if "finite" not in fragment:  # a value check, the same for a flag and a preset
        assert str(err.value).startswith(f"--config {preset}: ")


def test_whole_floats_in_a_preset_are_ints(tmp_path: Path):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_steps: 1.0e+3\nhellaswag_limit: 10.0\n")  # YAML reads both as floats
    cfg = parse_config(["--config", str(preset)])
    hellaswag = cfg.added["hellaswag"]
    assert (cfg.training.max_steps, hellaswag.hellaswag_limit) == (1000, 10)
    assert type(cfg.training.max_steps) is int and type(hellaswag.hellaswag_limit) is int


def test_good_paths_pass(tmp_path: Path):
    paths = _bad_paths(tmp_path)
    cfg = parse_config(["--out_dir", paths["folder"], "--resume", paths["folder"], "--init_from", "gpt2",
                        "--hellaswag_data", paths["file"], "--hellaswag_limit", "1", "--mfu_peak_flops", "1e12"])
    assert (cfg.run.resume, cfg.model.init_from, cfg.added["hellaswag"].hellaswag_data) == \
        (paths["folder"], "gpt2", paths["file"])


def test_the_evaluation_batch_defaults_to_the_micro_batch():
    """Left out, --eval_batch_size is the run's --micro_batch_size (an evaluation forward then holds no more tokens
    than a training one: its peak stays under the step's, issue 32), resolved once so config.yaml records the number
    eval.val_loss reproduces the run's loss with; given, it keeps its value.

    Seen to catch: the default resolved to 16: fails."""
    cfg = parse_config(["--micro_batch_size", "4", "--total_batch_size", "512"])
    assert cfg.eval.eval_batch_size == 4 and cfg.flat()["eval_batch_size"] == 4
    given = parse_config(["--micro_batch_size", "4", "--total_batch_size", "512", "--eval_batch_size", "16"])
    assert given.eval.eval_batch_size == 16
    with pytest.raises(UserError, match="--eval_batch_size must be positive"):
        parse_config(["--eval_batch_size", "0"])


# ---- presets compose (issue 60): in order, with includes, every one recorded -----------------------------------

def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_presets_apply_in_order_then_the_flags(tmp_path: Path):
    """Seen to catch: parse_config reading only the last --config (a.yaml silently dropped, config.yaml naming b.yaml
    alone)."""
    a = _write(tmp_path / "a.yaml", "lr: 1e-3\nmax_steps: 5\nn_layer: 3\n")
    b = _write(tmp_path / "b.yaml", "max_steps: 7\nwarmup_steps: 2\n")
    cfg = parse_config(["--config", a, "--config", b, "--n_layer", "2"])
    assert (cfg.optim.lr, cfg.training.max_steps, cfg.optim.warmup_steps, cfg.model.n_layer) == (1e-3, 7, 2, 2)
    assert cfg.preset.config == [a, b] and cfg.flat()["config"] == [a, b]  # what config.yaml records
    assert parse_config([a, "--config", b, "--n_layer", "2"]) == cfg  # a preset given first is the first --config
    assert parse_config([a, b, "--n_layer", "2"]) == cfg
    assert parse_config(["--config", b, "--config", a]).training.max_steps == 5  # the later one wins


def test_a_preset_includes_presets_relative_to_itself(tmp_path: Path, monkeypatch):
    """A preset's `config:` key is an include, read relative to the preset, before the preset's own values; a preset
    reached twice is applied once. Seen to catch: the `config:` key accepted and ignored (the base's values absent)."""
    base = _write(tmp_path / "presets" / "base" / "model.yaml", "n_layer: 3\nlr: 1e-3\nmax_steps: 9\n")
    _write(tmp_path / "presets" / "mine.yaml", "config: base/model.yaml\nlr: 2e-3\n")
    _write(tmp_path / "presets" / "other.yaml", "config: [base/model.yaml]\nwarmup_steps: 3\n")
    monkeypatch.chdir(tmp_path / "presets" / "base")  # not where the presets are: includes do not follow the cwd
    mine, other = str(tmp_path / "presets" / "mine.yaml"), str(tmp_path / "presets" / "other.yaml")
    cfg = parse_config(["--config", mine, "--config", other, "--max_steps", "4"])
    assert (cfg.model.n_layer, cfg.optim.lr, cfg.optim.warmup_steps, cfg.training.max_steps) == (3, 2e-3, 3, 4)
    assert cfg.preset.config == [base, mine, other]  # every preset read, in the order applied, each once


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "config: b.yaml\n", "b.yaml": "config: a.yaml\n"},
     "{a}: its `config:` includes close a circle ({a} -> {b} -> {a}); remove one of these includes"),
    ({"a.yaml": "config: a.yaml\n"}, "{a}: its `config:` includes close a circle ({a} -> {a})"),
    ({"a.yaml": "config: missing.yaml\nlr: 1e-3\n"},
     "{a}: config: missing.yaml: no such file (an include is read relative to the preset's folder, {dir}); fix the "
     "path or remove the key"),
    ({"a.yaml": "config: 3\n"}, "{a}: config: 3 is not a preset's path nor a list of them"),
    ({"a.yaml": "lr: 1e-3\nmax_steps: 5\nlr: 2e-3\n"},
     "--config {a}: lr is given twice (lines 1 and 3); keep one"),
    ({"a.yaml": "config: b.yaml\n", "b.yaml": "n_layer: 2\nn_layer: 3\n"},
     "{b} (included by {a}): n_layer is given twice (lines 1 and 2); keep one"),
])
def test_preset_faults_are_one_line(tmp_path: Path, files, message):
    """Seen to catch: an include circle, a missing include and a mistyped `config:` accepted and ignored; a key given
    twice silently taking its last value."""
    for name, text in files.items():
        _write(tmp_path / name, text)
    names = {"a": str(tmp_path / "a.yaml"), "b": str(tmp_path / "b.yaml"), "dir": str(tmp_path)}
    with pytest.raises(UserError) as err:
        parse_config(["--config", names["a"], "--out_dir", str(tmp_path / "run")])
    assert message.format(**names) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_the_help_says_how_presets_compose():
    from configs import _config_parser

    text = " ".join(_config_parser().format_help().split())
    assert "repeat --config to apply several in order, each over the ones before" in text
    assert "a `config:` key in a preset includes other presets, read relative to it, before its own values" in text


def test_trackers_get_the_presets_as_one_string():
    """config.yaml records the presets as a list; TensorBoard's hparams take only scalars and strings, so the trackers
    get them joined. Seen to catch: the list passed to the trackers as it is (add_hparams: ValueError)."""
    from training.recipe import Recipe

    recipe = Recipe({"config": ["configs/a.yaml", "configs/b.yaml"], "lr": 1e-3})
    assert recipe.config_yaml()["config"] == ["configs/a.yaml", "configs/b.yaml"]
    assert recipe.tracker_values() == {"config": "configs/a.yaml, configs/b.yaml", "lr": 1e-3}
