"""The README as a newcomer meets it: its Quick start is the commands CI runs (install and tests; the first training
beside them), each with its time stated, and its Layout names only files that are there. A front page read in five
minutes (issue 55): under 2,000 words, every docs/ page linked from it, every link of it and of the docs resolving, and
every command it shows parsed as written by the program it runs."""
from __future__ import annotations

import re

import pytest
from conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
CI = REPO_ROOT / ".ci" / "run"


def code_block_after(heading: str) -> list[str]:
    """The lines of the first fenced block after `heading` in the README."""
    text = README.read_text()
    rest = text[text.index(heading):]
    start = rest.index("```")
    body = rest[rest.index("\n", start) + 1:]
    return body[:body.index("```")].splitlines()


def quick_start() -> list[tuple[str, str]]:
    """(command, comment) of each line of the Quick start."""
    return [(cmd.strip(), note.strip()) for cmd, _, note in (line.partition("  # ")
                                                              for line in code_block_after("## Quick start"))]


def test_the_quick_start_is_what_ci_runs_with_each_time_stated():
    """The Quick start gives the first training first, then the quick tier, then the rest, each with its time on 2
    cores; its install and test commands are those `.ci/run` runs, as written (issue 44).

    Seen to catch: the README's quick-tier command changed to `-n 4`: fails naming that command."""
    commands = [cmd for cmd, _ in quick_start()]
    assert commands[2] == "python train.py"  # the first training first, then the tiers
    assert commands[3].endswith('-m "not slow"') and commands[4].endswith("-m slow")
    ci = [line.strip() for line in CI.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for cmd in commands[:2] + commands[3:]:  # CI trains nothing: the install and the two tiers, as written
        assert any(line == cmd or line.startswith(cmd + " --durations") for line in ci), cmd
    for cmd, note in quick_start()[2:]:
        assert re.search(r"\bmin\b", note), (cmd, note)  # how long it takes, on which machine
        assert "2 cores" in note, (cmd, note)


def test_the_layout_names_files_that_are_there():
    """The README's Layout names only files that are there (issue 44: it said `data/` held HF tokenizer files; it holds
    `gpt2.tiktoken`, from which `data/hf_tokenizer.py` builds them for an export).

    Seen to catch: `vocab.json` named in `data/`'s line: fails naming `data/vocab.json`."""
    named = 0
    folder = None
    for line in code_block_after("## Layout"):
        head = line[:22].strip()
        if head:
            folder = REPO_ROOT / head.split(",")[0] if head.endswith("/") or "/," in head else None
        if folder is None:
            continue
        for name in re.findall(r"\b[\w]+\.(?:py|txt|tiktoken|yaml|json)\b", line[22:]):
            assert (folder / name).is_file() or (REPO_ROOT / name).is_file(), f"{folder.name}/{name}"
            named += 1
    assert named >= 10


# --- A front page read in five minutes (issue 55 item 1): its size, its links, its commands as written. ---

DOCS = REPO_ROOT / "docs"
MAX_WORDS = 2000  # about eight minutes at 250 words a minute, code and tables read faster: the bound
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Commands the README shows that another check holds: the Quick start's install and tests are what CI runs (above).
CHECKED_ELSEWHERE = ("python -m venv", "source .venv/bin/activate", "pip install", "python -m pytest")


def test_the_readme_stays_under_two_thousand_words():
    """The README stays a front page: under 2,000 words (issue 55: it had grown to 6,739, a 28-minute read).

    Seen to catch: 800 words appended to README.md: `README.md has 2002 words; move the detail to a docs/ page and link
    it`."""
    words = len(README.read_text(encoding="utf-8").split())
    assert words < MAX_WORDS, f"README.md has {words} words; move the detail to a docs/ page and link it"


MAP_MAX_WORDS = 2000  # issue 61's bound for docs/testing.md: a map read in minutes, not a ledger


def test_the_testing_page_stays_a_map_of_the_suite():
    """docs/testing.md stays the map of the suite (tiers, fixtures, conventions, where each area's tests live): at most
    2,000 words. Issue 61: it had grown to 21,889, a 95-minute ledger of every claim and its break, which now live in
    each test's docstring.

    Seen to catch: 150 words appended to the page: `docs/testing.md has 2050 words; ...`."""
    words = len((DOCS / "testing.md").read_text(encoding="utf-8").split())
    assert words <= MAP_MAX_WORDS, (f"docs/testing.md has {words} words; put a test's claim and its break in the "
                                    "test's docstring, not on the map")


DOCS_MAX_WORDS = 45_000  # issue 61's bound for docs/ as a whole (`cat docs/*.md | wc -w`): it had grown to 68,829


def test_the_docs_stay_under_their_word_budget():
    """docs/ as a whole stays at most 45,000 words (issue 61), counted as `cat docs/*.md | wc -w` counts: a new page
    or section pays for itself by moving history out (measurements superseded, a fault's old behaviour: git keeps
    them) or by saying it once.

    Seen to catch: docs/faults.md and docs/benchmarks.md as they were before their rewrite: `docs/ has 53,431 words,
    over 45,000; ...`."""
    words = sum(len(page.read_text(encoding="utf-8").split()) for page in DOCS.glob("*.md"))
    assert words <= DOCS_MAX_WORDS, (f"docs/ has {words:,} words, over {DOCS_MAX_WORDS:,}; move superseded figures "
                                     "and history to git, say each fact once")


def anchors(page) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def test_every_link_of_the_readme_and_the_docs_resolves():
    """Every relative link of README.md and docs/*.md names a file that is there, and a heading of it where the link
    names one (`docs/engines.md#what-fits-where`).

    Seen to catch: engines.md's `## What fits where` renamed `## What fits`: fails naming the three links to it."""
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    """Every docs/ page is linked from the README.

    Seen to catch: the README's link to docs/hub_reads.md removed: fails naming `hub_reads.md`."""
    linked = {(REPO_ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(README.read_text())}
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def readme_commands() -> list[str]:
    """Every command the README shows: each line of its bash blocks (a trailing `\\` joins the next, comments
    dropped) and each inline code span that starts a command (`python ...`, `accelerate launch ...`, `sbatch ...`,
    `trackio ...`)."""
    text = README.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.partition("  # ")[0].split("&&"):
                if command.strip():
                    commands.append(command.strip())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [span for span in re.findall(r"`([^`\n]+)`", prose)
                 if re.match(r"(python |accelerate launch |sbatch |trackio )", span)]
    return commands


class Parsed(Exception):
    """Raised where a command line's parser has accepted it: nothing after the parse runs."""


def parse_as_written(command: str, monkeypatch) -> None:
    """Parse `command` with the parser of the program it runs, in this process, and check the files it names; raises
    (a UserError, AssertionError) where a user running it as written would meet an unknown flag or a missing file."""
    import contextlib
    import importlib
    import io
    import shlex
    import sys

    from common.cli import CliParser
    from configs import parse_config

    words = shlex.split(command)
    if words[:2] == ["accelerate", "launch"]:
        config = words[words.index("--config_file") + 1] if "--config_file" in words else None
        assert config is None or (REPO_ROOT / config).is_file(), f"{command}: no {config}"
        script = next(i for i, w in enumerate(words) if w in ("train.py", "-m"))
        words = ["python", *words[script:]]
    if words[0] == "sbatch":  # accelerate_configs/slurm.sbatch passes its arguments to train.py
        assert (REPO_ROOT / words[1]).is_file(), f"{command}: no {words[1]}"
        words = ["python", "train.py", *words[2:]]
    if words[0] == "trackio":  # its project is train.py's default --wandb_project, which --report_to trackio uses
        assert importlib.util.find_spec("trackio") is not None
        assert words[words.index("--project") + 1] == parse_config([]).log.wandb_project, command
        return
    assert words[0] == "python", command
    if words[1] == "train.py":
        for preset in [w for w in words[2:] if w.endswith(".yaml")]:
            assert (REPO_ROOT / preset).is_file(), f"{command}: no {preset}"
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):  # --help exits 0
            parse_config(words[2:])
        return
    assert words[1] == "-m", command
    module = importlib.import_module(words[2])
    parse = CliParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(CliParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", words[2:])  # data.prepare reads sys.argv
    try:
        module.main() if words[2] == "data.prepare" else module.main(words[3:])
    except Parsed:
        return
    raise AssertionError(f"{command}: python -m {words[2]} never parsed its command line")


def test_the_readme_shows_its_commands():
    """The README's commands are found: the Quick start's training and the table of what to do next, each checked
    below (the Quick start's install and tests are checked against CI above)."""
    commands = [c for c in readme_commands() if not c.startswith(CHECKED_ELSEWHERE)]
    assert len(set(commands)) >= 12, commands


@pytest.mark.parametrize("command", sorted({c for c in readme_commands() if not c.startswith(CHECKED_ELSEWHERE)}))
def test_every_command_the_readme_shows_parses_as_written(command, monkeypatch):
    """Each command of the README, its flags read by the parser of the program it runs (train.py's own, each
    `python -m` CLI's), its presets and accelerate configs there: what a user copies runs as written, up to what it
    needs from outside (a GPU, the network, their own `my_corpus.txt`).

    Inline `python ...`, `accelerate launch ...`, `sbatch ...` and `trackio ...` commands count too
    (`test_the_readme_shows_its_commands`); trackio's `--project` is train.py's default `--wandb_project`.

    Seen to catch: each alone: `--lora_rnk 8` (unknown argument, did you mean `--lora_rank`);
    `accelerate_configs/8gpus.yaml` and `configs/gpt2_350m.yaml` (no such file); data.prepare's `--out` spelled
    `--out_dir` (a required argument missing); `trackio show --project gpt2_accelerate` (not the default project)."""
    parse_as_written(command, monkeypatch)
