"""Pre-tokenize a corpus into uint16 token shards: `python -m data.prepare --dataset ... --out ...`.

The source (a Hub dataset streamed with `datasets`, or local .txt/.jsonl/.parquet files) is read
in batches of documents, tokenized by parallel threads (tiktoken releases the GIL), and written as
`val_000000.bin` (the first `--val_tokens` tokens, or the dataset's own `--val_split`) and `train_NNNNNN.bin`
shards of `--shard_tokens` tokens; a document may continue into the next shard, no token is lost. Without
`--val_tokens`, validation is a tenth of the data, at most 10M tokens (the first 100M tokens are read before
the size is decided, so a small file gets a split that fits it).

Crash safety: shards are written to a temporary name, fsynced and renamed; the manifest is replaced
atomically after each shard and records where the next shard starts (document index, token
offset). Re-running the same command continues from there; the loader refuses an unfinished folder.
A full disk is one line: the finished shards stay, no partial one is left, and the re-run continues.

A re-run first reads every listed shard against the manifest (size and sha256). A damaged shard is
written again from the source, from where its entry says it starts, and kept only if it matches;
otherwise the line names what to delete.
"""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from common.atomic import check_folder_writable, write_json_atomic
from common.cli import CliParser
from common.errors import UserError, run_cli
from data.local import DOCS_PER_BATCH
from data.settings import DataConfig
from data.shards import FORMAT, FORMAT_VERSION, MANIFEST, ShardWriter, WriteFailed, read_manifest, shard_damage
from data.source import HubStream, PromptCompletion, TextFiles, TokenShards, open_source
from data.tokenizer import EOT_ID, TOKENIZER_NAME
from data.tokens import default_threads, encode_documents


def text_source(dataset: str, dataset_config: str | None, text_column: str) -> TextFiles | HubStream:
    """The source to pack, parsed as training parses `--dataset`; UserError for those that are not text."""
    source = open_source(DataConfig(dataset=dataset, dataset_config=dataset_config, text_column=text_column))
    if isinstance(source, TokenShards):
        raise UserError(f"{dataset} already holds token shards; train on it directly with --dataset {dataset}")
    if isinstance(source, PromptCompletion):
        raise UserError(f"{dataset} holds prompt/completion records ({source.prompt_field!r} and "
                        f"{source.completion_field!r}), which train from the .jsonl itself with a masked loss; "
                        "data.prepare packs text only: train on it directly with --dataset")
    return source


