"""Hand a split model to ``torch.distributed.pipelining``: one process (rank) per plan device.

torchplace splits the traced graph into stages (:func:`~torchplace.runtime.split.split_stages`);
this module turns them into the engine's stages and schedules
(https://pytorch.org/docs/stable/distributed.pipelining.html) and runs them. The steps:

1. :func:`engine_layout` orders the plan's pieces into *engine stages*. The engine's multi-stage
   schedules put engine stage ``k`` on rank ``k % world`` (its "loop" layout), so consecutive
   pieces of one rank form one engine stage, and where the plan's next piece is not on the next
   rank in that cycle, *pass-through* stages (no computation) on the ranks in between carry the
   values on. Every rank then holds the same number of engine stages, as the looped schedules
   (``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``) need.
2. :func:`live_values` lists, for each boundary between engine stages, the values that cross it:
   those produced before it and read after it (by a later stage or the model output). The engine
   only sends engine stage ``k``'s outputs to engine stage ``k + 1``, so a value that skips stages
   is carried through each one between (and its gradient back, by the engine's backward).
3. :class:`EngineStage` is an ``nn.Module`` taking and returning flat tuples of tensors: it binds
   its inputs to their names, runs its pieces (the model's own submodules and tensors) and returns
   the values that cross its outgoing boundary.
4. :class:`DistributedPipeline` builds a ``PipelineStage`` per local engine stage, moves this rank's
   tensors to its device and frees the others' (meta device), and runs the engine's schedules:
   ``run(x)`` (inference: forward only) and ``step(x, target=y, loss_fn=f)`` (training).
5. Random numbers: each engine stage of each data-parallel copy draws from a stream of its own,
   seeded anew at every call (:mod:`~torchplace.runtime.dist_random`): ranks that were seeded alike
   no longer draw the same dropout masks.
6. Data parallelism: with :class:`~torchplace.runtime.dist_replicas.Replicas`, the pipeline is one
   of ``d`` copies, each on its own process group with ``1/d`` of every batch; gradients are
   averaged over the copies after the backward and outputs joined (:mod:`~torchplace.runtime.dist_replicas`).
   Tensor parallelism: with a ``tensor_group``, the Linear pairs of this rank's stages are split
   over its ranks before the engine's stages are built (:mod:`~torchplace.runtime.dist_tensor`).
7. Gradients that are ``None``: where no gradient reaches a value that engine stage ``k + 1``
   received (an output the loss ignores, a value the stage detaches), the engine sends zeros back
   to stage ``k``, whose backward would give every parameter reached only through that value
   ``.grad`` zeros where the plain model leaves ``None`` (an optimizer then treats it as trained:
   AdamW's weight decay moves it, Adam counts a step). So every engine stage but the last sends,
   after its values, a *token* (:class:`_Sent`: zeros, one per value), and every one but the first
   receives it after its inputs (:class:`_Received`), in inference too (the inference and training
   schedules share the engine's stages, whose inputs and outputs keep their number). The token's
   gradient, made by the receiver's backward and sent back by the engine as any other, is 1 for
   each value a gradient reached and 0 for the others; the sender's backward passes on only the
   values flagged 1 (``None`` for the others), per micro-batch, and a gradient of zeros that
   exists is flagged 1. A tied weight (:meth:`DistributedPipeline._sync_shared_grads`) and a
   data-parallel copy (:meth:`~torchplace.runtime.dist_replicas.Replicas.average_grads`) keep
   ``None`` where no rank's stages, no copy, gave a gradient.

Failures: an exception on a rank is written to the rendezvous store under ``torchplace/fault/N``
(naming the rank, the engine stage and the pass) before it is raised as
:class:`~torchplace.errors.DistributedError`; a watchdog thread on every rank ends the process
with that message when another rank reported a fault while this one still waits, and a rank whose
peer died (a killed process) gets gloo's or NCCL's connection error, translated into the same error
naming the rank that stopped (found by its heartbeat in the store). See
:mod:`torchplace.runtime.dist_faults`.
"""
from __future__ import annotations

import contextlib
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchplace.errors import DistributedError, UnsupportedError, UsageError
from torchplace.runtime.dist_faults import Activity, first_line
from torchplace.runtime.dist_numbers import NumberRule, is_number, number_rule
from torchplace.runtime.dist_random import RandomStream, call_seed
from torchplace.runtime.dist_replicas import Replicas
from torchplace.runtime.params import _slots, move_in_place
from torchplace.runtime.split import StageModule

__all__ = [
    "PRICED_AS",
    "SCHEDULES",
    "DistributedPipeline",
    "EngineSlot",
    "EngineStage",
    "computed_numbers",
    "engine_layout",
    "live_values",
    "release_abandoned",
]

SCHEDULES = ("gpipe", "1f1b", "looped-bfs", "interleaved-1f1b", "zero-bubble")
"""Schedules a :class:`DistributedPipeline` runs, by the engine's classes:

* ``"gpipe"``: ``ScheduleGPipe`` (GPipe, Huang et al. 2019, arXiv:1811.06965) with one engine stage
  per rank, ``ScheduleLoopedBFS`` (breadth-first, Lamy-Poirier 2022, arXiv:2211.05953) with several;
* ``"1f1b"``: ``Schedule1F1B`` (PipeDream-flush, Narayanan et al. 2021, arXiv:2006.09503) with one,
  ``ScheduleInterleaved1F1B`` (Narayanan et al. 2021, arXiv:2104.04473) with several;
* ``"looped-bfs"``, ``"interleaved-1f1b"``: those looped schedules by name;
* ``"zero-bubble"``: ``ScheduleInterleavedZeroBubble`` (ZB1P, Qi et al. 2023, arXiv:2401.10241),
  which splits each backward into input and weight gradients.

The cost model's in-flight activations are GPipe's and 1F1B's (exact with one stage per rank);
:data:`PRICED_AS` says which of the two counts each schedule's."""

PRICED_AS = {"gpipe": "gpipe", "looped-bfs": "gpipe", "zero-bubble": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "1f1b"}
"""The cost model's schedule (:data:`torchplace.problem.SCHEDULES`) whose in-flight activations a
plan counts for each engine schedule: the breadth-first ones keep every micro-batch's, as GPipe
does; the interleaved 1F1B starts its backwards as 1F1B does; zero-bubble defers its weight
gradients, which keeps activations longer than 1F1B: it is counted as GPipe, which bounds it."""


