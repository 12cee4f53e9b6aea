"""Checkpoints: which one a run resumes from, saving and loading them under every engine, their manifest, a
checkpoint moved between engines, the disk checks before a run, and the export of `final/`."""
