"""Where the parameters and buffers of a split model live, and their replicas on other devices.

A placed model's parameters and buffers are the model's own tensors. Each one moves to its *home*
in place (``tensor.data = tensor.data.to(home)``, the way ``Module.to`` moves parameters), so every
reference to it (the model, an optimizer built on ``model.parameters()``, the traced graph) sees
the moved tensor and ``state_dict()`` keeps the model's keys. The home is the device of the first
stage, in plan order, that reads the tensor.

A tensor that stages on other devices read as well (GPT-2's tied ``wte`` / ``lm_head`` weight, a
module called twice) gets one *replica* on each such device, shared by the stages there that read
it (the module path to each slot is cloned for its stage; the model keeps the home tensor), as the
cost model charges one copy per device:

* with grad disabled, or for a tensor that does not require grad, the replica is a copy, made
  again before a call whenever the home tensor changed (an optimizer step or ``load_state_dict``
  moves its version counter or its memory; a fused optimizer step, ``fused=True``, moves neither,
  so every optimizer step marks the replicas of the parameters it updates stale). A write through
  ``tensor.data`` moves neither: after one, call ``PlacedModule.refresh_replicas()``;
* with grad enabled and a tensor that requires grad, the replica is ``home.to(device)`` made for
  each call, so the gradients of every use flow back into the one home tensor.

Binding a stage to its device also pins the device constants of its graph to that device
(:func:`~torchplace.fxutil.pin_devices`: ``torch.export`` records ``arange(n, device=x.device)``
with the trace-time device).
"""
from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchplace.errors import UnsupportedError
from torchplace.fxutil import pin_devices
from torchplace.profiling.effects import version_of

__all__ = ["StageParameters", "move_in_place"]


@dataclass(eq=False)
class _Replica:
    """The one replica of a home tensor on one plan device, and the stage slots that hold it."""

    home: torch.Tensor
    device: torch.device
    clone: bool  # a copy even on the home's torch device (isolated logical devices)
    slots: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (owner, "_parameters"/"_buffers", name)
    seen: tuple[int, int | None, torch.device, bool] | None = None

    def install(self, value: torch.Tensor) -> None:
        """Put ``value`` in the slots; a detached copy of a parameter becomes a parameter that
        requires grad as its home does: some kernels choose their path by it even under
        ``no_grad`` (``aten::matmul`` on a non-contiguous input), and round differently."""
        for owner, kind, slot in self.slots:
            getattr(owner, kind)[slot] = nn.Parameter(value, requires_grad=self.home.requires_grad) if (
                kind == "_parameters" and value.grad_fn is None) else value

    def refresh(self) -> None:
        """Make the slots hold a replica that reflects the home tensor now (see the module docs)."""
        if torch.is_grad_enabled() and self.home.requires_grad:
            self.install(self.home.clone() if self.clone else self.home.to(self.device))
            self.seen = None
            return
        state = (self.home.data_ptr(), version_of(self.home), self.home.device, self.home.requires_grad)
        if state != self.seen or state[1] is None:  # requires_grad too: a frozen weight's replica is frozen
            with torch.no_grad():
                value = self.home.detach().to(self.device)
                value = value.clone() if self.clone else value
            self.install(value)
            self.seen = state


def move_in_place(tensor: torch.Tensor, device: torch.device, name: str, owner: nn.Module | None = None) -> None:
    """``tensor.data = tensor.data.to(device)``: the same tensor object, now on ``device``."""
    if tensor.device == device:
        return
    with torch.no_grad():
        moved = tensor.data.to(device)
    if not torch._has_compatible_shallow_copy_type(tensor, moved):
        raise UnsupportedError(
            f"cannot move {name!r}{f' of {type(owner).__name__}' if owner is not None else ''} from {tensor.device} "
            f"to {device} in place (PyTorch "
            f"cannot change a tensor between these kinds of memory); place on devices of one kind, e.g. cpu and cuda"
        )
    tensor.data = moved


def _slots(module: nn.Module):
    """``(path, owner, kind, slot, tensor)`` for every parameter and buffer slot of ``module``."""
    for path, owner in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for slot, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    yield path, owner, kind, slot, tensor


def _own_path(stage: nn.Module, path: str, owned: set[int]) -> nn.Module:
    """Give ``stage`` its own shallow copies of the modules from itself down to ``path`` (tensors
    stay shared), so a replica installed there changes no other stage and not the model.
    ``owned`` holds the ids of copies made already (each module is copied once)."""
    owner = stage
    for part in [p for p in path.split(".") if p]:
        child = owner._modules[part]
        if id(child) not in owned:
            mine = copy.copy(child)
            mine._parameters = dict(child._parameters)
            mine._buffers = dict(child._buffers)
            mine._modules = dict(child._modules)
            owner._modules[part] = child = mine
            owned.add(id(mine))
        owner = child
    return owner