@dataclass(frozen=True)
class EngineSlot:
    """One engine stage: its rank, the plan pieces it runs, the values entering and leaving it.

    Attributes:
        index: the engine stage index (the engine puts it on rank ``index % world``).
        rank: the rank that runs it.
        pieces: indices of the torchplace stages it runs, in order; empty for a pass-through.
        inputs: names of the values it receives, in the order of its forward's arguments.
        outputs: names of the values it sends on (for the last one, the values the model output reads).
        numbers: Python numbers its pieces read that it neither makes nor receives: computed from
            the sizes of the tensors it receives (:func:`computed_numbers`).
        last: whether it is the last engine stage; every other one sends a gradient token after
            its ``outputs`` (module docs), and every one but the first receives one after its ``inputs``.
    """

    index: int
    rank: int
    pieces: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    numbers: tuple[NumberRule, ...] = ()
    last: bool = False


def _check_zero_bubble(slots: Sequence[EngineSlot], fed: Sequence[str]) -> None:
    """Refuse the zero-bubble schedule where it would lose gradients: it splits each backward into
    an input part and a weight part, and torch.distributed.pipelining finds the weights of the
    weight part through the inputs' gradients, except at engine stage 0. A later stage that
    computes from a model input (which carries no gradient: token ids into an embedding, or every
    input where the first engine stage is a pass-through) would leave its weights without one."""
    fed_names = set(fed)
    for slot in slots[1:]:
        read = sorted(fed_names.intersection(slot.inputs))
        if slot.pieces and read:
            raise UnsupportedError(
                f"schedule 'zero-bubble' would leave weights without gradients: engine stage {slot.index} (rank "
                f"{slot.rank}) computes from model input(s) {read}, and torch.distributed.pipelining finds a stage's "
                "weights through its inputs' gradients except at its first stage; use schedule '1f1b' or "
                "'interleaved-1f1b', or a plan that reads the model inputs in its first piece, on rank 0")


