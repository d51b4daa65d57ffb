"""What a placed model's stages rely on staying as they were placed: the model's modules, their
parameters and buffers (by identity), their forward hooks and their plain Python attributes.

The stages run a graph traced from the model, whose slots hold the tensors placed (or replicas of
them), whose operators include the forward hooks the model had when traced, and whose constants
are the attributes it read. An assignment after placing (``model.fc.weight = nn.Parameter(w)``,
``model.fc = nn.Linear(...)``, ``dropout.p = 0.0``) or a hook registered or removed after placing
would change what ``model(x)`` computes but not what the placed model computes: silently different. In-place writes (``p.copy_(w)``, ``load_state_dict``,
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


_PLAIN = (bool, int, float, str, type(None))


def _settings(module: nn.Module) -> tuple[tuple[str, object], ...]:
    """The module's plain Python attributes (``Dropout.p``, ``eps``, a temperature; tuples of
    them, as ``kernel_size``), which a trace takes as constants."""
    return tuple((key, value) for key, value in vars(module).items()
                 if not key.startswith("_") and key != "training"
                 and (isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))))


@dataclass(frozen=True)
class Structure:
    """A snapshot of ``(path, module, parts, ids)`` per module; :meth:`check` compares the modules
    now with it (a few microseconds per module)."""

    entries: tuple[tuple[str, nn.Module, tuple[str, ...], tuple[tuple[tuple[object, int], ...], ...],
                         tuple[tuple[str, object], ...] | None], ...]

    @classmethod
    def of(cls, modules: Iterable[tuple[str, nn.Module]], *, own: Iterable[nn.Module] = ()) -> Structure:
        """The structure of ``modules`` (``named_modules()`` pairs) now; of the modules ``own``
        (the placed module: its hooks run around its call, its attributes are its settings) only
        the children, parameters and buffers."""
        skip = {id(m) for m in own}
        entries = []
        for path, module in modules:
            parts = _PARTS[:3] if id(module) in skip else _PARTS
            settings = None if id(module) in skip else _settings(module)
            entries.append((path, module, parts, tuple(_ids(module, part) for part in parts), settings))
        return cls(tuple(entries))

    def check(self) -> None:
        """Refuse a call after a module, parameter or buffer was replaced or a forward hook added
        or removed since placing.

        Raises:
            UnsupportedError: naming what changed and what to do instead.
        """
        for path, module, parts, ids, settings in self.entries:
            for part, before in zip(parts, ids):
                if _ids(module, part) != before:
                    raise UnsupportedError(_message(path, part, dict(before), getattr(module, part)))
            if settings is not None and (now := _settings(module)) != settings:
                was, changed = dict(settings), sorted({key for key, _ in set(now) ^ set(settings)})
                key = changed[0]
                raise UnsupportedError(
                    f"{path + '.' if path else ''}{key} was changed after placing ({was.get(key)!r} -> "
                    f"{getattr(module, key, None)!r}): the placed graph holds the value it had then (a Python "
                    "attribute is a constant in a trace); set it before placing, or place the model again")


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
