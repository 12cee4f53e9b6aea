"""Publishing a run: the Hugging Face Hub push (`python -m publish.hub`), its model card and loss
curve, and the background uploads that `train.py --hub_push_every` starts.
"""
