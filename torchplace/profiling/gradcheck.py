"""Does the traced graph differentiate as the model does?

A trace keeps the operators a forward runs, not the autograd state around them. A
``with torch.no_grad():`` block inside ``forward`` (fx never records it; ``torch.export`` drops it
when the trace runs without grad), a gradient hook registered on a tensor, or an autograd mode
switched in ``forward`` would give the placed model other gradients than the model's, silently.
``place(..., mode="training")`` therefore runs the model and its traced graph forward and
backward on the example's last two samples (:func:`check_gradients`) and refuses a trace whose
parameter gradients differ. Both runs start from one random seed, so dropout draws the same masks,
and the model's buffers (BatchNorm's statistics) are put back after each.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.errors import TraceError
from torchplace.fxutil import run_graph
from torchplace.profiling.effects import StateSnapshot
from torchplace.runtime.microbatch import batch_size, last_rows

__all__ = ["check_gradients"]

RTOL = 1e-3
"""Largest gradient difference, relative to the gradient's largest value, that counts as rounding
(the traced graph may decompose an operator differently); a lost ``no_grad`` block differs by far
more."""

_SEED = 20261124


def check_gradients(model: nn.Module, gm: fx.GraphModule, flat: Any, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> None:
    """Refuse a traced graph (``gm``; ``flat(args, kwargs)`` gives fresh values of its
    placeholders) whose parameter gradients differ from ``model``'s on the example's last two
    samples (all of it where it has no batch).

    Raises:
        TraceError: a gradient differs, named, with what causes it and what to do.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return
    few_args, few_kwargs = _last_two(args, kwargs)
    weights: list[torch.Tensor | None] = []  # one random projection of the outputs, for both runs
    theirs = _gradients(model, params, lambda: model(*_fresh(few_args), **_fresh(few_kwargs)), weights)
    if theirs is None:
        return  # nothing differentiable comes out: the placed model has nothing to differ in
    mine = _gradients(model, params, lambda: run_graph(gm, flat(few_args, few_kwargs)), weights)
    for (name, _), a, b in zip(params, theirs, mine if mine is not None else [None] * len(params)):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a  # type: ignore[arg-type]
        b = torch.zeros_like(a) if b is None else b
        scale = float(a.abs().max()) if a.numel() else 0.0
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        if diff > RTOL * max(scale, 1e-12) and diff > 1e-12:
            raise TraceError(
                f"the traced model's gradient of {name!r} differs from the model's by {diff:.3g} (values up to "
                f"{scale:.3g}): its forward changes what autograd records (a torch.no_grad() or enable_grad block, "
                "a gradient hook on a tensor, requires_grad_), which a trace does not keep. Use .detach() where "
                "the forward stops a gradient, move hooks out of forward, or place the model for inference")


def _gradients(model: nn.Module, params: Sequence[tuple[str, nn.Parameter]], run: Any,
               weights: list[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
    """The parameters' gradients of a fixed random projection of ``run()``'s floating-point
    outputs (``weights`` made on the first call, reused after), the model's state put back."""
    snapshot = StateSnapshot(model)
    try:
        with torch.random.fork_rng(devices=_cuda_devices(params)), torch.enable_grad():
            torch.manual_seed(_SEED)
            leaves = [t for t in pytree.tree_leaves(run()) if isinstance(t, torch.Tensor)]
        if not weights:
            generator = torch.Generator().manual_seed(_SEED)
            weights.extend(torch.randn(t.shape, generator=generator).to(t.device, t.dtype)
                           if t.is_floating_point() and t.requires_grad else None for t in leaves)
        if len(weights) != len(leaves):
            return [None] * len(params)  # another structure: every gradient is compared against none
        terms = [(t * w).sum() for t, w in zip(leaves, weights) if w is not None and t.requires_grad]
        if not terms:
            return None
        loss = terms[0]
        for term in terms[1:]:
            loss = loss + term.to(loss.device)
        return list(torch.autograd.grad(loss, [p for _, p in params], allow_unused=True))
    finally:
        snapshot.restore()


def _last_two(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` cut to the last two samples of the batch (as they are without one)."""
    try:
        batch = batch_size(args, kwargs)
    except ValueError:
        batch = None
    if batch is None or batch <= 2:
        return tuple(args), dict(kwargs)
    return last_rows(args, kwargs, batch, 2)


def _fresh(value: Any) -> Any:
    """Copies of the tensors in ``value`` (a forward may write its inputs in place)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), value)


def _cuda_devices(params: Sequence[tuple[str, nn.Parameter]]) -> list[int]:
    return sorted({p.device.index or 0 for _, p in params if p.is_cuda})
