"""What a resume may change of the run it continues, and how `config.yaml` keeps the record of every change.

Before anything is written, a resume compares the run's resolved settings (`training.run_folder.recorded_config`)
with the `config.yaml` of the checkpoint's run folder, field by field:

- REFUSED fields: one line naming the field, both values and the fix. The run folder is left byte for byte as it
  was.
- Every other compared field may change. Each change is announced in one line and recorded. A change of the LR
  schedule (`--max_steps`, `--lr`, `--muon_lr`, `--warmup_steps`, `--min_lr_ratio`) changes the LR from the resumed
  step on: the LR is a function of the step, so a longer `--max_steps` stretches the cosine and the LR jumps up.
  That jump is announced too, old -> new.
- NOT_COMPARED fields say how this command was given (`--config`, `--out_dir`, `--resume`, `--plan`) or how long
  its processes wait (`--collective_timeout`), not what the run does.

`config.yaml` keeps one key per flag, holding the settings of the run's latest stretch; its readers
(`eval.val_loss`, the model card) rely on that. Its `resumes:` list has one entry per resume that changed something:
the step, the checkpoint, each changed field `{old, new}` and the LR jump. Undoing the later entries' changes gives
the settings of any earlier step, so nothing is overwritten without a trace.

Some fields are checked by the checkpoint's own files instead, and pass here when they pass there: the architecture
and optimizers (`training.checkpoints.checkpoint.load_checkpoint`), the LoRA settings (`model.lora.check_resume`)
and the data. The loaders' `load_state_dict` checks the data's kind, shard hash, sequence count, block size, seed
and Hub commit; a local path spelled another way passes, and is recorded as a change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common import resume_rules as rules
from common.errors import UserError
from configs import read_run_config
from configs.schema import resume_rules
from training.checkpoints.moving import Move
from training.checkpoints.resume import ResumePoint
from training.optimizers.plan import OptimizerPlan
from training.step import LRSchedule


@dataclass(frozen=True)
class FlagRules:
    """Every flag, the optimizers' own included, by what a resume may do with it, as each declares
    (`common.resume_rules`)."""

    refused: dict[str, str]  # flag -> what its value decides, for the refusal's line
    not_compared: frozenset[str]
    schedule: tuple[str, ...]  # the learning-rate schedule: a change moves the LR from the resumed step on
    accepted: frozenset[str]
    checked_by_the_checkpoint: frozenset[str]

    @classmethod
    def now(cls) -> FlagRules:
        declared = resume_rules()
        return cls(refused={n: r.why for n, r in declared.items() if isinstance(r, rules.Refused)},
                   not_compared=frozenset(n for n, r in declared.items() if r == rules.NOT_COMPARED),
                   schedule=tuple(n for n, r in declared.items() if r == rules.SCHEDULE),
                   accepted=frozenset(n for n, r in declared.items()
                                      if r in (rules.ACCEPTED, rules.CHECKED, rules.SCHEDULE)),
                   checked_by_the_checkpoint=frozenset(n for n, r in declared.items() if r == rules.CHECKED))


RESUMES = "resumes"  # config.yaml's list of what each resume changed
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a Hub revision that is a commit


@dataclass(frozen=True)
class Change:
    """One field whose value differs from the recorded one."""

    name: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.name} {self.old!r} -> {self.new!r}"


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The fields of `new` whose value `old` records otherwise. Fields an older `old` lacks are not compared."""
    return [Change(name, old[name], value) for name, value in new.items() if name in old and old[name] != value]


@dataclass(frozen=True)
class Recipe:
    """What the run records: `values`, one key per flag (the trackers' config too), and `resumes`, what each resume
    changed, this one's last. `announcements` are the lines that say this resume's changes."""

    values: dict[str, Any]
    resumes: tuple[dict[str, Any], ...] = ()
    announcements: tuple[str, ...] = ()

    def config_yaml(self) -> dict[str, Any]:
        """config.yaml's content: the flags' keys, then `resumes` when a resume changed something."""
        return {**self.values, RESUMES: list(self.resumes)} if self.resumes else dict(self.values)

    def tracker_values(self) -> dict[str, Any]:
        """`values` as the trackers take them: a list (the presets read) as one string, since TensorBoard's hparams
        hold only numbers, strings and booleans."""
        return {name: ", ".join(map(str, value)) if isinstance(value, list) else value
                for name, value in self.values.items()}


def _same_hub_weights(old: Any, new: str) -> bool:
    """Whether `--init_from new` may name the weights config.yaml records as `old` (`id@commit`). A resumed full
    fine-tune downloads no weights, so it cannot resolve a branch to a commit. Then only the repo ids are compared,
    so that the same command, requeued, resumes."""
    new_id, _, revision = new.partition("@")
    return isinstance(old, str) and not _COMMIT.fullmatch(revision) and old.partition("@")[0] == new_id


