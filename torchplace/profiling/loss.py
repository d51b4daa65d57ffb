"""The memory of a training step's loss: what the device holding the model's outputs needs for it.

In a training pipeline the last stage's worker computes ``loss_fn(output, target)`` on each
micro-batch's outputs and back-propagates it to them (:mod:`torchplace.runtime.training`). Its
forward keeps what the loss saves (a log-softmax, a difference), and its backward makes the
gradients of those temporaries and, last, the gradient of the outputs; all of it is on the
outputs' device, on top of the activations that device keeps for the stage's own backward.

:func:`measure_loss_bytes` measures it: the peak of new tensor memory
(:class:`~torchplace.profiling.livebytes.LiveBytes`) while the loss of the model's example outputs
runs forward and backward, over the outputs themselves. Without a loss function it is
:data:`ASSUMED_LOSS_FACTOR` times the outputs' bytes (:func:`assumed_loss_bytes`):
measured here, a cross-entropy over logits needs 3.0x the logits, ``F.mse_loss`` 3.0x,
``out.pow(2).mean()`` 4.0x and ``out.sum()`` 1.0x, so a loss like the last one is charged
too little unless it is given.

The bytes are those of the whole example batch; the cost model charges ``ceil(bytes / m)`` per
micro-batch (:func:`torchplace.costmodel.memory_parts`), since a loss's tensors grow with the
samples it sees.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchplace.errors import UsageError
from torchplace.graph import OpGraph
from torchplace.profiling.livebytes import LiveBytes

__all__ = ["ASSUMED_LOSS_FACTOR", "assumed_loss_bytes", "measure_loss_bytes", "writes_its_output"]

ASSUMED_LOSS_FACTOR = 3
"""Bytes of an unknown loss, in units of the model's outputs (module docstring)."""

WRITES_ITS_OUTPUT = ("loss_fn writes the model's output in place (out.div_(t), out[:, 0] = v), which a training step "
                     "gives it as an autograd leaf, and PyTorch writes no leaf that requires grad: compute it out of "
                     "place (out = out / t, out = out.masked_fill(mask, v))")
"""What to do when the loss fails as :func:`writes_its_output` tells."""


def writes_its_output(error: BaseException) -> bool:
    """Whether ``loss_fn`` failed writing in place an output it was given as an autograd leaf (the
    model's own output is not a leaf: the model's loss may write it)."""
    return (isinstance(error, RuntimeError)
            and "leaf Variable that requires grad is being used in an in-place" in str(error))


def measure_loss_bytes(output: Any, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> int:
    """The most bytes ``loss_fn(output, target)`` and its backward hold at once beyond ``output``
    (the gradient of ``output`` included), measured on copies of ``output``'s floating tensors as
    autograd leaves; ``output`` itself, and the ``.grad`` of any parameter the loss reads, are left
    as they were.

    Raises:
        UsageError: ``loss_fn`` fails on the example outputs or does not return a scalar tensor.
    """
    def leaf(t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().clone()
        return copy.requires_grad_(True) if copy.is_floating_point() or copy.is_complex() else copy

    leaves = pytree.tree_map_only(torch.Tensor, leaf, output)
    try:
        with torch.enable_grad(), LiveBytes() as live:
            base = live.mark()
            loss = loss_fn(leaves, target)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                kind = type(loss).__name__ + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                raise TypeError(f"loss_fn must return a scalar tensor, got {kind}")
            wanted = [t for t in pytree.tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            if loss.requires_grad and wanted:  # not backward(): a parameter the loss reads keeps its .grad
                grads = [g.contiguous() for g in torch.autograd.grad(loss, wanted, allow_unused=True)  # noqa: F841
                         if g is not None]  # held for the peak, and as .grad would hold them (a sum's is an expand)
            peak = live.peak
    except Exception as e:  # the user's function: any failure is theirs to fix
        first = (str(e).strip().splitlines() or [""])[0]
        fix = WRITES_ITS_OUTPUT if writes_its_output(e) else (
            "pass the loss and a target of the example batch that placed.step() will get")
        raise UsageError(f"loss_fn fails on the model's outputs for the example inputs and example_target "
                         f"({type(e).__name__}: {first}); {fix}") from e
    return max(peak - base, 0)


def assumed_loss_bytes(graph: OpGraph) -> int:
    """:data:`ASSUMED_LOSS_FACTOR` times the bytes of the model's outputs (the output bytes of the
    forward nodes making ``graph.meta["outputs"]``; a view's too, though it holds no memory of its own)."""
    outputs = set(graph.meta.get("outputs", ()))
    total = sum(r.output_bytes for _, r in graph.records() if not r.backward and outputs.intersection(r.fx_nodes))
    return ASSUMED_LOSS_FACTOR * total
