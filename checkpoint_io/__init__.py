"""A checkpoint on disk, whichever engine wrote it: which weights a spec means, whether its files are intact, and what
it holds, read whole. Every reader takes this one road: a resume, a move to another engine, `GPT.from_pretrained`
(and so sample, eval, export) and the Hub push.

    weights.py      which weights a `--model`, `--init_from` or `from_pretrained` spec means (`resolve_weights`)
    manifest.py     a checkpoint's manifest and its check; the files a resume reads, as each engine lays them out
    reader.py       any engine's checkpoint read whole (`read_state`): the files tell which engine's reader
    ddp_files.py    a DDP run's files, which a pipeline writes too: model.safetensors, torch's optimizer state
    fsdp_files.py   FSDP2's shards: torch's distributed checkpoint
    zero_files.py   DeepSpeed ZeRO's partitions, and the universal layout a move writes for a ZeRO launch
    whole_state.py  what a checkpoint holds (`WholeState`), by the model's names without the wrappers' prefixes

It reads tensors by the names they are saved under. The model's own facts stay the model's: which two names are one
tied tensor (`model.config.TIED`), and the order tensor parallelism keeps c_attn's rows in
(`model.tensor_parallel`). It sits below `model/` and `training/` and imports only `common/` of the project.
"""