def engine_layout(stage_ranks: Sequence[int], world: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(rank, pieces)`` of each engine stage for pieces on ``stage_ranks`` (see the module docs).

    Args:
        stage_ranks: the rank of each torchplace stage, in plan order.
        world: the number of ranks.

    Returns:
        One entry per engine stage; engine stage ``k`` is on rank ``k % world``; their number is a
        multiple of ``world``; every rank has at least one.

    Raises:
        ValueError: for a rank outside ``[0, world)``.

    Example:
        >>> engine_layout([0, 1, 1, 0], 2)
        [(0, (0,)), (1, (1, 2)), (0, (3,)), (1, ())]
    """
    if world < 1 or any(not 0 <= r < world for r in stage_ranks):
        raise ValueError(f"stage ranks {list(stage_ranks)} must lie in [0, {world})")
    slots: list[tuple[int, tuple[int, ...]]] = []
    for piece, rank in enumerate(stage_ranks):
        if slots and slots[-1][0] == rank:
            slots[-1] = (rank, slots[-1][1] + (piece,))
            continue
        while len(slots) % world != rank:
            slots.append((len(slots) % world, ()))
        slots.append((rank, (piece,)))
    while not slots or len(slots) % world:
        slots.append((len(slots) % world, ()))
    return slots


def live_values(
    layout: Sequence[tuple[int, tuple[int, ...]]],
    stages: Sequence[StageModule],
    placeholders: Sequence[str],
    output_names: Sequence[str],
    order: Sequence[str],
) -> list[EngineSlot]:
    """The :class:`EngineSlot` s of ``layout``: what enters and leaves each engine stage.

    The first engine stage receives every model input (placeholder), as the engine hands it the
    arguments of ``schedule.step``; a value leaves engine stage ``k`` when it was made at or
    before ``k`` and a later engine stage or the model output reads it.

    Args:
        layout: from :func:`engine_layout`.
        stages: the torchplace stages (``inputs`` / ``outputs`` by value name).
        placeholders: the model's input names, in order.
        output_names: the names the model output reads.
        order: every value name in graph order (the order of each boundary's tuple).
    """
    made = {n: -1 for n in placeholders}
    last = {n: len(layout) for n in output_names}  # read by the output: carried to the end
    for k, (_, pieces) in enumerate(layout):
        for p in pieces:
            for n in stages[p].inputs:
                last[n] = max(last.get(n, -1), k)
            for n in stages[p].outputs:
                made[n] = k
    rank = {n: i for i, n in enumerate(order)}
    slots = []
    for k, (r, pieces) in enumerate(layout):
        entering = tuple(placeholders) if k == 0 else _crossing(made, last, k, rank)
        leaving = tuple(output_names) if k == len(layout) - 1 else _crossing(made, last, k + 1, rank)
        slots.append(EngineSlot(k, r, pieces, entering, leaving, last=k == len(layout) - 1))
    return slots


def computed_numbers(slots: Sequence[EngineSlot], stages: Sequence[StageModule],
                     examples: Mapping[str, Any]) -> list[EngineSlot]:
    """``slots`` with the Python numbers that cross between them computed by their readers.

    A number (``examples[name]``, a node's :func:`~torchplace.runtime.dist_numbers.example_of`, is
    a symbolic or plain ``int``, ``float`` or ``bool``, or a number of an fx graph) leaves no engine
    stage; each engine stage computes the numbers its pieces read, and that it does not make itself,
    from the sizes of the tensors it receives (:mod:`torchplace.runtime.dist_numbers`). The first
    stage receives the model inputs as they are.

    Raises:
        UnsupportedError: a number no received tensor's shape determines (any number of an fx graph
            that crosses engine stages), or one the model returns (the engine returns only tensors);
            before any communication.
    """
    numbers = {n for n, v in examples.items() if is_number(v)}
    out = []
    for k, slot in enumerate(slots):
        last = k == len(slots) - 1
        inputs = slot.inputs if k == 0 else tuple(n for n in slot.inputs if n not in numbers)
        outputs = slot.outputs if last else tuple(n for n in slot.outputs if n not in numbers)
        have, needed = set(inputs), []
        for piece in slot.pieces:
            needed += [n for n in stages[piece].inputs if n in numbers and n not in have and n not in needed]
            have.update(stages[piece].outputs)
        if last and numbers.intersection(outputs):
            raise UnsupportedError(_returned_number(sorted(numbers.intersection(outputs))[0]))
        rules = tuple(number_rule(n, examples[n], inputs, examples, slot.index) for n in needed)
        out.append(EngineSlot(slot.index, slot.rank, slot.pieces, inputs, outputs, rules, slot.last))
    return out


def _returned_number(name: str) -> str:
    return (f"the model returns {name!r}, a Python number, but torch.distributed.pipelining returns only tensors: "
            "return it as a tensor (torch.tensor(...)), or compute it outside the model")


def _crossing(made: Mapping[str, int], last: Mapping[str, int], k: int, rank: Mapping[str, int]) -> tuple[str, ...]:
    """The values made before engine stage ``k`` and read at or after it, in graph order."""
    return tuple(sorted((n for n, at in made.items() if at < k <= last.get(n, -1)), key=rank.__getitem__))


class EngineStage(nn.Module):
    """One engine stage as the engine wants it: flat tensors in, a flat tuple of tensors out.

    Args:
        slot: what it runs and which values enter and leave.
        pieces: the torchplace stages ``slot.pieces`` names (the model's own submodules).
        activity: the rank's :class:`Activity`, told which stage runs.
        constants: values of model inputs the engine does not send (those traced as ``None``), by name.
    """

    def __init__(self, slot: EngineSlot, pieces: Sequence[StageModule], activity: Activity | None = None,
                 constants: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.slot = slot
        self.constants = dict(constants or {})
        self.pieces = nn.ModuleList(pieces)
        self._activity = activity
        self.inferring = False  # set by the engine stage while the engine infers shapes
        self.fresh_outputs = False  # send copies: the zero-bubble backward detaches what it sent in place
        self._written: Any = None  # the buffers before the engine's shape inference ran
        self.random: RandomStream | None = None  # the stream its forward draws from (set by the pipeline)
        self.device = torch.device("cpu")  # where it makes the token it sends (set by the pipeline: the rank's)

    def forward(self, *flat: Any) -> tuple[torch.Tensor, ...]:
        slot = self.slot
        token = slot.index > 0
        if len(flat) != len(slot.inputs) + token:
            raise UsageError(f"engine stage {slot.index} takes {len(slot.inputs)} values ({list(slot.inputs)})"
                             f"{' and a gradient token' if token else ''}, got {len(flat)}")
        if not self.inferring:
            if self.random is None:
                return self._run(flat)
            with self.random.drawing():
                return self._run(flat)
        if self._activity is not None:
            self._activity.set(slot.index, "forward")
        return self._infer_shapes(flat)

    def _infer_shapes(self, flat: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        """The engine's shape inference: one more forward, outside any micro-batch, on uninitialised
        tensors after the first stage. It must leave no trace: the buffers it writes (a counter,
        batch norm's statistics, which garbage made NaN) are put back before the first micro-batch
        runs (:meth:`settle`; not at once: the engine's backward shape inference still reads what
        this forward saved), the random numbers it draws are drawn again, and its inputs are
        zeros, and ones for integers and booleans (token ids of garbage failed an embedding; an
        integer count of zero would fail a division)."""
        from torchplace.profiling.effects import StateSnapshot

        if self.slot.index > 0:  # the first stage's are the caller's own tensors
            with torch.no_grad():
                for t in flat:
                    if isinstance(t, torch.Tensor):  # ones where a count or an index may divide
                        t.fill_(0 if t.is_floating_point() or t.is_complex() else 1)
        cuda = sorted({t.device.index or 0 for t in flat if isinstance(t, torch.Tensor) and t.is_cuda})
        if self._written is None:
            self._written = StateSnapshot(self)
        with torch.random.fork_rng(devices=cuda):
            return self._run(flat)

    def settle(self) -> None:
        """Put back the buffers the engine's shape inference wrote (before a micro-batch runs)."""
        if self._written is not None:
            self._written.restore()
            self._written = None

    def _run(self, flat: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        slot = self.slot
        if slot.index > 0:  # the values, then the previous stage's token (module docs)
            *values, token = flat
            flat = _received(token, values)
        env = {**self.constants, **dict(zip(slot.inputs, flat))}
        env.update((rule.name, rule.value(flat)) for rule in slot.numbers)
        for piece in self.pieces:
            outputs = piece.forward(*(env[n] for n in piece.inputs))  # not piece(): fx prints the failing line
            env.update(zip(piece.outputs, outputs))
        received = {id(v) for v in flat}
        sent = tuple(_sendable(n, env[n], slot, self.fresh_outputs or id(env[n]) in received) for n in slot.outputs)
        return sent if slot.last else _as_tuple(_Sent.apply(self.device, *sent))


class _ScaledGrad(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``scale``: a model input that requires
    grad gets the gradient of the mean micro-batch loss, as the parameters do (the engine
    back-propagates each micro-batch's loss unscaled). Gradients an input already had are kept:
    autograd adds this step's to them."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _Sent(torch.autograd.Function):
    """The values an engine stage sends, then its token: zeros, one per value (module docs, 7).
    The token's gradient, which the next stage makes (:class:`_Received`) and the engine sends
    back, is 1 for each value that got a gradient there and 0 for each that got none (for which
    the engine sends zeros). The backward passes on the gradients flagged 1 and ``None`` for the
    others, so that what only those reach keeps ``.grad`` ``None``, as in the plain model; it reads
    the flags on the host (on CUDA a wait for the received flags, once per micro-batch: whether a
    gradient is ``None`` is decided there). The outputs are new tensors on the values' memory
    (``detach``), not views: the zero-bubble backward detaches them in place, which a view refuses."""

    @staticmethod
    def forward(ctx: Any, device: torch.device, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        out = tuple(v.detach() for v in values)
        ctx.mark_non_differentiable(*(o for o, needs in zip(out, ctx.needs_input_grad[1:]) if not needs))
        return (*out, torch.zeros(len(values), device=device))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        *grads, flags = grads
        return (None, *(g if reached else None for g, reached in zip(grads, flags.tolist())))


class _Received(torch.autograd.Function):
    """The values an engine stage received, whose backward makes the previous stage's token's
    gradient (:class:`_Sent`): 1 for each value a gradient reached, 0 for each it did not (autograd
    gives ``None`` there, with ``set_materialize_grads(False)``). Where no gradient reaches any
    value this backward never runs, and the engine sends zeros for the token: all 0, as it should.
    The gradients it passes on are contiguous: gloo sends only contiguous tensors (a transposed
    view's gradient is not)."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.device = token.device
        out = tuple(v.view_as(v) for v in values)
        ctx.mark_non_differentiable(*(o for o, needs in zip(out, ctx.needs_input_grad[1:]) if not needs))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        flags = torch.tensor([float(g is not None) for g in grads], device=ctx.device)
        return (flags, *(g.contiguous() if g is not None else None for g in grads))


def _received(token: torch.Tensor, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``values`` through :class:`_Received` where gradients may come back (training); else as they are."""
    if not (values and torch.is_grad_enabled() and token.requires_grad):
        return tuple(values)
    return _as_tuple(_Received.apply(token, *values))


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """An autograd Function's outputs as a tuple (``apply`` returns a single output as it is)."""
    return out if isinstance(out, tuple) else (out,)


def _sendable(name: str, value: Any, slot: EngineSlot, copy: bool) -> torch.Tensor:
    """``value`` as the engine can send it: a contiguous tensor that is not one of the stage's
    inputs. ``copy``: a copy (a carried value: the engine detaches outputs in place and makes inputs
    leaves, so an output must not be an input; and under the zero-bubble schedule every output, which
    its input-gradient pass detaches in place while the weight pass still needs what the stage saved).
    A view is copied too, which the zero-bubble backward cannot detach."""
    if not isinstance(value, torch.Tensor):
        raise UnsupportedError(
            f"value {name!r} leaves engine stage {slot.index} but is a {type(value).__name__}, not a tensor: "
            "torch.distributed.pipelining sends only tensors between stages; place so that this value does not "
            "cross a stage boundary (e.g. keep its producer and readers in one module with leaf_modules=...). "
            "If the model returns it, return it as a tensor: the engine returns only tensors"
        )
    if copy or value._is_view():
        return value.clone(memory_format=torch.contiguous_format)
    return value.contiguous()


def _stage_class() -> type:
    """``PipelineStage`` that tells an :class:`Activity` what it runs (imported lazily: importing
    torch.distributed.pipelining costs a second)."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):  # type: ignore[misc, valid-type]
        activity: Activity

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.activity.set(self.stage_index, "forward", fwd_chunk_id)
            self.submod.settle()
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self.submod.inferring = True  # the engine's shape inference (EngineStage._infer_shapes)
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                self.submod.inferring = False

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self.has_backward:  # GPipe calls it in inference too, where it does nothing
                self.activity.set(self.stage_index, "backward", bwd_chunk_id)
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.activity.set(self.stage_index, "weight backward", bwd_chunk_id)
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return _Stage


class DistributedPipeline:
    """This rank's part of a split model, run by ``torch.distributed.pipelining``.

    Every rank builds it from the same stages (the split is deterministic) after
    ``torch.distributed`` is initialised; each runs the engine stages of its own rank.

    Args:
        stages: the forward stages from :func:`~torchplace.runtime.split.split_stages`, in plan order.
        stage_ranks: the rank of each stage.
        graph_io: the :class:`~torchplace.runtime.graph_io.GraphIO` of the split model.
        order: every value name of the graph in graph order.
        rank, world: this process's rank and the number of ranks.
        device: this rank's torch device (``cuda:LOCAL_RANK`` or ``cpu``).
        microbatches: micro-batches per batch of this pipeline (the engine's ``n_microbatches``; with
            ``replicas``, per replica's share of the batch).
        schedule: one of :data:`SCHEDULES`.
        group: the process group (the default group if ``None``).
        faults: the rank's :class:`~torchplace.runtime.dist_faults.Faults` (fault reports; none: errors
            are raised as they are).
        free_others: move the tensors only other ranks' stages read to the meta device (frees their memory).
        replicas: this pipeline's place among data-parallel copies (``None``: the only one); then
            ``rank``, ``world`` and ``group`` are those of this rank's own pipeline.
        tensor_group: the process group of the ranks that run this rank's stages together, tensor
            parallel (:mod:`torchplace.runtime.dist_tensor`); ``None``: this rank alone.
        examples: each value's trace-time example by name
            (:func:`~torchplace.runtime.dist_numbers.example_of`): the Python numbers among them are
            computed by the engine stages that read them (:func:`computed_numbers`), or refused;
            without them, a number that crosses engine stages is refused when it is sent.
        nones: the model inputs traced as ``None`` (:attr:`torchplace.batchdim.CallSizes.nones`,
            checked ``None`` before a call): not sent; the stages bind ``None`` to them.

    Raises:
        UnsupportedError: a stage writes a model input in place (the caller's tensor lives on one
            rank only), ``schedule`` is not one the engine offers for this layout, or a Python
            number crosses engine stages and no tensor its reader receives determines it.
    """

    def __init__(self, stages: Sequence[StageModule], stage_ranks: Sequence[int], graph_io: Any,
                 order: Sequence[str], *, rank: int, world: int, device: torch.device, microbatches: int,
                 schedule: str = "1f1b", group: Any = None, faults: Any = None, free_others: bool = True,
                 replicas: Replicas | None = None, tensor_group: Any = None,
                 examples: Mapping[str, Any] | None = None, nones: Sequence[str] = ()) -> None:
        from torchplace.runtime.values import written_inputs

        if schedule not in SCHEDULES:
            raise UsageError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        written = sorted(written_inputs(stages, graph_io))
        if written:
            raise UnsupportedError(f"the model writes its input {written[0]!r} in place; across processes the caller's "
                                   "tensor is on one rank only: run it with torchplace.place (threads) instead")
        self.graph_io, self.rank, self.world, self.device = graph_io, rank, world, torch.device(device)
        self.microbatches, self.schedule, self.group, self.faults = microbatches, schedule, group, faults
        self.replicas, self.tensor_group = replicas, tensor_group
        self.broken: str | None = None
        """Why this placement runs no more calls (a call failed, or its groups were released), or ``None``."""
        self.fed = tuple(n for n in graph_io.placeholder_names if n not in set(nones))
        self.slots = computed_numbers(live_values(engine_layout(stage_ranks, world), stages,
                                                  self.fed, graph_io.output_names, order),
                                      stages, examples or {})
        if schedule == "zero-bubble":
            _check_zero_bubble(self.slots, self.fed)
        self.activity = faults.activity if faults is not None else Activity()
        self.modules = [EngineStage(s, [stages[p] for p in s.pieces], self.activity, dict.fromkeys(nones))
                        for s in self.slots if s.rank == rank]
        copy = replicas.index if replicas is not None else 0
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        for module in self.modules:
            module.fresh_outputs = schedule == "zero-bubble"
            module.random = RandomStream(module.slot.index, copy, cuda)
            module.device = self.device
        self.is_last = self.slots[-1].rank == rank
        self._place_tensors(stages, free_others)
        self._shared = _shared_across_ranks(self.slots, stages)
        self.read_by_several = _read_by_several(self.slots, stages)
        """The parameters several engine stages read (on any rank; the same objects or meta stand-ins
        on every rank): each engine stage back-propagates on its own, so a gradient hook on one
        would run on each stage's part of its gradient."""
        if tensor_group is not None:
            self._shard(stages, tensor_group)
        stage_class = _stage_class()
        self.engine_stages = []
        for module in self.modules:
            stage = stage_class(module, module.slot.index, len(self.slots), self.device, group=group)
            stage.activity = self.activity
            self.engine_stages.append(stage)
        self._schedules: dict[Any, Any] = {}
        self._shape: tuple[tuple[int, ...], ...] | None = None
        self._first_kinds: tuple[tuple[torch.dtype, ...], torch.dtype | None] | None = None
        self.written: list[torch.Tensor] = []
        """This rank's buffers the forward writes (the same on every copy), which ``replicas``
        make agree after every call; set by the caller, who knows their names."""
        self.check_call: Callable[[tuple[Any, ...], Mapping[str, Any], bool], None] | None = None
        """The caller's checks of a call's arguments, ``check_call(args, kwargs, training)``, run
        with this pipeline's own before a call starts (see :meth:`_agreement`); set by the caller."""
        self._calls = 0  # calls so far: every rank makes the same ones, in the same order

    # -- tensors -----------------------------------------------------------------------------------------
    def _place_tensors(self, stages: Sequence[StageModule], free_others: bool) -> None:
        """Move this rank's tensors to its device; with ``free_others``, the rest to the meta device."""
        mine = {id(t) for m in self.modules for t in _tensors(m)}
        for m in self.modules:
            for name, t in _named_tensors(m):
                move_in_place(t, self.device, name)
        self.freed: dict[int, torch.Tensor] = {}  # id of a tensor only other ranks read -> its meta stand-in
        if free_others:
            memo = self.freed
            for s in self.slots:
                for p in s.pieces if s.rank != self.rank else ():
                    for _, owner, kind, slot, t in _slots(stages[p]):
                        if id(t) not in mine:
                            getattr(owner, kind)[slot] = memo.setdefault(id(t), _on_meta(t))

    def _shard(self, stages: Sequence[StageModule], tensor_group: Any) -> None:
        """Split the linear pairs of this rank's stages over ``tensor_group`` (refuse a stage without any)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from torchplace.runtime.dist_tensor import linear_pairs, refuse_unsplit, shard_stage

        tensor = dist.get_world_size(tensor_group)
        calls = Counter(str(n.target) for s in stages for n in s.graph.nodes if n.op == "call_module")
        shared = {id(p) for p in self._shared}
        mesh = DeviceMesh.from_group(tensor_group, self.device.type)
        for module in self.modules:
            pieces = list(module.pieces)
            found = [(piece, [pair for pair in linear_pairs(piece, tensor, calls)
                              if not any(id(p) in shared for name in pair
                                         for p in piece.get_submodule(name).parameters())])
                     for piece in pieces]
            if pieces and not any(pairs for _, pairs in found):
                refuse_unsplit(module.slot.index, pieces, tensor)
            for piece, pairs in found:
                shard_stage(piece, pairs, mesh)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (the model's own objects, each once): give them to its optimizer."""
        return list({id(p): p for m in self.modules for p in m.parameters()}.values())

    def _sync_shared_grads(self) -> None:
        """Sum the gradients of parameters that stages on several ranks read (a tied weight), so each
        copy takes the gradient of all its uses; every rank takes part, in the same order. Which
        ranks hold a gradient is summed first: a parameter no use gave one keeps ``.grad`` ``None``,
        as in the plain model (a sum of zeros would be a gradient to the optimizer)."""
        import torch.distributed as dist

        mine = {id(p) for p in self.parameters()}
        held = [id(param) in mine and param.grad is not None for param in self._shared]
        holders = torch.tensor(held, dtype=torch.float32, device=self.device)
        dist.all_reduce(holders, group=self.group)
        for param, own, anyone in zip(self._shared, held, holders.tolist()):
            if not anyone:
                continue
            buffer = param.grad if own else torch.zeros(param.shape, dtype=param.dtype, device=self.device)
            dist.all_reduce(buffer, group=self.group)
            if id(param) in mine:
                param.grad = buffer

    # -- running -----------------------------------------------------------------------------------------
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for the batch ``(args, kwargs)``, split into micro-batches; returned on
        the rank of the last engine stage (``None`` elsewhere); with ``replicas``, the whole batch's
        on the last rank of every copy. Raises as :meth:`_agreement` says where a rank refuses the
        call, and :class:`DistributedError` where a rank fails while running it."""
        with self._agreement("run", args, kwargs):
            flat = self._inputs(args, kwargs)
            schedule = self._get_schedule(None)
        before = self._counters()
        self._start_streams()
        with torch.no_grad():
            out = self._guard(lambda: schedule.step(*flat))
        replicas = self.replicas
        if replicas is not None and self.is_last:
            values = out if isinstance(out, tuple) else (out,)
            out = tuple(self._guard(lambda: replicas.gather(values, self.slots[-1].outputs), agree=False))
        self._agree_buffers(before)
        return self._assemble(out) if self.is_last else None

    def step(self, *args: Any, target: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor],
             **kwargs: Any) -> list[torch.Tensor]:
        """One training step: forward and backward of every micro-batch by the schedule. The
        parameters' ``.grad`` accumulate the gradient of the mean micro-batch loss (this step's
        gradients are scaled by ``1 / microbatches`` here, once per parameter, then added to what
        earlier steps left; with ``replicas``, averaged over the copies: the mean over the whole
        batch's micro-batches). A model input that requires grad gets the gradient of that mean
        too, added to what it had. Returns each micro-batch's loss on the last rank (on the
        last rank of every copy, all copies' losses in batch order; ``[]`` elsewhere); call the
        rank's ``optimizer.step()`` after it. Raises as :meth:`run` does."""
        with self._agreement("step", args, kwargs):
            if not isinstance(target, torch.Tensor):
                raise UsageError(f"target must be a tensor (the engine splits it along dim 0), got "
                                 f"{type(target).__name__}")
            if not callable(loss_fn):
                raise UsageError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
            flat = self._inputs(args, kwargs)
            rows = self._shape[0][0] if self._shape else None
            if rows is not None and (target.dim() == 0 or target.shape[0] != rows):
                have = target.shape[0] if target.dim() else "no"
                raise UsageError(f"target has {have} rows where the inputs have {rows}: the engine splits the target "
                                 "along dim 0 as it splits the batch; pass one row per sample")
            schedule = self._get_schedule(loss_fn)
        copies = self.replicas.count if self.replicas is not None else 1
        flat = tuple(_ScaledGrad.apply(t, 1 / (self.microbatches * copies)) if t.requires_grad else t for t in flat)
        losses: list[torch.Tensor] = []
        target = self._share_of(target)
        target = target.to(self.device) if self.is_last else target
        params = self.parameters()
        counters = self._counters()
        self._start_streams()
        before = [p.grad for p in params]  # what earlier steps accumulated, set aside: this step's alone
        for p in params:
            p.grad = None
        try:
            # return_outputs=False: a step returns the losses; the engine's joining of the micro-batches'
            # outputs refused one that is a reduction (a loss the model computes from labels=)
            self._guard(lambda: schedule.step(*flat, target=target, losses=losses, return_outputs=False))
            if self._shared:
                self._guard(self._sync_shared_grads)
        except BaseException:
            for p, had in zip(params, before):  # a failed step adds nothing
                p.grad = had
            raise
        for p, had in zip(params, before):  # the mean micro-batch loss's, added to what was there
            if p.grad is None:
                p.grad = had
            elif had is not None:
                p.grad = had.add_(p.grad.div_(self.microbatches))
            else:
                p.grad.div_(self.microbatches)
        replicas = self.replicas
        if replicas is None:
            return [loss.detach() for loss in losses]
        self._guard(lambda: replicas.average_grads(self.parameters()))
        self._agree_buffers(counters)
        if not self.is_last:
            return []
        gathered = self._guard(lambda: replicas.gather([torch.stack([loss.detach() for loss in losses])]), agree=False)
        return list(gathered[0])

    @contextlib.contextmanager
    def _agreement(self, kind: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[None]:
        """Run a call's checks (the caller's :attr:`check_call`, then the ``with`` block) on every
        rank, then agree whether the call (``kind``: ``"run"`` or ``"step"``) runs.

        Every rank checks its own arguments, and they may differ (a script that passes rank-specific
        targets): a rank that refused alone would leave the others blocked in the engine until the
        process group's timeout, with an error that never names the cause. So after the checks,
        one all-reduce over all the launch's ranks counts the refusals: a refusing rank first writes
        its reason to the rendezvous store, then raises its own error; every other rank raises
        :class:`DistributedError` naming it. No rank has run anything, no fault is published, and
        the placement stays usable for the next call. What the checks recorded of the call
        (the batch shape and dtypes the engine will size its buffers by) is put back. Ranks that
        make different calls (``run`` on one, ``step`` on another), or pass batches of different
        shapes or dtypes (each rank would size its buffers by its own), all raise too.

        Raises:
            UsageError, UnsupportedError: this rank's checks refuse the call.
            DistributedError: another rank refused it, made the other call or passed a batch of
                other shapes or dtypes; or this placement can run no more calls (:attr:`broken`).
        """
        if self.broken is not None:
            raise DistributedError(f"{self.broken}: place the model again (a new placement starts clean)")
        saved = (self._shape, self._first_kinds)
        try:
            if self.check_call is not None:
                self.check_call(args, kwargs, kind == "step")
            yield
        except Exception as error:
            self._shape, self._first_kinds = saved
            self._vote(error, kind)
            raise
        try:
            self._vote(None, kind)
        except DistributedError:
            self._shape, self._first_kinds = saved
            raise

    def _vote(self, refusal: BaseException | None, kind: str) -> None:
        """Tell every rank whether this one refuses the call, and which call (``"run"`` or
        ``"step"``) it makes; raise where another rank refused, or made the other call."""
        import torch.distributed as dist

        faults = self.faults
        if faults is None:  # one process: nothing to agree with
            return
        self._calls += 1
        key = f"{faults.key}/refused/{self._calls}"
        if refusal is not None:
            faults.store.set(f"{key}/{faults.rank}", f"{type(refusal).__name__}: {first_line(refusal)}")
        batch = self._batch_text() if refusal is None else ""
        votes = torch.zeros(3, faults.world, dtype=torch.int32, device=self.device)
        votes[0, faults.rank] = int(refusal is not None)
        votes[1, faults.rank] = ("run", "step").index(kind) + 1  # every rank must make the same call
        votes[2, faults.rank] = zlib.crc32(batch.encode()) & 0x7FFFFFFF  # ... with the same batch shape
        faults.guard(lambda: dist.all_reduce(votes))  # over every rank of the launch: copies too
        refused = [r for r, v in enumerate(votes[0].tolist()) if v]
        kinds = [("run", "step")[k - 1] for k in votes[1].tolist()]
        if refusal is None and not refused and len(set(kinds)) > 1:
            calls = ", ".join(f"rank {r} {k}()" for r, k in enumerate(kinds))
            raise DistributedError(f"the ranks made different calls ({calls}): every rank must call run() or every "
                                   "rank step(), in the same order; no rank ran it")
        if refusal is None and not refused and len(set(votes[2].tolist())) > 1:
            faults.store.set(f"{key}/batch/{faults.rank}", batch)  # every rank saw the same votes: each tells its own
            batches = [faults.store.get(f"{key}/batch/{r}").decode() for r in range(faults.world)]
            told = "; ".join(f"rank {r}: {b}" for r, b in enumerate(batches))
            raise DistributedError(f"the ranks passed batches of different shapes or dtypes ({told}): the engine "
                                   "sizes each rank's buffers by its own batch, so pass every rank the same batch; "
                                   "no rank ran it")
        if refusal is not None or not refused:
            return
        reason = faults.store.get(f"{key}/{refused[0]}").decode()
        more = f" (and {len(refused) - 1} more rank(s))" if len(refused) > 1 else ""
        raise DistributedError(f"rank {refused[0]}{more} refused this call before any rank ran it: {reason}; "
                               f"rank {faults.rank} did not run it either")

    def _batch_text(self) -> str:
        """The shapes and dtypes this call's checks recorded (what the engine sizes its buffers by)."""
        if self._shape is None or self._first_kinds is None:
            return "no batch"
        return f"inputs of shapes {list(self._shape)}, dtypes {_kinds_text(self._first_kinds)}"

    def check_schedule(self, fallback: str | None = None) -> str | None:
        """Build the training schedule now, so that a schedule the engine refuses for this layout
        and micro-batch count (``Schedule1F1B`` needs at least one micro-batch per engine stage, the
        interleaved ones a count that is a multiple of ``max(1, m // ranks)``) is refused when
        placing, not at the first ``step``; or, with ``fallback`` (the schedule was not passed to
        ``place``), run ``fallback`` instead and return why the engine refused the first (``None``
        where it runs it). The caller re-counts the plan's memory for the fallback. Building one
        communicates nothing.

        Raises:
            UnsupportedError: the engine refuses the schedule (and ``fallback``, if given).
        """
        def nothing(output: Any, target: Any) -> torch.Tensor:
            raise AssertionError("a schedule built to check it computes no loss")

        try:
            self._make_schedule(nothing)
        except UnsupportedError as error:
            if fallback is None or fallback == self.schedule:
                raise
            self.schedule = fallback
            self._make_schedule(nothing)
            return str(error).removesuffix("; pick another schedule or micro-batch count")
        return None

    def _start_streams(self) -> None:
        """Start this call's random streams (:mod:`~torchplace.runtime.dist_random`): one seed drawn
        from the default generator, mixed with each engine stage's index and this copy's."""
        seed = call_seed()
        for module in self.modules:
            if module.random is not None:
                module.random.start(seed)

    def _counters(self) -> list[torch.Tensor | None]:
        """With replicas, the integer buffers of :attr:`written` as they are before a call (a copy;
        ``None`` for the others): :meth:`Replicas.agree_buffers` adds every copy's increment."""
        if self.replicas is None:
            return []
        return [b.clone() if not (b.is_floating_point() or b.is_complex() or b.dtype == torch.bool) else None
                for b in self.written]

    def _agree_buffers(self, before: Sequence[torch.Tensor | None]) -> None:
        """With replicas, make the copies' written buffers agree after a call
        (:meth:`Replicas.agree_buffers <torchplace.runtime.dist_replicas.Replicas.agree_buffers>`)."""
        replicas = self.replicas
        if replicas is not None and self.written:
            self._guard(lambda: replicas.agree_buffers(self.written, before), agree=False)

    def _inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        bound = self.graph_io.bind_inputs(args, kwargs)
        flat = tuple(bound[n] for n in self.fed)
        for name, value in zip(self.fed, flat):
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != flat[0].shape[0]:
                what = (type(value).__name__ if not isinstance(value, torch.Tensor) else
                        "a tensor with no batch dimension" if value.dim() == 0 else
                        f"a tensor of {value.shape[0]} rows where {self.fed[0]!r} has "
                        f"{flat[0].shape[0]}")
                raise UnsupportedError(f"model input {name!r} is {what}: the engine splits every input along dim 0 "
                                       "into the micro-batches; pass batched tensors only (the same rows each), and "
                                       "keep other values in the model (a buffer)")
        shape = tuple(tuple(t.shape) for t in flat)
        if self._shape is not None and shape != self._shape:
            raise UsageError(f"inputs of shapes {list(shape)}, but this pipeline ran with {list(self._shape)}: the "
                             "engine sizes its buffers on the first call; call with the same batch shape")
        kinds = self._kinds(flat)
        if self._first_kinds is not None and kinds != self._first_kinds:
            raise UsageError(f"inputs of dtypes {_kinds_text(kinds)}, but this pipeline first ran with "
                             f"{_kinds_text(self._first_kinds)}: the engine sizes its buffers, dtypes included, on the "
                             "first call, and would receive the values of this one into them; call with the first "
                             "call's dtypes and autocast state, or place the model again for these")
        self._first_kinds = kinds
        copies = self.replicas.count if self.replicas is not None else 1
        if flat and flat[0].shape[0] % (copies * self.microbatches):
            split = f"{copies} replicas x {self.microbatches}" if copies > 1 else f"{self.microbatches}"
            raise UsageError(f"a batch of {flat[0].shape[0]} does not split into {split} equal micro-batches; "
                             f"use a batch size that is a multiple of {copies * self.microbatches}")
        self._shape = shape
        flat = tuple(self._share_of(t) for t in flat)
        return tuple(t.to(self.device) for t in flat) if self.slots[0].rank == self.rank else flat

    def _kinds(self, flat: Sequence[torch.Tensor]) -> tuple[tuple[torch.dtype, ...], torch.dtype | None]:
        """What besides shapes fixes the dtypes the stages send: the inputs' dtypes and the autocast
        dtype on this rank's device type (``None`` when autocast is off). Every rank gets the same
        inputs under the same autocast (the same script), so every rank decides alike."""
        kind = self.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return tuple(t.dtype for t in flat), cast

    def _share_of(self, batch: torch.Tensor) -> torch.Tensor:
        return batch if self.replicas is None else self.replicas.share(batch)

    def _assemble(self, out: Any) -> Any:
        values = out if isinstance(out, tuple) else (out,)
        return self.graph_io(dict(zip(self.slots[-1].outputs, values)))

    def _get_schedule(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Any:
        key = None if loss_fn is None else id(loss_fn)
        if key not in self._schedules:
            self._schedules = {k: v for k, v in self._schedules.items() if k is None}  # one training schedule
            self._schedules[key] = self._make_schedule(loss_fn)
        return self._schedules[key]

    def _make_schedule(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Any:
        from torch.distributed.pipelining import schedules as engine

        multi = len(self.modules) > 1
        name = self.schedule if loss_fn is not None else "gpipe"
        classes = {"gpipe": engine.ScheduleLoopedBFS if multi else engine.ScheduleGPipe,
                   "1f1b": engine.ScheduleInterleaved1F1B if multi else engine.Schedule1F1B,
                   "looped-bfs": engine.ScheduleLoopedBFS, "interleaved-1f1b": engine.ScheduleInterleaved1F1B,
                   "zero-bubble": engine.ScheduleInterleavedZeroBubble}
        cls = classes[name]
        wrapped = None if loss_fn is None else _LossOnOutput(loss_fn, self)
        single = issubclass(cls, engine.PipelineScheduleSingle)
        try:  # the gradients are scaled in step(), once per parameter: the engine scales each stage's
            # .grad, so a parameter two engine stages of a rank read was scaled twice, and what an
            # earlier step accumulated once more
            return cls(self.engine_stages[0] if single else self.engine_stages, self.microbatches, loss_fn=wrapped,
                       scale_grads=False, output_merge_spec=self._merge_spec())
        except (ValueError, RuntimeError) as e:
            raise UnsupportedError(f"torch.distributed.pipelining refuses schedule {name!r} ({cls.__name__}) for "
                                   f"{len(self.slots)} engine stages on {self.world} ranks and {self.microbatches} "
                                   f"micro-batches: {str(e).rstrip('.')}; pick another schedule or micro-batch "
                                   "count") from e

    def _merge_spec(self) -> tuple[Any, ...] | None:
        """The engine's ``output_merge_spec``: with one micro-batch, its outputs as they are (the
        engine's default joins the micro-batches' outputs with ``torch.cat``, which refuses a
        zero-dimensional one, a reduction the model returns); else the default, dim 0."""
        return tuple(_AS_IS for _ in self.slots[-1].outputs) if self.microbatches == 1 else None

    def _guard(self, fn: Callable[[], Any], agree: bool = True) -> Any:
        """``fn()`` (a schedule step), then every rank of the pipeline agrees that all its ranks
        finished it: a rank whose part ended before a peer failed learns of the failure here instead
        of leaving quietly. ``agree=False`` for a collective only some ranks call (a replicas' gather)."""
        if self.faults is None:
            return fn()
        try:
            out = self.faults.guard(fn)
            if agree:
                self.faults.guard(self._agree)
        except DistributedError as error:
            self._abandon(error)
            raise
        return out

    def _abandon(self, error: DistributedError) -> None:
        """After a failed call: refuse every later call of this placement (its ranks are out of
        step), and release its groups at the next chance (:func:`release_abandoned`)."""
        self.broken = f"an earlier call of this placement failed ({error}), which left its ranks out of step"
        _ABANDONED.add(self)

    def release(self) -> None:
        """Destroy this placement's own process groups (not the default one) and drop what holds
        them. After a failed call this closes their connections, so a peer still blocked in a
        receive from this rank gets the backend's error at once (and raises the published fault)
        instead of waiting for its watchdog to end its process; and no send or receive the failed
        run left posted can pair with a later placement's messages. The failure's exception, if the
        script keeps it, holds the engine's stages in its frames: their groups are dropped too.
        Later calls are refused (:attr:`broken`)."""
        import gc

        import torch.distributed as dist

        _ABANDONED.discard(self)
        self.broken = self.broken or "this placement's process groups were released"
        groups = self._groups()
        self.group = self.tensor_group = None
        if self.replicas is not None:
            self.replicas.group = None
        for stage in self.engine_stages:  # a live exception's frames may still hold a stage: not its group
            stage.group = None
        self._schedules.clear()  # the engine's schedules hold its stages and pending work
        self.engine_stages = []
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a group the failure already took down
                pass
        del groups
        gc.collect()  # the groups close their connections when the last reference goes

    def _groups(self) -> list[Any]:
        """This placement's own process groups (not the default one, which outlives it)."""
        import torch.distributed as dist

        found = (self.group, self.tensor_group, self.replicas.group if self.replicas is not None else None)
        return list(dict.fromkeys(g for g in found if g is not None and g is not dist.GroupMember.WORLD))

    def _agree(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)


_ABANDONED: weakref.WeakSet[DistributedPipeline] = weakref.WeakSet()
"""Pipelines of this process whose call failed and whose groups are not released yet."""


def release_abandoned() -> None:
    """Release the process groups of every pipeline of this process whose call failed
    (:meth:`DistributedPipeline.release`): a new placement does so first, so a peer blocked on
    this rank in the failed one is freed even where the script never closed it."""
    for pipeline in list(_ABANDONED):
        pipeline.release()


class _AsIs:
    """An ``output_merge_spec`` entry that is no chunk spec: the engine takes the first (here the
    only) micro-batch's value as it is."""

    def __repr__(self) -> str:
        return "as-is"


_AS_IS = _AsIs()


class _LossOnOutput:
    """The user's ``loss_fn(output, target)`` on the model's output, rebuilt from the last engine
    stage's tuple (the engine calls the loss with that tuple)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], pipeline: DistributedPipeline) -> None:
        self.loss_fn, self.pipeline = loss_fn, pipeline

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(self.pipeline._assemble(output), target)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        return loss


def _kinds_text(kinds: tuple[tuple[torch.dtype, ...], torch.dtype | None]) -> str:
    dtypes, cast = kinds
    return f"{[str(d).removeprefix('torch.') for d in dtypes]} " + (
        f"under autocast to {str(cast).removeprefix('torch.')}" if cast is not None else "without autocast")


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype holding no memory (a Parameter stays a Parameter)."""
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module``, each object once."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        seen.setdefault(id(t), (name, t))
    return list(seen.values())


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _named_tensors(module)]


def _shared_across_ranks(slots: Sequence[EngineSlot], stages: Sequence[StageModule]) -> list[nn.Parameter]:
    """The parameters that require grad and are read by stages on several ranks, in slot order (the
    same order on every rank: each rank splits its own copy of the model alike)."""
    ranks: dict[int, set[int]] = {}
    first: dict[int, nn.Parameter] = {}
    for s in slots:
        for p in s.pieces:
            for param in stages[p].parameters():
                ranks.setdefault(id(param), set()).add(s.rank)
                first.setdefault(id(param), param)
    return [param for pid, param in first.items() if len(ranks[pid]) > 1 and param.requires_grad]


def _read_by_several(slots: Sequence[EngineSlot], stages: Sequence[StageModule]) -> list[nn.Parameter]:
    """The parameters that require grad and are read by several engine stages, in slot order."""
    readers: dict[int, set[int]] = {}
    first: dict[int, nn.Parameter] = {}
    for s in slots:
        for p in s.pieces:
            for param in stages[p].parameters():
                readers.setdefault(id(param), set()).add(s.index)
                first.setdefault(id(param), param)
    return [param for pid, param in first.items() if len(readers[pid]) > 1 and param.requires_grad]
