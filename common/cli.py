"""The one command-line style of every entry point (train.py, eval.*, data.prepare, publish.hub).

- Options are spelled with underscores (`--batch_size`), like train.py's config fields; the dashed
  spelling (`--batch-size`) is accepted too, as an alias of the same option.
- No prefix matching: `--max_step 2` is an unknown argument, never silently `--max_steps 2`.
- An unknown option gets "did you mean": a close option name, or the name this project uses for what
  other trainers call it (`--learning_rate` -> `--lr`).
- Errors are one `UserError` line (exit 2 under `run_cli`), not a usage dump.
- `--help` shows every option's default, once.
"""
from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn, Sequence

from common.errors import UserError


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to every option's help, unless the help already says what the default is
    (argparse's ArgumentDefaultsHelpFormatter would print "(default: all cores) (default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        # Switches (nargs 0: --private, --no_bias) say what they do, and a required option has no default:
        # a "default" beside them only misleads.
        if ("default" in help_text or action.default is argparse.SUPPRESS or not action.option_strings
                or action.nargs == 0 or action.required):
            return help_text
        default = action.default
        # A whitespace value (train.py's sample_prompt "\n") would be invisible or break the line.
        quoted = isinstance(default, str) and (not default or any(c.isspace() for c in default))
        shown = repr(default) if quoted else str(default)
        return f"{help_text} (default: {shown.replace('%', '%%')})".lstrip()


def suggest(name: str, known: Sequence[str], aliases: dict[str, str] | None = None) -> str | None:
    """The known name a mistyped `name` most likely meant: an alias from another tool's vocabulary first
    (`learning_rate` -> `lr`), else the closest spelling; None when nothing is close. Dashes count as
    underscores."""
    name = name.replace("-", "_")
    if aliases and name in aliases:
        return aliases[name]
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_arguments_message(extras: Sequence[str], known: Sequence[str],
                              aliases: dict[str, str] | None = None) -> str:
    """`unknown argument(s) --max_step 2 (did you mean --max_steps?)` for the arguments argparse left over."""
    hints = []
    for extra in extras:
        if extra.startswith("--"):
            flag = extra.split("=", 1)[0]
            guess = suggest(flag[2:], known, aliases)
            if guess is not None:
                hints.append((flag, f"--{guess}"))
    message = f"unknown argument(s) {' '.join(extras)}"
    if len(hints) == 1:
        message += f" (did you mean {hints[0][1]}?)"
    elif hints:
        message += " (did you mean " + ", ".join(f"{guess} for {flag}" for flag, guess in hints) + "?)"
    return message


class CliParser(argparse.ArgumentParser):
    """argparse in the project's style (see the module docstring).

    `aliases` maps names other tools use to this parser's option names (without dashes), for the
    "did you mean" of an unknown option."""

    def __init__(self, *args: Any, aliases: dict[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        # Set before argparse's __init__: subclasses such as HfArgumentParser add their options inside it.
        self.aliases = aliases or {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        """Add an option under its underscore name and, as an alias, its dashed spelling."""
        dashed = [n.replace("_", "-") for n in names if n.startswith("--") and "_" in n]
        return super().add_argument(*names, *(d for d in dashed if d not in names), **kwargs)

    def option_names(self) -> list[str]:
        """Every long option's name in underscore spelling, without the dashes."""
        names = {o[2:].replace("-", "_") for a in self._actions for o in a.option_strings if o.startswith("--")}
        return sorted(names)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments_message(extras, self.option_names(), self.aliases))
        return parsed

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see `{self.prog} --help`")
