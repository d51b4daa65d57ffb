"""Scatter a batch into micro-batches and gather the micro-batch outputs.

Rules (as in torchgpipe's ``microbatch.scatter``/``gather``):

* Scatter: every tensor leaf of ``(args, kwargs)`` with at least one dimension is split along
  dim 0 with ``torch.tensor_split`` (views, no copy); all such tensors must have the same size in
  dim 0 (the batch). Other leaves (0-dim tensors, numbers, None, ...) go unchanged to every
  micro-batch. An empty batch is one (empty) micro-batch. When the batch is smaller than the requested number of micro-batches, the number
  is clamped to the batch size and a ``RuntimeWarning`` says so; with no batched tensor there is
  one micro-batch.
* Gather: the outputs of the micro-batches, in micro-batch order, are combined leaf by leaf
  (``torch.utils._pytree``): tensor leaves are concatenated along dim 0; non-tensor leaves, and
  the leaves ``place()`` found to read no batched input (:func:`torchplace.batchdim.check_split`:
  a constant or a parameter the model returns), are taken from the first micro-batch. A 0-dim
  tensor leaf cannot be concatenated and raises. An input the model returns as it was given
  (each micro-batch's leaf is that micro-batch's piece of it) comes back as the caller's tensor,
  as from the model, not as a joined copy.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torchplace.errors import MicrobatchError, warn_caller

__all__ = ["batch_size", "gather", "given_pieces", "last_rows", "scatter"]


def _batch_size(leaves: Sequence[Any]) -> int | None:
    """The common dim-0 size of the batched tensor leaves, or None when there is none.

    Raises:
        MicrobatchError: if batched tensors disagree on their dim-0 size (a ``ValueError`` too).
    """
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) > 1:
        raise MicrobatchError(
            f"tensor inputs have different sizes along dim 0 ({sorted(sizes)}): micro-batches split every tensor "
            "input with dimensions along dim 0, so each must hold the batch's rows; use microbatches=1, or make the "
            "input without a batch dimension a buffer of the model"
        )
    return sizes.pop() if sizes else None


def batch_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The batch :func:`scatter` splits: the common dim-0 size of the tensor inputs (``None``
    without a batched tensor).

    Raises:
        MicrobatchError: if batched tensors disagree on their dim-0 size.
    """
    return _batch_size(tree_flatten((tuple(args), dict(kwargs)))[0])


def scatter(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Split the tensor inputs along dim 0 into micro-batches.

    Args:
        args: positional model arguments.
        kwargs: keyword model arguments.
        microbatches: requested number of micro-batches (at least 1).

    Returns:
        ``[(args_i, kwargs_i), ...]``, one pair per micro-batch, in batch order.

    Raises:
        ValueError: if ``microbatches < 1``.
        MicrobatchError: if there are several micro-batches and batched tensors disagree on dim 0.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1 (got {microbatches})")
    if microbatches == 1:  # nothing is split: inputs without the batch's rows are fine
        return [(tuple(args), dict(kwargs))]
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    batch = _batch_size(leaves)
    if batch is None or batch == 0:
        return [(tuple(args), dict(kwargs))]
    if microbatches > batch:
        warn_caller(f"{microbatches} micro-batches requested for a batch of {batch}; using {batch}", RuntimeWarning)
        microbatches = batch
    columns = [_split_leaf(leaf, microbatches) for leaf in leaves]
    return [tree_unflatten([col[i] for col in columns], spec) for i in range(microbatches)]


def last_rows(args: tuple[Any, ...], kwargs: Mapping[str, Any], batch: int,
              n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with every batched tensor (``batch`` rows in dim 0) cut to its last ``n``
    rows (views), the other leaves as they are."""
    def cut(leaf: Any) -> Any:
        batched = isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch
        return leaf[batch - n:] if batched else leaf

    return tree_map(cut, (tuple(args), dict(kwargs)))


def _split_leaf(leaf: Any, chunks: int) -> Sequence[Any]:
    """``chunks`` views of a batched tensor, or the leaf repeated."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        return leaf.tensor_split(chunks)
    return [leaf] * chunks


def given_pieces(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> dict[tuple[int, ...], torch.Tensor]:
    """The caller's tensors by the ids of their pieces in ``chunks`` (what :func:`scatter` made of
    ``(args, kwargs)``), for :func:`gather` to give back a tensor the model returns as it was given.
    The ids hold while ``chunks`` is alive."""
    leaves = tree_flatten((tuple(args), dict(kwargs)))[0]
    columns = zip(*(tree_flatten(chunk)[0] for chunk in chunks))
    return {tuple(map(id, column)): leaf for leaf, column in zip(leaves, columns) if isinstance(leaf, torch.Tensor)}


def gather(outputs: Sequence[Any], joined: Sequence[bool] | None = None,
           given: Mapping[tuple[int, ...], torch.Tensor] | None = None) -> Any:
    """Combine micro-batch outputs into the output of the whole batch.

    Args:
        outputs: one output pytree per micro-batch, in micro-batch order, all of one structure.
        joined: per leaf, whether it is concatenated (``False``: the first micro-batch's is
            taken); ``None``: every tensor leaf is.
        given: :func:`given_pieces` of the inputs: a leaf whose micro-batch tensors are the pieces
            of an input is that input.

    Returns:
        The first output's structure with tensor leaves concatenated along dim 0 (a leaf that is
        the same tensor as another in every micro-batch is the same joined tensor).

    Raises:
        ValueError: if a tensor leaf is 0-dim while there are several micro-batches, or the
            micro-batch outputs differ in structure.
    """
    if len(outputs) == 1:
        return outputs[0]
    flats = [tree_flatten(out) for out in outputs]
    spec = flats[0][1]
    if any(other != spec for _, other in flats[1:]):
        raise ValueError("micro-batch outputs differ in structure; use microbatches=1")
    if joined is not None and len(joined) != len(flats[0][0]):
        raise ValueError(f"the output has {len(flats[0][0])} parts where the example's had {len(joined)}; "
                         "use microbatches=1")
    out: list[Any] = []
    seen: dict[tuple[int, ...], Any] = dict(given or {})  # a tensor returned twice, or as given, comes back as from the model
    for i, column in enumerate(zip(*(leaves for leaves, _ in flats))):
        if (joined is not None and not joined[i]) or not isinstance(column[0], torch.Tensor):
            out.append(column[0])  # not joined, or not a tensor: the first micro-batch's
            continue
        key = tuple(map(id, column))
        if key not in seen:
            seen[key] = _gather_leaf(i, list(column))
        out.append(seen[key])
    return tree_unflatten(out, spec)


def _gather_leaf(position: int, column: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate one tensor leaf over micro-batches."""
    first = column[0]
    if first.dim() == 0:
        raise ValueError(
            f"output leaf {position} is a 0-dim tensor and cannot be concatenated over "
            "micro-batches (is it a reduction over the batch?); use microbatches=1"
        )
    for leaf in column:
        if leaf.is_cuda:
            leaf.record_stream(torch.cuda.current_stream(leaf.device))
    return torch.cat(column, dim=0)
