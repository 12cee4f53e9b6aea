"""How a resume treats each flag, declared where the flag is defined (`flag(default, help, resume)`, in
`configs.schema`, `data.settings` and an optimizer's own flags); `training.recipe` reads the declarations.

- ACCEPTED: the value may change on a resume; the change is announced in one line and recorded in config.yaml.
- CHECKED: accepted here, and refused when it differs by the checkpoint's own files (the architecture in
  gpt_config.json, the LoRA settings in adapter_config.json, the optimizers and the engine in run_state.json, the
  data in its saved position), whose lines name it more precisely.
- SCHEDULE: accepted, and part of the learning-rate schedule: the LR jump it makes is announced too.
- NOT_COMPARED: how the command was given, not what the run does.
- Refused(why): a different value would make the steps before and after the resume two runs under one name; `why`
  is what the value decides, for the one-line refusal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACCEPTED = "accepted"
CHECKED = "checked by the checkpoint"
SCHEDULE = "schedule"
NOT_COMPARED = "not compared"


@dataclass(frozen=True)
class Refused:
    why: str


RESTORED = Refused("restored with the optimizer state")  # torch's load_state_dict puts the saved param_groups back


def flag(default: Any, help: str, resume: str | Refused) -> Any:
    """A field of a flag group: its default, its `--help` text (HfArgumentParser reads it from the metadata) and
    what a resume may do with it."""
    return field(default=default, metadata={"help": help, "resume": resume})


def resume_rule(metadata: Any) -> str | Refused:
    """A field's declared rule (its metadata's "resume")."""
    return metadata["resume"]
