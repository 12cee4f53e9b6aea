"""How a launch's processes share the model: the layout (`layout.Layout`, the one face the rest of the run asks),
the engines (DDP, FSDP2, DeepSpeed ZeRO-n) and what runs under each (`support`), the machine and the process group,
elastic restarts, tensor parallelism, the pipeline's stages, and what goes through `accelerator.prepare`."""
