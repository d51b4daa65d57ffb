"""The names of the example models (``torchplace plan MODEL``), without importing torch.

:mod:`torchplace.models` builds them and needs torch; the command line only needs their names
to check its arguments, and ``torchplace solve`` / ``methods`` / ``show`` must start without
torch (about 1.5 s of import). :mod:`torchplace.models` checks that its builders match.
"""
from __future__ import annotations

__all__ = ["NAMES"]

NAMES: tuple[str, ...] = ("mlp", "resnet", "inception", "transformer", "gpt2", "bert")
"""Every example model :func:`torchplace.models.build` can build, in the order the CLI lists them."""
