"""The machinery of a training run, behind the calls `train.py` makes.

At the root: the loop's parts (the network, the step and its schedule, drawing batches, metrics, timing, MFU,
preemption) and the run's record (`run_folder`, `recipe`). Four sub-packages hold the rest: `distributed`,
`checkpoints`, `optimizers` and `evaluations`. It imports `model`, `data` and `eval`; only entry points and
`publish` import it.
"""
