"""What a placed model's stages rely on staying as they were placed: the model's modules, their
parameters and buffers (by identity) and their forward hooks.

The stages run a graph traced from the model, whose slots hold the tensors placed (or replicas of
them), and whose operators include the forward hooks the model had when traced. An assignment
after placing (``model.fc.weight = nn.Parameter(w)``, ``model.fc = nn.Linear(...)``) or a hook
registered or removed after placing would change what ``model(x)`` computes but not what the
placed model computes: silently different. In-place writes (``p.copy_(w)``, ``load_state_dict``,
an optimizer step) keep every identity and are what a placed model follows.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from torchplace.errors import UnsupportedError

__all__ = ["Structure"]

_PARTS = ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks")


def _ids(module: nn.Module, part: str) -> tuple[tuple[object, int], ...]:
    return tuple((key, id(value)) for key, value in getattr(module, part).items())


@dataclass(frozen=True)
class Structure:
    """A snapshot of ``(path, module, parts, ids)`` per module; :meth:`check` compares the modules
    now with it (a few microseconds per module)."""

    entries: tuple[tuple[str, nn.Module, tuple[str, ...], tuple[tuple[tuple[object, int], ...], ...]], ...]

    @classmethod
    def of(cls, modules: Iterable[tuple[str, nn.Module]], *, without_hooks: Iterable[nn.Module] = ()) -> Structure:
        """The structure of ``modules`` (``named_modules()`` pairs) now; the hooks of the modules
        ``without_hooks`` are left out (the placed module's own hooks run around its call)."""
        skip = {id(m) for m in without_hooks}
        entries = []
        for path, module in modules:
            parts = _PARTS[:3] if id(module) in skip else _PARTS
            entries.append((path, module, parts, tuple(_ids(module, part) for part in parts)))
        return cls(tuple(entries))

    def check(self) -> None:
        """Refuse a call after a module, parameter or buffer was replaced or a forward hook added
        or removed since placing.

        Raises:
            UnsupportedError: naming what changed and what to do instead.
        """
        for path, module, parts, ids in self.entries:
            for part, before in zip(parts, ids):
                if _ids(module, part) != before:
                    raise UnsupportedError(_message(path, part, dict(before), getattr(module, part)))


def _message(path: str, part: str, before: dict[object, int], now: dict) -> str:
    changed = [key for key in dict.fromkeys([*before, *now]) if before.get(key) != (id(now[key]) if key in now else None)]
    where = ", ".join(f"{path + '.' if path else ''}{key}" for key in changed[:3] if isinstance(key, str)) or path or "the model"
    if part in ("_forward_hooks", "_forward_pre_hooks"):
        return (f"a forward hook of {path or 'the model'} was added or removed after placing: the placed model runs "
                "the graph traced with the hooks it had then; register hooks before placing (they are traced), or "
                "place the model again")
    return (f"{where} was replaced after placing (an assignment, not an in-place write): the placed stages still run "
            "what was placed; write into the placed tensors instead (with torch.no_grad(): p.copy_(new), or "
            "load_state_dict), or place the model again")
