"""Turn a checkpoint of any run into a Hugging Face GPT-2 folder, on one process, without the engine's launcher.

Usage: python -m model.export --checkpoint out/run/checkpoints/step_000400 --out_dir export/
       python -m model.export --checkpoint out/run --out_dir export/   # final/, else the newest checkpoint

Any checkpoint: DDP's, one process's or a pipeline's files; FSDP2's shards (tensor parallelism's too); DeepSpeed
ZeRO-1/2/3's partitions (merged by DeepSpeed's own zero_to_fp32, which needs the `deepspeed` extra); a LoRA run's
adapter, merged into its base. What it writes: `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
`pipeline("text-generation", model=out_dir)` load it offline (config, weights, tokenizer, generation config). The
analogue of DeepSpeed's `zero_to_fp32.py`, for every engine; `publish.hub --run_dir` exports an unfinished run the
same way.

Invariants: an existing non-empty `--out_dir` is never written over; the folder appears whole or not at all (built
under a temporary name, renamed into place); a checkpoint whose weights' files differ from its manifest is one line
naming the newest intact one (`checkpoint_io.weights`), never exported; the command says which weights it read (a run
folder: its final/, else its newest checkpoint).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from checkpoint_io.weights import Weights, resolve_weights
from common.atomic import fresh_temp_dir, rename_into_place
from common.cli import CliParser
from common.errors import UserError, run_cli
from model.gpt import GPT


def export(checkpoint: str | Path, out_dir: str | Path) -> tuple[Path, Weights]:
    """Write the weights `checkpoint` names (see the module docstring) to the new folder `out_dir`; returns it and
    the weights it read."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out_dir {out} already exists and is not an empty folder; an export never writes over "
                        "files: choose a new folder")
    weights = resolve_weights(checkpoint)
    model = GPT.from_pretrained(weights)
    tmp = fresh_temp_dir(out)
    model.save_pretrained(tmp, overwrite=True)
    rename_into_place(tmp, out)
    return out, weights


def main(argv: Sequence[str] | None = None) -> None:
    parser = CliParser(prog="python -m model.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoints/step_* folder of any engine, a run folder (--out_dir of train.py), or "
                             "its final/")
    parser.add_argument("--out_dir", required=True, help="the new Hugging Face folder to write (absent or empty)")
    args = parser.parse_args(argv)
    out, weights = export(args.checkpoint, args.out_dir)
    print(f"read {weights.described}")
    print(f"wrote {out}: transformers' AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it")


if __name__ == "__main__":
    run_cli(main)
