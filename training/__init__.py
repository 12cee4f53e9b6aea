"""The machinery of a training run, behind the calls `train.py` makes: the optimizer step and its
schedule, checkpoints and resumption, metrics and trackers, MFU, preemption signals, in-training
evaluation and the final export. Imports `model`, `data` and `eval`; nothing imports it but entry
points and `publish`.
"""
