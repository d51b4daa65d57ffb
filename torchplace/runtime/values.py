"""The values one call of a split model computes, by name, and their copies on other devices.

Both executors keep every value as its producer made it (a model input as the caller passed it)
and give a stage on another device a copy, made once per (name, device) and reused by later stages
there. In-place writes (:mod:`torchplace.profiling.effects`) make two exceptions, applied by
:meth:`Values.wrote` after each stage that writes memory in place:

* every copy of a written value (and of its aliases) on another device is forgotten, so a later
  reader copies the new value;
* a model input that a stage wrote through its copy makes that copy the input's value from then
  on (later readers, and views taken there, see the write); :meth:`Values.finish` copies it back
  into the caller's tensor at the end of the call, as eager PyTorch would leave it. A written
  input is never dropped before then.

The placement keeps every other write on the device that owns the memory (the writers of a
tensor share its producer's device), so the originals are the values written.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from torchplace.errors import UnsupportedError
from torchplace.runtime.devices import copy_to, to_device

__all__ = ["Values", "written_inputs"]


def _on(value: Any, device: torch.device) -> bool:
    return all(t.device == device for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _clone(value: Any) -> Any:
    return tree_map(lambda t: copy_to(t, t.device) if isinstance(t, torch.Tensor) else t, value)


class Values:
    """Named values of one call (or one micro-batch) and their copies on other devices.

    Devices are the plan's devices (worker keys such as ``"cpu:1"``, ``"cuda:0"``), each with its
    torch device. A value belongs to the device whose stage produced it; model inputs belong to
    the caller.

    Args:
        originals: the values so far, ``{name: value}`` (the bound model inputs to begin with).
        inputs: the names that are model inputs (written ones are copied back).
        isolate: give every plan device its own memory even where two share a torch device
            (logical CPUs): a value read on another plan device is always a copy, as between two
            GPUs. A test aid that shows on the CPU what placement on separate memories does.
    """

    def __init__(self, originals: Mapping[str, Any], inputs: Collection[str], isolate: bool = False,
                 written_inputs: Collection[str] = ()) -> None:
        self.originals: dict[str, Any] = dict(originals)
        self._home: dict[str, str] = {}
        self._inputs = frozenset(inputs)
        self._isolate = isolate
        self._copies: dict[tuple[str, str], Any] = {}
        self._written = frozenset(n for n in written_inputs if n in self.originals)
        self._caller = {n: self.originals[n] for n in self._written}
        _check_no_alias(self._caller, {n: v for n, v in self.originals.items() if n in self._inputs})

    def __contains__(self, name: object) -> bool:
        return name in self.originals

    def get(self, name: str, place: str, device: torch.device, stream: Any) -> Any:
        """The value of ``name`` for a stage on plan device ``place`` (torch device ``device``):
        the original where it already is there, else its one copy there."""
        value = self.originals[name]
        if self._home.get(name) == place or (not self._isolate and _on(value, device)):
            return to_device(value, device, stream)  # marks the tensors used on ``stream``
        key = (name, place)
        copy = self._copies.get(key)
        if copy is None:
            fresh = to_device(value, device, stream)
            if self._isolate and _on(value, device):
                fresh = _clone(fresh)
            # two workers may copy at once; the first stored copy is the one everybody uses
            copy = self._copies.setdefault(key, fresh)
        return copy

    def put(self, items: Iterable[tuple[str, Any]], place: str) -> None:
        """Add values produced by a stage on plan device ``place``."""
        for name, value in items:
            self.originals[name] = value
            self._home[name] = place

    def drop(self, name: str) -> None:
        """Forget ``name`` and its copies (no later stage reads it); a written input stays until
        :meth:`finish`."""
        if name in self._written:
            return
        self.originals.pop(name, None)
        self._forget_copies((name,))

    def wrote(self, names: Collection[str], place: str) -> None:
        """After a stage on ``place`` wrote the memory of ``names`` in place: a model input written
        through its copy here takes that copy as its value; every other copy of ``names`` is
        forgotten."""
        for name in names:
            copy = self._copies.pop((name, place), None)
            if name in self._inputs and copy is not None:
                self.originals[name] = copy
                self._home[name] = place
        self._forget_copies(names)

    def finish(self) -> None:
        """Copy the value of every written model input back into the caller's tensor, under the
        caller's autograd mode (the executors run this in it): autograd records the copy as it
        records the model's own write (a later use of a caller's tensor that requires grad back-
        propagates through the write), and refuses it where eager refuses the write (a leaf that
        requires grad)."""
        for name, caller in self._caller.items():
            tree_map(_copy_into, caller, self.originals[name])

    def _forget_copies(self, names: Collection[str]) -> None:
        for key in [k for k in list(self._copies) if k[0] in names]:
            self._copies.pop(key, None)


def written_inputs(stages: Iterable[Any], graph_io: Any) -> frozenset[str]:
    """The model inputs that some stage writes in place (``StageModule.writes``)."""
    placeholders = set(getattr(graph_io, "placeholder_names", ()))
    return frozenset(n for s in stages for n in getattr(s, "writes", ()) if n in placeholders)


def _check_no_alias(written: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Refuse a call in which a written model input shares memory with another input: the split
    model copies them apart, where eager PyTorch would let one see the other's write."""
    owner: dict[int, str] = {}
    for name, value in inputs.items():
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel():
                key = t.untyped_storage().data_ptr()
                other = owner.setdefault(key, name)
                if other != name and (name in written or other in written):
                    raise UnsupportedError(
                        f"inputs {other!r} and {name!r} share memory and the model writes {sorted(written)[0]!r} in "
                        "place: pass separate tensors (e.g. x.clone()) to the placed model"
                    )


def _copy_into(original: Any, copy: Any) -> Any:
    if isinstance(original, torch.Tensor) and original is not copy:
        original.copy_(copy)
    return original
