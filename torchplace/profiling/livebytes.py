"""Live tensor memory as operators make it: a dispatch mode that counts storages while Python holds them.

Used where the memory of a piece of model must be known without running it on its device: the
Hugging Face block probe (:mod:`torchplace.hf.blocks`, fake tensors included) and the memory
benchmarks (per worker thread).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the operators run under it create, while Python still holds them,
    and their peak since :meth:`mark` (fake tensors count too: they have storages, not memory).

    A storage is counted from the first tensor an operator returns on it until the last such
    tensor dies; a result that views an input's storage adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._lock = threading.Lock()

    def mark(self) -> int:
        """Start a new peak from what is live now; returns it."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if _strided(t)}
        for t in pytree.tree_leaves(out):
            if not _strided(t):
                continue
            key = _storage(t)
            with self._lock:
                if key in seen and key not in self._count:
                    continue  # a view of memory made elsewhere (weights, inputs)
                if key not in self._count:
                    self._count[key], self._size[key] = 0, t.untyped_storage().nbytes()
                    self.live += self._size[key]
                    self.peak = max(self.peak, self.live)
                self._count[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key: int) -> None:
        with self._lock:
            self._count[key] -= 1
            if self._count[key] == 0:
                del self._count[key]
                self.live -= self._size.pop(key)


def _strided(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