def encoded_batches(batches: Iterator[list[str]], threads: int,
                    start_doc: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index of the first document, packed tokens, cumulative document ends), from `start_doc` on."""
    first = 0
    for batch in batches:
        if first + len(batch) <= start_doc:  # already written by an earlier run
            first += len(batch)
            continue
        if first < start_doc:
            batch, first = batch[start_doc - first :], start_doc
        packed = encode_documents(batch, threads)
        ends = np.flatnonzero(packed == EOT_ID) + 1  # ordinary encoding never emits EOT inside a document
        yield first, packed, ends
        first += len(batch)


def _position(first: int, ends: np.ndarray, pos: int) -> dict[str, int]:
    """The (document index, token offset) of token `pos` of a batch: where writing resumes."""
    doc = int(np.searchsorted(ends, pos, side="right"))
    return {"doc": first + doc, "offset": pos - (int(ends[doc - 1]) if doc else 0)}


# Without --val_tokens: validation is VAL_FRACTION of the data, at most MAX_VAL_TOKENS tokens.
MAX_VAL_TOKENS, VAL_FRACTION = 10_000_000, 0.1


def _adaptive_val_tokens(stream: Iterator[tuple[int, np.ndarray, np.ndarray]]) -> tuple[int, Iterator]:
    """The validation size for a stream whose length is unknown: VAL_FRACTION of it, at most MAX_VAL_TOKENS. Reads
    (and keeps) batches until that is decided (MAX_VAL_TOKENS / VAL_FRACTION tokens, or the end); returns the size
    and the stream again, from its start."""
    head, total = [], 0
    for batch in stream:
        head.append(batch)
        total += len(batch[1])
        if total >= MAX_VAL_TOKENS / VAL_FRACTION:
            break
    return min(MAX_VAL_TOKENS, max(1, int(total * VAL_FRACTION))), itertools.chain(head, stream)


def _write_val(batches: Iterator[tuple[int, np.ndarray, np.ndarray]], out: Path,
               val_tokens: int) -> tuple[dict[str, Any], tuple | None]:
    """Write the first `val_tokens` tokens; return the manifest entry and the unwritten rest of the batch."""
    writer = ShardWriter(out, "val_000000.bin")
    rest = None
    for first, packed, ends in batches:
        take = min(len(packed), val_tokens - writer.tokens)
        writer.write(packed[:take])
        if writer.tokens >= val_tokens:
            rest = (first, packed, ends, take)
            break
    return writer.finish(), rest


# The manifest's names of prepare's settings that its command line spells otherwise.
_FLAG_OF = {"config": "dataset_config"}


def settings_changed(recorded: dict[str, Any], asked: dict[str, Any]) -> str:
    """`--shard_tokens: 1000 there, 500 now; ...`: each setting of a shard folder's prepare that this one asks
    otherwise."""
    keys = [k for k in asked if recorded.get(k) != asked[k]] + [k for k in recorded if k not in asked]

    def shown(value: Any) -> str:
        return "not given" if value is None else str(value)

    return "; ".join(f"--{_FLAG_OF.get(k, k)}: {shown(recorded.get(k))} there, {shown(asked.get(k))} now"
                     for k in keys)


def prepare(
    dataset: str,
    out: str | Path,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    val_split: str | None = None,
    text_column: str = DataConfig.text_column,
    shard_tokens: int = 100_000_000,
    val_tokens: int | None = None,
    max_tokens: int | None = None,
    num_threads: int | None = None,
    batch_docs: int = DOCS_PER_BATCH,
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or finish) the shards of `dataset` in `out`; return the final manifest. `val_tokens` None: a tenth of
    the data, at most MAX_VAL_TOKENS (of `val_split` when given: its first MAX_VAL_TOKENS). A prepare refused before
    it completes removes the folder it created, so that the advised rerun (other settings) is not blocked; one
    stopped by a full disk keeps it, to be continued. A re-run repairs damaged shards first (module docstring)."""
    source = text_source(dataset, dataset_config, text_column)  # refused before anything is written
    if val_split and not isinstance(source, HubStream):
        raise UserError("--val_split applies to Hub datasets only; local files get the first --val_tokens tokens as "
                        "validation")
    if isinstance(source, HubStream) and (note := source.location().note()):
        print(note, flush=True)  # a script-only repo: its parquet conversion is what gets prepared
    out = Path(out).expanduser()
    threads = num_threads or default_threads()
    settings = dict(dataset=dataset, config=dataset_config, split=split, val_split=val_split, text_column=text_column,
                    shard_tokens=shard_tokens, val_tokens=val_tokens, max_tokens=max_tokens)
    manifest, fresh = None, False
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest["source"] != settings:
            changed = settings_changed(manifest["source"], settings)
            raise UserError(f"{out} holds a prepare with other settings ({changed}); pass another --out, or its "
                            f"settings to finish or keep it, or delete {out}")
        damaged = damaged_shards(out, manifest)  # every listed shard, read whole: a same-size change too
        if manifest["complete"] and not damaged:
            return manifest
        check_folder_writable(out, "--out", "shard folder")
    elif out.is_dir() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not a shard folder; pass an empty or new --out")
    else:  # a file, a path under a file, a folder that cannot be written: one line, nothing made
        check_folder_writable(out, "--out", "shard folder")
        damaged, fresh = [], not out.exists()
        out.mkdir(parents=True, exist_ok=True)
    try:
        for entry, why in damaged:
            _rebuild(source, out, entry, why, split=split, val_split=val_split, threads=threads, batch_docs=batch_docs)
        if manifest is not None and manifest["complete"]:
            return manifest
        return _write_shards(source, out, settings, manifest, split=split, val_split=val_split,
                             shard_tokens=shard_tokens, val_tokens=val_tokens, max_tokens=max_tokens, threads=threads,
                             batch_docs=batch_docs, progress=progress)
    except UserError:
        if manifest is None:  # begun by this call: a refusal leaves nothing that blocks the rerun it advises
            for entry in out.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            if fresh:
                out.rmdir()
        raise
    except WriteFailed as err:  # a full disk: what is written stays, and the same command goes on from there
        raise UserError(f"could not write {err.path} ({err.reason}); the shards written are kept and no partial one "
                        f"is left: free disk space and re-run the same command to continue from {_next_shard(out)}"
                        ) from None


