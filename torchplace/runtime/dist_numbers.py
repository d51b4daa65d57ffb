"""Python numbers between engine stages, computed where they are read instead of sent.

``torch.distributed.pipelining`` sends only tensors between stages. A ``torch.export`` graph whose
batch (or sequence) dimension is dynamic reads that dimension as a Python number (``sym_size_int``
of the input ids in GPT-2), and the stages after the one that made it read it again (to expand
the position ids, to reshape the heads). Such a number is a function of the symbols of the
graph's shapes: ``s0``, ``2 * s0``, ``s0 * s1``. Every tensor that crosses the same boundary
carries the same symbols in its shape (the hidden states are ``(s0, s1, 768)``), so the receiving
stage can compute the number from the sizes of the tensors it receives, exactly, and nothing but
tensors need cross.

:func:`number_rule` says how a stage computes one such number (:class:`NumberRule`;
:func:`torchplace.runtime.distributed.computed_numbers` finds which numbers each engine stage
needs); a number that no received tensor's shape determines (a value read with ``.item()``, a
number of an fx graph, :class:`FxNumber`) is refused before any communication with
:class:`~torchplace.errors.UnsupportedError`.

An fx graph (``torch.fx.symbolic_trace``, which ``trace_method="auto"`` tries first) has no
symbolic sizes: ``n = x.shape[0]`` is a plain ``int`` there, the traced call's (the whole example
batch, not a micro-batch), and nothing says how it follows from the sizes a later stage receives.
So it is never taken as a constant: :func:`example_of` gives it an :class:`FxNumber`, which
:func:`number_rule` refuses, and plans solved for the engine keep such a number's producer and
readers on one device (:func:`torchplace.api.keep_unsendable_together`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from torchplace.errors import UnsupportedError

__all__ = ["FxNumber", "NumberRule", "example_of", "is_number", "number_rule"]

_KINDS: tuple[tuple[type, type], ...] = ((torch.SymBool, bool), (torch.SymInt, int), (torch.SymFloat, float))


@dataclass(frozen=True)
class FxNumber:
    """The example of a Python number of an fx graph (:attr:`~torchplace.fxutil.TensorInfo.number`),
    which no stage but its producer's can compute (see the module's docstring).

    Attributes:
        module: the module whose forward made it (``""``: the model's own), to say where it is.
    """

    module: str = ""


def example_of(node: fx.Node) -> Any:
    """``node``'s trace-time example, as :func:`number_rule` takes it: ``node.meta["val"]`` (an
    exported graph's, with symbolic sizes); for a Python number of an fx graph, which has none, an
    :class:`FxNumber` (never its traced value: that of the example call, not of a micro-batch);
    else ``None``."""
    if "val" in node.meta:
        return node.meta["val"]
    info = node.meta.get("torchplace")
    if info is None or not info.number:
        return None
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return FxNumber(str(stack[-1][0]) if stack else "")


def is_number(example: Any) -> bool:
    """Whether a value whose trace-time example is ``example`` (:func:`example_of`) is a Python
    number: a symbolic or a plain ``int``, ``float`` or ``bool``, or an :class:`FxNumber`."""
    return isinstance(example, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, FxNumber))


@dataclass(frozen=True)
class NumberRule:
    """How an engine stage computes number ``name`` from the tensors it receives.

    Attributes:
        name: the value's name.
        expr: its sympy expression in the graph's shape symbols (a plain number: a constant).
        sizes: ``(symbol, input position, dim)``: where each symbol of ``expr`` is read, as
            ``flat[position].shape[dim]`` of the stage's received values.
        kind: ``int``, ``float`` or ``bool``.
    """

    name: str
    expr: Any
    sizes: tuple[tuple[Any, int, int], ...]
    kind: type

    def value(self, flat: Sequence[Any]) -> Any:
        """The number for one call, from the stage's received values ``flat``."""
        if not self.sizes:
            return self.kind(self.expr)
        known = {symbol: sympy.Integer(int(flat[i].shape[d])) for symbol, i, d in self.sizes}
        return self.kind(self.expr.xreplace(known))


def number_rule(name: str, example: Any, inputs: Sequence[str], examples: Mapping[str, Any],
                 stage: int) -> NumberRule:
    """The rule that computes number ``name`` (example ``example``) in engine stage ``stage``
    from its received values ``inputs`` (examples by name in ``examples``).

    Raises:
        UnsupportedError: no received tensor's shape holds a symbol the number depends on, or it is
            a number of an fx graph (:class:`FxNumber`), which no sizes describe.
    """
    if isinstance(example, FxNumber):
        made = f", made in module {example.module!r}" if example.module else ""
        raise UnsupportedError(
            f"value {name!r} (a Python number of an fx-traced graph, such as x.shape[0]{made}) is read by engine "
            f"stage {stage}, and torch.distributed.pipelining sends only tensors between stages; an fx graph has no "
            "symbolic sizes from which that stage could compute it: place with trace_method='export' (the reading "
            "stage then computes it from the sizes of the tensors it receives), or with a plan that runs its producer "
            "and its readers in one stage (one solved with contiguous=True does; leaf_modules=[...] keeps a module's "
            "numbers inside it)")
    if not isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return NumberRule(name, example, (), type(example))  # a constant the trace kept
    kind = next(k for sym, k in _KINDS if isinstance(example, sym))
    expr = example.node.expr
    where: dict[Any, tuple[int, int]] = {}
    for position, value in enumerate(inputs):
        tensor = examples.get(value)
        if isinstance(tensor, torch.Tensor):
            for dim, size in enumerate(tensor.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    where.setdefault(size.node.expr, (position, dim))
    missing = sorted(str(s) for s in expr.free_symbols - where.keys())
    if missing:
        raise UnsupportedError(
            f"value {name!r} (a Python {kind.__name__}, {expr}) is read by engine stage {stage}, and "
            "torch.distributed.pipelining sends only tensors between stages; no tensor that stage receives has "
            f"the size {', '.join(missing)} it is computed from: place so that this value does not cross a stage "
            "boundary (e.g. keep its producer and readers in one module with leaf_modules=...)"
        )
    return NumberRule(name, expr, tuple((s, *where[s]) for s in sorted(expr.free_symbols, key=str)), kind)
