"""Model FLOPs utilisation: achieved training FLOP/s over the accelerator's dense bf16 peak."""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks from the vendors' data sheets, in FLOP/s. Matched against the device name in order,
# so more specific names come first.
BF16_PEAK_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12),  # before "H200", which its name contains
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM, the common one ("NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("A6000", 155e12),
    ("V100", 125e12),  # fp16: V100 has no bf16
    ("T4", 65e12),  # fp16: T4 has no bf16
]


def peak_flops(device: torch.device | str | None = None, override: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of `device` (default: the current CUDA device); `override` (`--mfu_peak_flops`) wins.

    None when the peak is unknown (a CPU, an unlisted GPU), so no MFU is reported rather than a made-up one.
    """
    if override is not None:
        return float(override)
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops_for_name(name)


def peak_flops_for_name(name: str) -> float | None:
    """Peak bf16 FLOP/s for a GPU name such as "NVIDIA H100 80GB HBM3", or None if unlisted."""
    card = card_for_name(name)
    return None if card is None else dict(BF16_PEAK_FLOPS)[card]


def card_for_name(name: str) -> str | None:
    """The card a GPU name is in the peak table as ("H100" for "NVIDIA H100 80GB HBM3", "H100 PCIe", "H200"), or
    None if unlisted: what a figure is labelled with and a target is judged on."""
    return next((key for key, _ in BF16_PEAK_FLOPS if key.lower() in name.lower()), None)


def estimate_mfu(flops_per_token: float, tokens_per_sec: float, num_devices: int, peak: float | None) -> float | None:
    """Fraction of the combined peak that the run achieves; `tokens_per_sec` counts all devices."""
    if not peak or num_devices < 1:
        return None
    return flops_per_token * tokens_per_sec / (peak * num_devices)