class StageParameters:
    """Homes and replicas of the tensors of a split model's stages (see the module docstring).

    Args:
        stages: the stages in plan order.
        devices: the torch device of each stage.
        places: the plan device (worker key) of each stage.
        isolate: treat every plan device as its own memory even where two share a torch device,
            so replicas are made between logical CPUs too (a test aid).

        homes: the homes another split of the same model already gave its tensors (``home`` and
            ``home_device`` of its StageParameters): they stay there, and stages elsewhere get
            replicas (an eval-mode split of a model placed for training).

    Attributes:
        home: ``id(tensor)`` -> the plan device that holds it.
        home_device: ``id(tensor)`` -> its torch device.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device], places: Sequence[str],
                 isolate: bool = False, homes: StageParameters | None = None) -> None:
        self.home: dict[int, str] = dict(homes.home) if homes else {}
        self.home_device: dict[int, torch.device] = dict(homes.home_device) if homes else {}
        home_device = self.home_device
        readers: dict[int, set[int]] = {}
        for index, (stage, device, place) in enumerate(zip(stages, devices, places)):
            if isinstance(stage, fx.GraphModule):
                pin_devices(stage, device)
            for path, _, _, slot, tensor in _slots(stage):
                readers.setdefault(id(tensor), set()).add(index)
                if id(tensor) not in self.home:
                    self.home[id(tensor)], home_device[id(tensor)] = place, device
                    move_in_place(tensor, device, f"{path}.{slot}".lstrip("."), stage)
        tensors = {id(t): t for stage in stages for *_, t in _slots(stage)}
        self.shared: list[torch.Tensor] = [tensors[i] for i, read in readers.items() if len(read) > 1]
        """The tensors several stages read (each stage's backward adds its part of their gradients)."""
        replicas: dict[tuple[int, str], _Replica] = {}
        self._by_stage: dict[int, list[_Replica]] = {}
        owned: set[int] = set()
        for index, (stage, device, place) in enumerate(zip(stages, devices, places)):
            foreign = [
                (path, kind, slot, tensor) for path, _, kind, slot, tensor in _slots(stage)
                if self.home[id(tensor)] != place and (isolate or home_device[id(tensor)] != device)
            ]
            for path, kind, slot, tensor in foreign:
                owner = _own_path(stage, path, owned)
                replica = replicas.setdefault(
                    (id(tensor), place), _Replica(tensor, device, home_device[id(tensor)] == device))
                replica.slots.append((owner, kind, slot))
                mine = self._by_stage.setdefault(index, [])
                if not any(r is replica for r in mine):
                    mine.append(replica)
        self._replicas = list(replicas.values())
        if self._replicas:
            _watch_optimizers(self)
        self.refresh()

    @property
    def replicas(self) -> int:
        """How many replicas there are: one per tensor and plan device that reads it away from home."""
        return len(self._replicas)

    def refresh(self) -> None:
        """Bring every replica up to date with its home tensor; call before each run."""
        for replica in self._replicas:
            replica.refresh()

    def forget(self, homes: set[int] | None = None) -> None:
        """Treat every replica (or those of the home tensors whose ids are in ``homes``) as stale:
        the next :meth:`refresh` copies them again."""
        for replica in self._replicas:
            if homes is None or id(replica.home) in homes:
                replica.seen = None

    def refresh_stage(self, index: int) -> None:
        """Bring stage ``index``'s replicas up to date; call before each of its runs when a run
        is a micro-batch of a training step (under grad, each gets a fresh differentiable copy,
        so every micro-batch's backward has its own path to the home tensor)."""
        for replica in self._by_stage.get(index, ()):
            replica.refresh()


_watched: weakref.WeakSet[StageParameters] = weakref.WeakSet()
_watched_lock = threading.Lock()  # a placement in one thread adds while a step in another iterates
_hook: Any = None


def _watch_optimizers(params: StageParameters) -> None:
    """Mark ``params``' replicas stale after every optimizer step that updates their home tensors
    (one hook for all, registered with the first placed model)."""
    global _hook
    with _watched_lock:
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_optimizer_stepped)
        _watched.add(params)


def _optimizer_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A fused optimizer (``fused=True``) writes its parameters without moving their version
    counters, so a replica cannot see the step by itself: the next refresh copies them again."""
    with _watched_lock:  # iterating a WeakSet that another thread adds to raises
        watched = list(_watched)
    if not watched:  # every placed model with replicas is gone
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for params in watched:
        params.forget(stepped)
