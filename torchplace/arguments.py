"""Checks of :func:`torchplace.place`'s arguments, all made before anything is traced or timed.

Each bad argument is a :class:`~torchplace.errors.UsageError` naming the argument and the fix, so a
mistake costs a second, not a profiling run.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchplace.checks import brief
from torchplace.errors import UsageError
from torchplace.profiling.effects import StateSnapshot, named_state

__all__ = ["check_model", "example_call", "leaf_types", "try_example_call"]


def check_model(model: Any, allow_meta: bool = False) -> nn.Module:
    """The model, if it is an ``nn.Module`` whose tensors hold data (not on the meta device), or,
    with ``allow_meta``, whose tensors are all on the meta device or all hold data.

    Raises:
        UsageError: for anything else, saying what to pass instead.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {brief(model)}; wrap a function in an nn.Module")
    placed = [name for name, m in model.named_modules() if getattr(type(m), "_torchplace_placed", False)]
    if placed:
        where = "the model" if placed[0] == "" else f"the model's submodule {placed[0]!r}"
        raise UsageError(f"{where} is already placed by torchplace (its stages run on their devices, and its graph "
                         "cannot be traced again): place the original model, e.g. placed.module of a @placed "
                         "class, or the model you passed to place()")
    state = named_state(model)
    on_meta = [name for name, t in state.items() if t.device.type == "meta"]
    if on_meta and allow_meta and len(on_meta) == len(state):
        return model
    if on_meta:
        which = "to plan it from shapes alone, every tensor must be on the meta device; " if allow_meta else (
            "torchplace.plan_model(...) plans a model on the meta device with estimated costs; to place and run it, ")
        raise UsageError(
            f"model has {len(on_meta)} tensor(s) on the meta device (e.g. {on_meta[0]!r}): {which}"
            "materialize the weights first (model.to_empty(device='cpu'), then load a state dict)"
        )
    return model


def example_call(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the example call: a single tensor is one positional input.

    Raises:
        UsageError: for a dict given as ``example_inputs`` (keywords go in ``example_kwargs``),
            ``example_kwargs`` that is not a mapping with string keys, or a tensor input with a
            batch (dim 0) of size 0.
    """
    if isinstance(example_inputs, torch.Tensor):
        args: tuple[Any, ...] = (example_inputs,)
    elif isinstance(example_inputs, Mapping):
        raise UsageError(
            "example_inputs is a mapping: pass keyword inputs as example_kwargs={...} "
            "(e.g. example_kwargs={'input_ids': ids, 'attention_mask': mask})"
        )
    elif isinstance(example_inputs, Sequence) and not isinstance(example_inputs, (str, bytes)):
        args = tuple(example_inputs)
    else:
        raise UsageError(f"example_inputs must be a tuple of positional inputs or one tensor, got {brief(example_inputs)}")
    if example_kwargs is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(example_kwargs, Mapping) and all(isinstance(k, str) for k in example_kwargs):
        kwargs = dict(example_kwargs)
    else:
        raise UsageError(f"example_kwargs must be a dict of keyword inputs, got {brief(example_kwargs)}")
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == 0:
            where = pytree.keystr(path)
            raise UsageError(
                f"example input {where} has batch size 0 (shape {tuple(leaf.shape)}): give at least one sample "
                "along dim 0, so that every operator runs and is timed"
            )
    return args, kwargs


def try_example_call(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Run ``model`` once on copies of the example inputs (no grad) and return its output; its
    state is restored after.

    Raises:
        UsageError: if the model fails on them (wrong number, shape or dtype of inputs), with the
            model's own error.
    """
    copies = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, dict(kwargs)))
    snapshot = StateSnapshot(model)
    try:
        with torch.no_grad():
            return model(*copies[0], **copies[1])
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
        if len(devices) > 1:
            raise UsageError(
                f"the model fails on example_inputs/example_kwargs ({type(e).__name__}: {first}) and its parameters "
                f"and buffers are on several devices ({', '.join(devices)}), as an earlier torchplace.place() of it "
                "leaves them (placing moves the model's own tensors to their stages); place a fresh copy of the "
                "model, or move it to one device first (model.to('cpu'))"
            ) from e
        raise UsageError(
            f"the model fails on example_inputs/example_kwargs: {type(e).__name__}: {first}; pass inputs "
            "the model accepts (positional in example_inputs, keywords in example_kwargs)"
        ) from e
    finally:
        snapshot.restore()


def leaf_types(model: nn.Module, leaf_modules: Iterable[Any]) -> tuple[type, ...]:
    """Module classes from ``leaf_modules``: classes, or class names as in accelerate's
    ``no_split_module_classes`` (``["GPT2Block"]``), resolved among the model's modules.

    Raises:
        UsageError: for a name no module of the model has (with the closest names), or an item
            that is neither an ``nn.Module`` subclass nor a string.
    """
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    out: list[type] = []
    for item in leaf_modules:
        if isinstance(item, str):
            if item not in classes:
                close = difflib.get_close_matches(item, classes, n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; the model has {sorted(classes)[:8]}"
                raise UsageError(f"leaf_modules names {item!r}, which is no module class of the model{hint}")
            out.append(classes[item])
        elif isinstance(item, type) and issubclass(item, nn.Module):
            out.append(item)
        else:
            raise UsageError(
                f"leaf_modules must hold nn.Module subclasses or class names, got {brief(item)} "
                "(e.g. leaf_modules=[GPT2Block] or ['GPT2Block'])"
            )
    return tuple(out)
