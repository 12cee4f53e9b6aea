"""How a launch's processes share the model. The rest of the run asks the layout (`layout.Layout`) only.

Here too: the engines (DDP, FSDP2, DeepSpeed ZeRO-n) and what runs under each (`support`), the machine and the
process group, elastic restarts, tensor parallelism, the pipeline's stages, and `accelerator.prepare`."""
