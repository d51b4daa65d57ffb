"""Data parallelism over pipelines: ``d`` copies of one pipeline, each with ``1/d`` of every batch.

A plan whose stages have data-parallel degree ``d`` and tensor-parallel degree ``t``
(:attr:`torchplace.plan.Stage.data_parallel`, ``tensor_parallel``) runs on ``P * d * t`` ranks for
``P`` pipeline positions (the plan's devices), laid out as a ``(P, d, t)`` grid, tensor parallelism
innermost (:func:`grid_groups`): rank ``(k * d + j) * t + i`` runs position ``k`` of copy ``j``, as
tensor-parallel rank ``i``, so one stage's ``d * t`` ranks are consecutive (as Piper's plans name
them, ``dev[a:b]``). Each copy is an ordinary
:class:`~torchplace.runtime.distributed.DistributedPipeline` on its own process group; the ``d``
ranks of one position (and tensor-parallel rank) form a data-parallel group, over which
:class:`Replicas`

* takes this copy's rows of every batch (:meth:`Replicas.share`): copy ``j`` gets the ``j``-th of
  ``d`` equal parts along dim 0, so with ``m`` micro-batches per batch it runs ``m / d`` of them;
* averages the gradients after the backward (:meth:`Replicas.average_grads`): every copy holds the
  gradient of the mean of its ``m / d`` micro-batch losses, so the average over the copies is the
  gradient of the mean over all ``m`` (the micro-batches are equal in size), which is what one
  pipeline gives on the whole batch, and the optimizer steps alike on every copy;
* makes the copies' buffers agree after every call (:meth:`Replicas.agree_buffers`), those the
  forward writes (batch norm's statistics, a counter): a floating buffer becomes the mean of the
  copies' (the copies' running statistics each averaged over their own micro-batches, then over the
  copies: the same on every copy, not the unsplit model's, whose running average takes all ``m``
  micro-batches in sequence), an integer one its value before the call plus every copy's increment
  (``num_batches_tracked`` counts all ``m`` micro-batches, as the unsplit model's), a boolean one
  true where any copy's is. Torch DDP instead broadcasts copy 0's buffers before every forward;
* joins the outputs and losses of the copies along dim 0 (:meth:`Replicas.gather`), so the last
  position of every copy returns the whole batch's.

This is PipeDream-2BW's and Piper's data parallelism of a stage (Piper, Tarnawski et al. 2021,
Sec. 3) with the same degree on every stage; torch DDP's gradient averaging, done once per step.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchplace.errors import UnsupportedError, UsageError

__all__ = ["Replicas", "grid_groups"]


@dataclass(frozen=True)
class Replicas:
    """This rank's pipeline as copy ``index`` of ``count`` (module docs).

    Attributes:
        count: the number of copies (the plan's data-parallel degree ``d``).
        index: which copy this rank's pipeline is.
        group: the process group of the ``count`` ranks that run this rank's position, one per copy.
    """

    count: int
    index: int
    group: Any

    def share(self, batch: torch.Tensor) -> torch.Tensor:
        """This copy's rows of ``batch``: the ``index``-th of ``count`` equal parts along dim 0.

        Raises:
            UsageError: ``batch`` does not split into ``count`` equal parts.
        """
        if batch.dim() == 0 or batch.shape[0] % self.count:
            raise UsageError(f"a batch of shape {tuple(batch.shape)} does not split into {self.count} equal parts "
                             f"along dim 0, one per data-parallel replica; use a batch size that is a multiple "
                             f"of {self.count}")
        rows = batch.shape[0] // self.count
        return batch.narrow(0, self.index * rows, rows)

    @torch.no_grad()
    def average_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Replace each gradient by its mean over the copies: one all-reduce per dtype of the
        gradients flattened in ``params`` order (the same order on every copy: they run the same
        stages). Which parameters have a gradient may differ between copies (a loss that reads an
        output for some samples only): that is all-reduced first, a copy without one takes zeros,
        and a parameter no copy has one for keeps ``None``, as in the plain model."""
        import torch.distributed as dist

        params = list(params)
        if not params:
            return
        first = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
        held = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=first.device)
        dist.all_reduce(held, group=self.group)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, anyone in zip(params, held.tolist()):
            if anyone and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:  # a tensor-parallel slice (DTensor) averages its own slice
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.count)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    @torch.no_grad()
    def agree_buffers(self, buffers: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None]) -> None:
        """Make the copies' ``buffers`` agree (module docs): floating ones their mean over the copies,
        integer ones ``before`` (their values before the call, ``None`` for the others) plus the sum
        of every copy's increment, boolean ones true where any copy's is. ``buffers`` are the same,
        in the same order, on every copy (the buffers the graph writes, which they all run)."""
        import torch.distributed as dist

        for buffer, old in zip(buffers, before):
            if buffer.is_floating_point() or buffer.is_complex():
                dist.all_reduce(buffer, group=self.group)
                buffer.div_(self.count)
            elif buffer.dtype == torch.bool:
                flag = buffer.to(torch.uint8)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                buffer.copy_(flag.bool())
            else:
                if old is None:
                    raise ValueError("an integer buffer needs its value before the call")
                dist.all_reduce(buffer, group=self.group)  # the sum of the copies' old + increment
                buffer.sub_(old * (self.count - 1))

    def gather(self, values: Sequence[Any], names: Sequence[str] = ()) -> list[torch.Tensor]:
        """Each tensor of ``values`` joined along dim 0 over the copies, in copy order (the batch's
        row order).

        Raises:
            UnsupportedError: a value that is not a tensor with a batch dimension (named by ``names``).
        """
        import torch.distributed as dist

        out = []
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                name = names[i] if i < len(names) else str(i)
                raise UnsupportedError(f"model output {name!r} is {type(v).__name__}"
                                       f"{' with no batch dimension' if isinstance(v, torch.Tensor) else ''}: the "
                                       "replicas' outputs are joined along dim 0; run this model with data_parallel=1")
            parts = [torch.empty_like(v) for _ in range(self.count)]
            dist.all_gather(parts, v.contiguous(), group=self.group)
            out.append(torch.cat(parts))
        return out