def _save(out: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest (atomically: a failed write leaves the one before)."""
    try:
        write_json_atomic(out / MANIFEST, manifest)
    except OSError as err:
        raise WriteFailed(out / MANIFEST, err) from err


def damaged_shards(out: Path, manifest: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Each shard the manifest lists whose file is not the one written (missing, another size, another sha256),
    with what is wrong with it."""
    entries = ([manifest["val"]] if manifest["val"] else []) + manifest["train"]
    return [(entry, why) for entry in entries if (why := shard_damage(out, entry)) is not None]


def _rebuild(source: TextFiles | HubStream, out: Path, entry: dict[str, Any], why: str, *, split: str,
             val_split: str | None, threads: int, batch_docs: int) -> None:
    """Write a damaged shard again from the source, from where its entry says it starts, and keep it only if it is
    the shard the manifest lists (the same sha256); otherwise refuse, naming what to delete."""
    redo = f"delete {out} and run the same command again"
    if entry["file"].startswith("val_"):
        name, start = val_split or split, {"doc": 0, "offset": 0}  # validation is the first tokens of its split
    elif "start" in entry:
        name, start = split, entry["start"]
    else:
        raise UserError(f"{why}; its manifest is older than rebuilding a shard alone, so {redo}")
    writer = ShardWriter(out, entry["file"])
    skip = start["offset"]  # the first batch begins with the shard's first document
    for _, packed, _ in encoded_batches(source.document_batches(name, batch_docs), threads, start["doc"]):
        piece = packed[skip:][: entry["tokens"] - writer.tokens]
        skip = 0
        writer.write(piece)
        if writer.tokens == entry["tokens"]:
            break
    if writer.tokens != entry["tokens"] or writer.sha.hexdigest() != entry["sha256"]:
        writer.abandon()
        raise UserError(f"{why}, and the source now gives other tokens there, so it cannot be rebuilt: {redo}")
    writer.finish()
    print(f"{why}: rebuilt it from the source, as the manifest lists it", flush=True)


def _next_shard(out: Path) -> str:
    """Where a re-run of an unfinished prepare in `out` goes on, as its manifest on disk says."""
    try:
        manifest = read_manifest(out)
    except UserError:
        return "the start"
    if manifest["val"] is None:
        return "the validation shard"
    return f"shard train_{len(manifest['train']):06d}.bin"


def _write_shards(source: TextFiles | HubStream, out: Path, settings: dict[str, Any], manifest: dict[str, Any] | None,
                  *, split: str, val_split: str | None, shard_tokens: int, val_tokens: int | None,
                  max_tokens: int | None, threads: int, batch_docs: int, progress: bool) -> dict[str, Any]:
    """Write the validation shard (unless `manifest`, of an unfinished prepare, has it) and the training shards from
    `manifest["resume"]` on."""
    from tqdm import tqdm

    dataset = settings["dataset"]
    if manifest is None:
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "complete": False, "source": settings,
                    "tokenizer": TOKENIZER_NAME, "eot_id": EOT_ID, "dtype": "uint16",
                    "val": None, "train": [], "resume": {"doc": 0, "offset": 0}}
        _save(out, manifest)

    def batches(name: str, start_doc: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        return encoded_batches(source.document_batches(name, batch_docs), threads, start_doc)

    start = manifest["resume"]
    train = ((f, p, e, start["offset"] if f == start["doc"] else 0) for f, p, e in batches(split, start["doc"]))
    if manifest["val"] is None:
        if val_split:
            manifest["val"], _ = _write_val(batches(val_split), out, val_tokens or MAX_VAL_TOKENS)
        else:  # the first val_tokens tokens; training continues from the same pass
            stream = batches(split)
            if val_tokens is None:
                val_tokens, stream = _adaptive_val_tokens(stream)
            manifest["val"], rest = _write_val(stream, out, val_tokens)
            train = itertools.chain([rest] if rest else [], ((f, p, e, 0) for f, p, e in stream))
            manifest["resume"] = _position(rest[0], rest[2], rest[3]) if rest else {"doc": 0, "offset": 0}
        _save(out, manifest)

    done = sum(entry["tokens"] for entry in manifest["train"])
    limit = max_tokens if max_tokens is not None else float("inf")
    bar = tqdm(total=max_tokens, initial=done, unit="tok", unit_scale=True, desc=f"prepare {dataset}",
               disable=None if progress else True)  # None: drawn on a terminal only, no \r in a log
    writer = ShardWriter(out, f"train_{len(manifest['train']):06d}.bin", start=dict(manifest["resume"]))
    for first, packed, ends, pos in train:  # pos > 0: the batch's start is already written
        while pos < len(packed) and done < limit:
            take = int(min(len(packed) - pos, shard_tokens - writer.tokens, limit - done))
            writer.write(packed[pos : pos + take])
            pos, done = pos + take, done + take
            bar.update(take)
            if writer.tokens == shard_tokens:
                manifest["train"].append(writer.finish())
                manifest["resume"] = _position(first, ends, pos)  # where the next shard begins
                _save(out, manifest)
                writer = ShardWriter(out, f"train_{len(manifest['train']):06d}.bin", start=dict(manifest["resume"]))
        if done >= limit:
            break
    bar.close()
    if writer.tokens:
        manifest["train"].append(writer.finish())
    else:
        writer.abandon()
    if not manifest["train"] and not manifest["val"]["tokens"]:  # as a run says of it (data.local)
        raise UserError(f"{dataset!r} contains no text; check the files (or --text_column)")
    if not manifest["train"]:
        raise UserError(f"{dataset} has no documents left after the validation split; use a larger dataset or a "
                        "smaller --val_tokens")
    manifest.update(complete=True, total_train_tokens=done, total_val_tokens=manifest["val"]["tokens"])
    _save(out, manifest)
    return manifest


def main() -> None:
    parser = CliParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True,
                        help="Hub id (id or id:config), local file/glob/folder, or shakespeare")
    parser.add_argument("--out", required=True, help="folder for the shards and manifest.json")
    parser.add_argument("--dataset_config", default=None,
                        help="Hub config name, e.g. sample-10BT; default: the one after ':' in --dataset, or none")
    parser.add_argument("--split", default="train", help="the Hub dataset's split to read")
    parser.add_argument("--val_split", default=None,
                        help="the dataset's own validation split (default: the first --val_tokens tokens)")
    parser.add_argument("--text_column", default=DataConfig.text_column, help="the column holding the text")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard file")
    parser.add_argument("--val_tokens", type=int, default=None,
                        help=f"validation shard tokens (default: a tenth of the data, at most {MAX_VAL_TOKENS:,})")
    parser.add_argument("--max_tokens", type=int, default=None,
                        help="stop after this many training tokens; default: the whole dataset")
    parser.add_argument("--num_proc", type=int, default=None, help="tokenizer threads (default: all cores)")
    args = parser.parse_args()
    if args.shard_tokens < 1 or (args.val_tokens is not None and args.val_tokens < 1):
        raise UserError("--shard_tokens and --val_tokens must be positive")
    m = prepare(args.dataset, args.out, dataset_config=args.dataset_config, split=args.split, val_split=args.val_split,
                text_column=args.text_column, shard_tokens=args.shard_tokens, val_tokens=args.val_tokens,
                max_tokens=args.max_tokens, num_threads=args.num_proc)
    print(f"{args.out}: {len(m['train'])} train shards, {m['total_train_tokens']:,} train tokens, "
          f"{m['total_val_tokens']:,} val tokens")


if __name__ == "__main__":
    run_cli(main)
