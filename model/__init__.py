"""The GPT-2 model: `GPT` (the network, `model/gpt.py`) and `GPTConfig` (its architecture, `model/config.py`).

Loading and exporting weights: `model/pretrained.py`, with the Hugging Face conversion in
`model/state_dict_adapter.py`; LoRA adapters: `model/lora.py`.
"""
from model.config import GPTConfig
from model.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