def grid_groups(positions: int, copies: int, tensor: int, rank: int,
                timeout: Any = None) -> tuple[Any, Replicas | None, Any]:
    """The process groups of this rank in the ``(positions, copies, tensor)`` grid (module docs):
    its pipeline's group, its :class:`Replicas` (``None`` for one copy) and its tensor-parallel
    group (``None`` for ``tensor == 1``). Every rank of the default group calls it alike
    (``new_group`` is collective): the pipeline groups, then the data-parallel groups, then the
    tensor-parallel groups, each in grid order.

    Example: ``positions=2, copies=2, tensor=1``: pipelines ``[0, 2]`` and ``[1, 3]``;
    data-parallel groups ``[0, 1]`` and ``[2, 3]``.
    """
    import torch.distributed as dist

    def at(k: int, j: int, i: int) -> int:
        return (k * copies + j) * tensor + i

    k, rest = divmod(rank, copies * tensor)
    j, i = divmod(rest, tensor)
    mine: dict[str, Any] = {}
    for name, members in [
        *((("pp", j2, i2), [at(k2, j2, i2) for k2 in range(positions)]) for j2 in range(copies) for i2 in range(tensor)),
        *((("dp", k2, i2), [at(k2, j2, i2) for j2 in range(copies)]) for k2 in range(positions) for i2 in range(tensor)
          if copies > 1),
        *((("tp", k2, j2), [at(k2, j2, i2) for i2 in range(tensor)]) for k2 in range(positions) for j2 in range(copies)
          if tensor > 1),
    ]:
        group = dist.new_group(members, timeout=timeout)
        if rank in members:
            mine[name[0]] = group
    replicas = Replicas(copies, j, mine["dp"]) if copies > 1 else None
    return mine["pp"], replicas, mine.get("tp")
