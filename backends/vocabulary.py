"""The names every adapter shares (the devices, the head-split strategies) and its two refusals
(`backends.base` re-exports them)."""

from __future__ import annotations

DEVICE_NAMES = ("cpu", "gpu")
DEVICE_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}

# The column/row-sample article's head-split strategies. "direct_reshape" is the known mistake
# (reshape (N, D) straight to (H, N, Dk)); it is kept to prove that the checks catch it.
STANDARD = "standard"
PER_HEAD = "per_head"
SLICING = "slicing"
DIRECT_RESHAPE = "direct_reshape"
KNOWN_WRONG_STRATEGIES = frozenset({DIRECT_RESHAPE})


class BackendNotInstalled(ImportError):
    """A backend's framework is missing; the message carries the install command."""


class UnsupportedCase(ValueError):
    """The backend cannot run this (config, dtype, device, strategy); the message says why."""


def check_device_name(device: object) -> str:
    """Normalise a device name ("cpu", "gpu"; "cuda" is accepted for "gpu")."""
    if not isinstance(device, str) or device.lower() not in DEVICE_ALIASES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_NAMES)} ('cuda' means 'gpu'); got {device!r}")
    return DEVICE_ALIASES[device.lower()]
