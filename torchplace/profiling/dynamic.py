"""Which input dimensions may change between calls: the ``dynamic_shapes`` torch.export gets.

Dim 0 of every tensor input (the batch, which micro-batching splits) is always dynamic. Other
dimensions, a sequence length above all, are dynamic where the user says so:

* ``dynamic_dims={"input_ids": [1], "attention_mask": [1]}``: the named inputs (keyword names, or
  the names of ``model.forward``'s positional parameters; an ``int`` key is a positional index)
  and the dims of each of their tensor leaves that may vary;
* ``dynamic_dims="auto"``: every dimension of every tensor input is ``Dim.AUTO``: export keeps
  dynamic what the model lets vary and specializes the rest (a hidden size, a dimension the code
  branches on) without failing;
* ``None`` (the default): only the batch.

A dynamic dimension is profiled and sized at the example's length; the placed model then runs at
every length the export's guards accept (a call outside them raises
:class:`~torchplace.errors.UsageError` naming the guard). torch.export specializes a dimension
whose example size is 0 or 1, so give examples of length 2 or more.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchplace.checks import brief
from torchplace.errors import UsageError

__all__ = ["DynamicDims", "check_dynamic_dims", "check_exportable", "dynamic_inputs", "dynamic_shapes"]

DynamicDims = Union[Mapping[Union[str, int], Iterable[int]], str, None]
"""``{input name or position: dims}``, ``"auto"`` or ``None`` (see the module docstring)."""


def dynamic_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's inputs by the names ``dynamic_dims`` keys them with (``model.forward``'s
    parameter names)."""
    return _bound(model, args, kwargs)


def _bound(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's inputs by ``model.forward``'s parameter names."""
    try:
        return dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}


def _takes_var_positional(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``*args``."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def check_dynamic_dims(dynamic_dims: Any, model: nn.Module, args: tuple[Any, ...],
                       kwargs: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | str | None:
    """``dynamic_dims`` checked and keyed by parameter name, dims non-negative.

    Raises:
        UsageError: for an unknown input, an input with no tensor, or a dim it does not have.
    """
    if dynamic_dims is None or dynamic_dims == "auto":
        return dynamic_dims
    if not isinstance(dynamic_dims, Mapping):
        raise UsageError(f"dynamic_dims must be a dict like {{'input_ids': [1]}}, 'auto' or None, got {brief(dynamic_dims)}")
    bound = _bound(model, args, kwargs)
    names = list(bound)
    out: dict[str, tuple[int, ...]] = {}
    for key, dims in dynamic_dims.items():
        name = names[key] if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(args) else key
        if name not in bound:
            raise UsageError(f"dynamic_dims names input {key!r}, which this call does not pass; inputs: {names}")
        tensors = [t for t in pytree.tree_leaves(bound[name]) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise UsageError(f"dynamic_dims names input {name!r}, which holds no tensor")
        if isinstance(dims, int) or not isinstance(dims, Iterable):
            raise UsageError(f"dynamic_dims[{key!r}] must be a list of dimensions like [1], got {brief(dims)}")
        rank = min(t.dim() for t in tensors)
        dims = tuple(dims)
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or not -rank <= d < rank:
                raise UsageError(f"dynamic_dims[{key!r}]: {d!r} is not a dimension of {name!r} (it has {rank})")
        out[str(name)] = tuple(sorted({d % rank for d in dims} - {0}))
    return out


def check_exportable(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                     dims: dict[str, tuple[int, ...]] | str | None) -> None:
    """Refuse dims asked dynamic (as :func:`check_dynamic_dims` returned them) whose example size
    is 0 or 1, before torch.export is asked: it fixes such a size, and says only that the user's
    range conflicts with the one it inferred (an fx trace, which holds no sizes, needs no check).

    Raises:
        UsageError: naming the input, the dim and what to give instead.
    """
    if not isinstance(dims, Mapping):
        return
    bound = _bound(model, args, kwargs)
    for name, wanted in dims.items():
        tensors = [t for t in pytree.tree_leaves(bound.get(name)) if isinstance(t, torch.Tensor)]
        for d in wanted:
            small = [t.shape[d] for t in tensors if t.dim() > d and t.shape[d] < 2]
            if small:
                raise UsageError(
                    f"dynamic_dims: dim {d} of {name!r} has size {small[0]} in the example, and torch.export fixes a "
                    "size of 0 or 1 (it cannot trace it dynamic): give an example of size 2 or more there (the "
                    "placed model then serves size one too)")


def dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   dims: dict[str, tuple[int, ...]] | str | None = None) -> Any:
    """The ``dynamic_shapes`` of :func:`torch.export.export` for this call: dim 0 of every tensor
    input ``Dim.AUTO`` (the batch is dynamic unless the model fixes it, e.g. a reshape to the
    example's batch size: that model is then traced for that batch alone, and refused
    micro-batches by ``place()``), and ``dims`` as :func:`check_dynamic_dims` returned them
    (``Dim.DYNAMIC``: export fails, naming the dimension, where the model fixes one).

    Positional-only calls get a tuple like ``args``; calls with keywords get a dict keyed by the
    parameter names of ``model.forward``, as :func:`torch.export.export` expects.
    """

    def spec(name: str | None) -> Any:
        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return None
            if dims == "auto":
                return {0: torch.export.Dim.AUTO, **{d: torch.export.Dim.AUTO for d in range(1, t.dim())}}
            extra = dims.get(name, ()) if isinstance(dims, dict) and name is not None else ()
            return {0: torch.export.Dim.AUTO, **{d: torch.export.Dim.DYNAMIC for d in extra}}
        return leaf

    if not kwargs and not _takes_var_positional(model):  # export wants *args' specs nested under its name
        names = list(_bound(model, args, {}))
        return tuple(pytree.tree_map(spec(names[i] if i < len(names) else None), x) for i, x in enumerate(args))
    bound = _bound(model, args, kwargs)
    return {name: pytree.tree_map(spec(name), value) for name, value in bound.items()}