def _lrs(values: dict[str, Any], plan: OptimizerPlan, step: int, schedule: tuple[str, ...]) -> list[float] | None:
    """Each optimizer's LR at the 0-based `step` under the schedule `values` record; None where an older config lacks
    a part of it."""
    if not all(isinstance(values.get(name), (int, float)) for name in schedule):
        return None
    factor = LRSchedule(values["warmup_steps"], values["max_steps"], values["min_lr_ratio"]).factor(step)
    return plan.with_recorded(values).lrs_at(factor)


def resume_recipe(record: dict[str, Any], resume: ResumePoint | None, plan: OptimizerPlan,
                  move: Move | None = None) -> Recipe:
    """The run's `Recipe`: `record` for a new run. A resume compares `record` with the checkpoint folder's config.yaml:
    a refused change is a UserError, the others are announced and appended to `resumes`. `plan` gives the LRs the
    announcement names. A `move` to another engine is recorded in `resumes` too; the checkpoint loader announces
    it."""
    if resume is None:
        return Recipe(record)
    step, run = resume.progress.step, resume.run
    entry: dict[str, Any] = {"step": step, "checkpoint": str(resume.path)}
    if move is not None:
        entry["moved"] = {"from": move.before, "to": move.after,
                          **({"not_carried": move.not_carried} if move.not_carried else {})}
    if run is None or not run.config_file.is_file():
        missing = f"no {run.config_file}" if run is not None else f"no run folder of {resume.path}"
        return Recipe(record, ({**entry, "earlier_settings": f"not recorded ({missing})"},),
                      (f"note: {missing} records the settings of the steps before {step}; config.yaml "
                       f"records this run's from step {step} on",))
    config_file = run.config_file
    recorded = read_run_config(config_file)
    earlier = recorded.get(RESUMES, [])
    if not isinstance(earlier, list):
        raise UserError(f"{config_file}: '{RESUMES}' is not a list; fix it or remove the key")
    values = dict(record)
    changes, refused = [], []
    flags = FlagRules.now()
    for change in changed_fields(recorded, {k: v for k, v in record.items() if k not in flags.not_compared}):
        if change.name == "init_from" and _same_hub_weights(change.old, change.new):
            values["init_from"] = change.old  # the pin stays: the same weights, at the commit the run read
        elif change.name in flags.refused:
            refused.append(change)
        else:
            changes.append(change)
    if refused:  # every refused change in the one line, so one corrected command resumes
        raise UserError(
            f"{config_file} records {', '.join(f'{c.name} {c.old!r}' for c in refused)} and this resume passes "
            f"{', '.join(repr(c.new) for c in refused)}: a resume continues the run's recipe "
            f"({'; '.join(f'{c.name}: {flags.refused[c.name]}' for c in refused)}); resume with "
            f"{' '.join(f'--{c.name} {c.old}' for c in refused)} as recorded, or start a new run in another "
            f"--out_dir (with --init_from {resume.path} to start from these weights)")
    if not changes:
        return Recipe(values, (*earlier, entry) if move is not None else tuple(earlier))
    # A finished run: no step would use the change, yet config.yaml would record it. A step past --max_steps, and a
    # change the checkpoint's own files refuse, each get their own line later.
    if step == values["max_steps"] and not any(c.name in flags.checked_by_the_checkpoint for c in changes):
        names = ", ".join(f"--{c.name}" for c in changes)
        raise UserError(f"{resume.path} is where this run finished (step {step} of --max_steps {values['max_steps']}): "
                        f"a resume trains no step, so nothing would use {names}; pass a --max_steps above {step} to "
                        f"train on, or start a new run in another --out_dir (with --init_from {resume.path})")
    entry["changed"] = {c.name: {"old": c.old, "new": c.new} for c in changes}
    lines = [f"resuming at step {step} with {c} (config.yaml records it under '{RESUMES}')" for c in changes]
    old_lrs, new_lrs = _lrs(recorded, plan, step, flags.schedule), _lrs(values, plan, step, flags.schedule)
    if old_lrs is not None and new_lrs is not None and old_lrs != new_lrs:
        entry["lr_jump"] = {"step": step + 1, **{name: {"old": o, "new": n}
                                                 for name, o, n in zip(plan.names, old_lrs, new_lrs)}}
        jumps = ", ".join(f"{o:.4g} -> {n:.4g} ({name})" for name, o, n in zip(plan.names, old_lrs, new_lrs))
        schedule = ", ".join(c.name for c in changes if c.name in flags.schedule)
        lines.append(f"the learning rate changes at step {step + 1}: {jumps}, the LR being a function of the step "
                     f"and of {schedule} (config.yaml records it under '{RESUMES}')")
    return Recipe(values, (*earlier, entry), tuple(lines))

