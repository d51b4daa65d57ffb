"""What a placed model's stages rely on staying as they were placed: the model's modules, their
parameters and buffers (by identity), their forward hooks and their plain Python attributes.

The stages run a graph traced from the model, whose slots hold the tensors placed (or replicas of
them), whose operators include the forward hooks the model had when traced, and whose constants
are the attributes it read. An assignment after placing (``model.fc.weight = nn.Parameter(w)``,
``model.fc = nn.Linear(...)``, ``dropout.p = 0.0``) or a hook registered or removed after placing
would change what ``model(x)`` computes but not what the placed model computes: silently
different. In-place writes (``p.copy_(w)``, ``load_state_dict``, an optimizer step) keep every
identity and are what a placed model follows. A check costs about 13 us per call on GPT-2 small
(156 tensors, children and attributes; 0.5% of a placed call there).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchplace.errors import UnsupportedError

__all__ = ["Structure"]

_HELD = ("_modules", "_parameters", "_buffers")  # what a module holds, compared by identity
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _settings(module: nn.Module) -> dict[str, Any]:
    """The module's plain Python attributes (``Dropout.p``, ``eps``, a temperature; tuples of
    them, as ``kernel_size``), which a trace takes as constants."""
    return {key: value for key, value in vars(module).items()
            if not key.startswith("_") and key != "training"
            and (isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)))}


@dataclass(frozen=True)
class Structure:
    """What :meth:`check` compares, flat, so that a check costs about a microsecond per tensor:
    ``held``: ``(path, part, mapping, key, object)`` of every child, parameter and buffer;
    ``settings``: ``(path, vars(module), key, value)`` of every plain attribute; ``hooks``:
    ``(path, hooks, keys)`` of every module's forward (pre-)hooks. An attribute, tensor or child
    added after placing is not compared: the traced graph cannot read it."""

    held: tuple[tuple[str, str, Mapping[Any, Any], Any, Any], ...]
    settings: tuple[tuple[str, dict[str, Any], str, Any], ...]
    hooks: tuple[tuple[str, str, Mapping[Any, Any], tuple[Any, ...]], ...]

    @classmethod
    def of(cls, modules: Iterable[tuple[str, nn.Module]], *, own: Iterable[nn.Module] = ()) -> Structure:
        """The structure of ``modules`` (``named_modules()`` pairs) now; of the modules ``own``
        (the placed module: its hooks run around its call, its attributes are its settings) only
        the children, parameters and buffers."""
        skip = {id(m) for m in own}
        held, settings, hooks = [], [], []
        for path, module in modules:
            for part in _HELD:
                mapping = getattr(module, part)
                held.extend((path, part, mapping, key, value) for key, value in mapping.items())
            if id(module) in skip:
                continue
            settings.extend((path, vars(module), key, value) for key, value in _settings(module).items())
            hooks.extend((path, part, getattr(module, part), tuple(getattr(module, part))) for part in _HOOKS)
        return cls(tuple(held), tuple(settings), tuple(hooks))

    def check(self) -> None:
        """Refuse a call after a module, parameter or buffer was replaced, a plain attribute changed,
        or a module hook (forward or backward) added or removed since placing.

        Raises:
            UnsupportedError: naming what changed and what to do instead.
        """
        for path, part, mapping, key, value in self.held:
            if mapping.get(key, _MISSING) is not value:
                raise UnsupportedError(
                    f"{_where(path, key)} was replaced after placing (an assignment, not an in-place write; "
                    "torch.func.functional_call and torch.export swap tensors in too): the placed stages still run "
                    "what was placed; write into the placed tensors instead (with torch.no_grad(): p.copy_(new), or "
                    "load_state_dict), or place the model again (those tools take the original model, not a placed "
                    "one)")
        for path, attributes, key, value in self.settings:
            now = attributes.get(key, _MISSING)
            if now is not value and now != value:
                raise UnsupportedError(
                    f"{_where(path, key)} was changed after placing ({value!r} -> "
                    f"{None if now is _MISSING else now!r}): the placed graph holds the value it had then (a Python "
                    "attribute is a constant in a trace); set it before placing, or place the model again")
        for path, part, hooks, keys in self.hooks:
            if len(hooks) != len(keys) or (keys and tuple(hooks) != keys):
                kind = part.strip("_").replace("_", " ").removesuffix("s")  # "forward pre hook", "backward hook"
                raise UnsupportedError(
                    f"a {kind} of {path or 'the model'} was added or removed after placing: the placed model "
                    "runs the graph traced with the hooks it had then (a traced graph makes no module calls, so a "
                    "backward hook never runs on it); register forward hooks before placing (they are traced), "
                    "use tensor hooks (p.register_hook) for gradients, or place the model again")


def _where(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
