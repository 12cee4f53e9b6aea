"""Hub repo ids and revisions as users write them, parsed here and nowhere else.

`--dataset id[:config][@revision]`, `--init_from id[@revision]` and `--model id[@revision]`: a revision is a
branch, a tag, a commit sha or a special ref (`refs/convert/parquet`). Neither a repo id nor a git ref name
can hold `@` followed by anything a ref may start with, so the first `@` separates them. A local path that
exists is never split: its callers try the path first.
"""
from __future__ import annotations

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from common.errors import UserError


def is_repo_id(name: str) -> bool:
    """True for a syntactically valid Hub repo id (`name` or `namespace/name`), by huggingface_hub's rules."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def split_revision(spec: str, flag: str) -> tuple[str, str | None]:
    """`id@revision` as (id, revision); (spec, None) without an `@`. UserError (naming `flag`) when either side
    is empty."""
    name, at, revision = spec.partition("@")
    if at and (not name or not revision):
        raise UserError(f"{flag} {spec!r}: write a Hub revision as id@revision (a branch, tag or commit), e.g. "
                        "gpt2@main, or leave out the @")
    return name, revision or None
