"""Test-only: a core install (`pip install -e .`, no DeepSpeed) in this virtual environment, which has DeepSpeed.

A process whose PYTHONPATH starts with this folder imports this module at startup (Python's `site`), and from then on
`import deepspeed` raises ImportError and `importlib.util.find_spec("deepspeed")` answers None (a module named None in
`sys.modules`), so accelerate's `is_deepspeed_available()`, which asks `find_spec` first, answers no. Processes the
launcher starts inherit PYTHONPATH, so they are core installs too.
"""
import sys

sys.modules["deepspeed"] = None
