"""Checkpoints under every engine: saving and loading them, their manifest, which one to resume, moving one between
engines, the disk checks before a run, and the export of `final/`."""
