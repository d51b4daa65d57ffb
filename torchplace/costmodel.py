"""The one cost model: what a stage costs, and what a whole placement costs.

Every solver's reported objective is :func:`evaluate` of its plan; nothing else in torchplace says
what a placement costs.

Throughput (Tarnawski et al. 2020, Sec. 3 and App. C, eq. (20)-(21); Archer et al. 2024, Sec. 2.2):
the load of device ``d`` holding node set ``S`` is

    load(S, d) = sum_{v in S} p_v(d)                         compute
               + sum_{u not in S, u -> v, v in S} c_u        incoming transfers
               + sum_{u in S, u -> v, v not in S} c_u        outgoing transfers

where each producer ``u`` is counted once per side however many consumers it has, and a CPU
device pays no transfer (it reads host memory directly). The objective is the max load over
devices: the time per sample of a pipeline in steady state (Tarnawski Sec. 5.1).
A device holding several stages (non-contiguous splits) is charged for the union of its nodes.

Memory of a device is its parameters and buffers ``sum_{v in S} param_bytes_v``, plus a copy of
every tensor that nodes in ``S`` read but whose owner (the node charged for it) is elsewhere, plus
its working memory. In a graph without liveness (the published workloads) working memory is
``sum_{v in S} temp_bytes_v``. In a profiled graph (``graph.meta["liveness"]``) it is the *liveness
peak* (:func:`working_memory`), what ``max_memory`` means to accelerate users: the device runs its
nodes in topological order, one micro-batch (``1/m`` of the example batch, ``m`` =
``Pipeline.microbatches``; every tensor rounded up) at a time; a node's output lives from the node
until its last reader on the device, or to the end of the device's pass when another device or the
model's output reads it (a node whose outputs are several memories,
:attr:`NodeRecord.resident_parts`, frees each after the last reader of that memory,
:attr:`NodeRecord.reads`, and sends on only the memories another device reads); a tensor from
another device lives from the start of the pass to its last reader (only on devices that pay
transfers: logical CPUs read host memory in place); a view
(``graph.meta["aliases"]``, found at trace time; ``graph.meta["part_aliases"]`` for one output of
a node with others) takes no memory of its own and keeps the tensor it views alive as long as it
is read, and a node's outputs hold the memory they were made in
(:attr:`NodeRecord.resident`: an ``expand`` is no bigger than what it expands); while a node runs it holds its own peak
(:attr:`NodeRecord.own_peak`, new memory only) on top of what is alive. Inference devices hold
one micro-batch's activations at a time (a device finishes a micro-batch before it starts the
next), except what it has sent on: the model's outputs it makes stay until the call returns (an
output that is a view, with the memory it views), so it holds the other ``m - 1`` micro-batches'
on top of its peak, and the tensors it sends to
another device stay until that device is done with them, so it holds those of :func:`queued`
micro-batches.

A problem on a coarsened graph (``Problem.coarsened``, :mod:`torchplace.fusion`) charges each device
the original graph's liveness memory of its nodes' members: a merged record cannot say when each
member's output dies, and the coarse plan is checked against that memory once expanded.

Solvers whose memory is a sum over nodes stay exact, and their bounds proofs, through
:mod:`torchplace.solvers.liveness`: a *relaxation* (parameters only: never above the liveness
memory, so its lower bound holds), then the relaxation again with room reserved for the working
memory its plans needed, and last a *restriction* whose per-node bytes ``ceil(temp_v/m) +
sum_{u -> v} ceil(out_u/m)`` (``+ (m - 1) ceil(out_v/m)`` for a model output, ``+ queued(m, most_hops)
ceil(out_v/m)`` for a node with readers, which may be elsewhere; ``out_v`` at least what it holds,
``resident``; in training ``2m`` sends, ``m`` times each received value's bytes for the gradients
sent back, and on a model output the loss, ``m`` of the outputs' gradients and a recomputed
copy: :func:`torchplace.solvers.liveness.conservative`) are never below it
(every tensor alive at a moment is an output of a node of ``S``, at most its ``temp``, or a
received one, counted at one of its readers), so its plans always fit. Solvers called directly
(not through :func:`torchplace.solvers.solve`) see ``temp_bytes`` sums: their plans are checked
with the liveness memory, but an optimality claim of theirs holds only where memory does not bind.
Plans are validated, and reported, with the liveness memory.

In training, working memory is one micro-batch's. With liveness it is the larger of two peaks,
because a worker runs one micro-batch's forward or one's backward at a time, never both:
- the forward pass's: its liveness peak with what its nodes saved for backward so far alive too
  (an edge from a forward node to its backward node keeps nothing alive in the walk; each node's
  ``saved_bytes`` is, from the node on), less the micro-batch's saved activations, which the
  activations below count. A saved tensor that later nodes still read is counted twice, so this
  stays an upper bound; adding the whole pass's saved bytes to the forward peak over-counted
  more (1.2-1.4x on first stages, ``benchmarks/memory_fidelity.py --training``). A tensor several
  nodes save (``saved_parts``: the layer norm's output the three attention projections save, a
  ReLU's output saved by the ReLU and the next linear) is kept once on a device
  (:func:`saved_union`), from the first node that saves it;
- the backward pass's: the larger of the walk :func:`backward_peak` (the forward nodes in reverse:
  this micro-batch's sent values and model outputs held to the end, each gradient alive from the
  first reader's backward to its node's, each node's saved tensors freed after its backward, its
  own peak while it runs; less the saved activations, which the activations count) and the
  gradient of the model outputs it makes plus the larger of the largest backward node's own peak
  and, on a device making model outputs, the loss's bytes (``graph.meta["loss_bytes"]``,
  :mod:`torchplace.profiling.loss`: what the loss and its backward hold beyond the outputs, its
  gradient of them included).
The other micro-batches in flight (below) keep their model outputs and sent tensors on the device
until their backward (the executor forgets a stage's values then), where inference holds ``m - 1``
outputs and :func:`queued` sends, and the gradients of theirs that wait across devices
(:func:`waiting_gradients`: on a CPU those it sent back, until the producer's backward; on an
accelerator those that arrived, until its own), as many as the schedule lets wait
(:func:`upstream_in_flight`), and the gradients the loss made of their outputs. A CPU reads
other devices' values where they are, so a value of theirs it saves for backward costs it
nothing (``in_place`` in :func:`saved_union`). A value a device sends on and also saves is one
storage: the walks hold it as sent, the activations count it. A recomputing device runs its
forward again in the backward, a second copy of what it sends beside the one it holds. A copy of a
trainable shared tensor has its gradient on the device too. Without liveness it is the sum of
``temp_bytes`` over ``m``. A training graph profiled from a model carries a
:class:`~torchplace.problem.Pipeline`, and the activations kept for backward (``saved_bytes``)
count once per micro-batch the device holds in flight (all ``m`` under GPipe; ``min(m, S - j)``
at pipeline position ``j`` of ``S`` under 1F1B), or, on a device that recomputes, only its stage
inputs do (on a CPU, none: they are other devices' values), while its forward compute counts
twice (:func:`memory`, :func:`in_flight`).

Piper (Tarnawski, Narayanan, Phanishayee 2021, Sec. 3-4, App. A-B), when the problem has a
:class:`~torchplace.problem.Parallel` setting: a stage ``S`` runs on ``d * t`` devices (``d``
data-parallel replicas of a ``t``-way tensor split), each node ``v`` in the TMPC ``X(v)`` chosen for
it among ``v``'s configurations for ``t``, and its time per sample is

    TPS(S) = (1/d) sum_{v in S} X(v).p                                       compute
           + (1/(d B)) [ sum_{(u,v) into S} 2 (c(u,v) + X(v).c^fw(u,v))      edges in
                       + sum_{(v,w) out of S} 2 (c(v,w) + X(v).c^bw(v,w)) ]  edges out
           + (1/B) sum_{v in S} 4 (d-1)/d X(v).w / N                          all-reduce

with ``B`` the bandwidth and ``N`` the micro-batches per batch (the weights are all-reduced once per
batch, as in the authors' code; Sec. 3.4 writes the same per ``d`` micro-batches). Its memory per
device is ``sum_{v in S} X(v).a * ceil(s/d) + X(v).b`` where ``s`` is the sum of the data-parallel
degrees of ``S`` and every later stage (the micro-batches in flight, App. A). The objective is the
max over stages (:func:`piper_stage`).

Latency (MOIRAI Sec. III-D, eqs. (4a)-(8); Baechi Sec. 4.2): one sample runs through
:func:`simulate`. A plan is a sequence of stages, and its *plan order* lists the nodes stage by
stage, topologically inside a stage (a topological order of the graph, since every edge goes to
the same or a later stage). Every resource serves its work in plan order:

- a device runs its nodes one at a time in plan order; a node starts when the device has finished
  the node before it and every input has arrived;
- an output crossing to another device is one transfer per (producer, destination device) of
  :meth:`Problem.link_time` seconds. It holds the sender's out-port and the receiver's in-port
  (MOIRAI's congestion constraints (8)), and each port serves its transfers in the plan order of
  their producers, one producer's in destination name order. A transfer starts when its producer
  has finished and both ports have served every transfer before it; a 0-s transfer (CPU to CPU)
  holds no port.

This is the order a runtime issues work in; it is also what makes the MOIRAI MILP exact: its
optimum equals the best simulated plan (:mod:`torchplace.solvers.milp.moirai`). The objective is
the makespan.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, TypedDict

from torchplace.devices import Device
from torchplace.graph import TMPC, NodeRecord, OpGraph, SharedTensor, saved_producer, union_of_saved
from torchplace.problem import Problem

__all__ = [
    "Schedule",
    "StageCost",
    "StageLike",
    "Transfer",
    "backward_peak",
    "copy_bytes",
    "device_cost",
    "MEMORY_KINDS",
    "device_memory",
    "device_memory_parts",
    "evaluate",
    "in_flight",
    "upstream_in_flight",
    "waiting_gradients",
    "weight_gradient_bytes",
    "evaluate_stages",
    "uses_liveness",
    "working_memory",
    "memory",
    "memory_elsewhere",
    "memory_parts",
    "piper_resync_bytes",
    "piper_stage",
    "plan_order",
    "plan_segments",
    "most_hops",
    "queued",
    "QUEUE_SIZE",
    "saved_increments",
    "saved_parts",
    "saved_union",
    "simulate",
    "stage_costs",
    "stage_input_bytes",
    "training_stage_times",
    "transfers",
]


class StageLike(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def nodes(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class StageCost:
    """Cost breakdown of the node set one device holds (see the module docstring)."""

    device: str
    ops: int
    compute: float
    transfer_in: float
    transfer_out: float
    memory: int
    allreduce: float = 0.0

    @property
    def load(self) -> float:
        return self.compute + self.transfer_in + self.transfer_out + self.allreduce


def transfers(problem: Problem, nodes: Collection[str]) -> tuple[float, float]:
    """(incoming, outgoing) transfer seconds of node set ``nodes``, each producer counted once."""
    members = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
    g = problem.graph
    incoming: set[str] = set()
    outgoing = 0.0
    for v in members:
        for u in g.predecessors(v):
            if u not in members:
                incoming.add(u)
        if any(w not in members for w in g.successors(v)):
            outgoing += problem.transfer_time(v)
    return math.fsum(problem.transfer_time(u) for u in sorted(incoming)), outgoing


def uses_liveness(problem: Problem) -> bool:
    """Whether a device's working memory is the liveness peak (:func:`working_memory`): a problem
    on a profiled graph (``graph.meta["liveness"]``), inference or training (not Piper's)."""
    return bool(problem.graph.meta.get("liveness")) and problem.parallel is None


def microbatches(problem: Problem) -> int:
    """``m``: the micro-batches each call is split into (``Problem.pipeline``; 1 without one)."""
    return problem.pipeline.microbatches if problem.pipeline is not None else 1


def working_memory(problem: Problem, nodes: Iterable[str], device: Device | None = None, *,
                   others: int | None = None, saves: Mapping[str, int] | None = None,
                   segments: Mapping[str, int] | None = None) -> int:
    """The liveness peak of ``nodes`` on ``device`` for one micro-batch (module docstring).

    The nodes run in the graph's topological order. ``device=None`` counts received tensors (as an
    accelerator does); a device that pays no transfer (a CPU) reads them where they are.
    ``others``: the other micro-batches whose model outputs and sent tensors the device holds
    meanwhile; ``None`` is inference's ``m - 1`` outputs (the call returns them all) and
    :func:`queued` sent tensors. ``saves`` (a training forward pass): bytes each node keeps for its
    backward (:func:`saved_increments`), alive from the node to the end of the pass, in the peak too.
    ``segments``: the plan's segment of each node (:func:`plan_segments`), which says how far each
    sent tensor travels, so how many micro-batches may hold it (:func:`queued`); ``None``: any
    distance a plan of the problem allows (a contiguous one has a segment per device at most).

    Example: a chain ``a -> b -> c`` of 4-byte outputs (own peak = output) needs 8 bytes: ``b``'s
    output is made while ``a``'s is still read; ``a``'s dies before ``c`` runs.
    """
    walk = _walk(problem, _layout(problem.graph, nodes, segments), device, saves)
    return walk.total(microbatches(problem), others, most_hops(problem))


def most_hops(problem: Problem) -> int | None:
    """The most segment boundaries a value may cross in a plan of ``problem``: one fewer than the
    devices where each holds one contiguous piece, ``None`` (any) where a device may hold several."""
    return len(problem.cluster.devices) - 1 if problem.contiguous else None


class _Layout(NamedTuple):
    """What both walks of a device's nodes start from: the members in topological order, their
    memories (:func:`_memories`), and those kept to the end of a pass (:func:`_kept_to_end`), the
    sent ones with the segment boundaries they cross."""

    members: Collection[str]
    order: list[str]
    memories: Memories
    held: set[Memory]
    sent: Mapping[Memory, int | None]


def _layout(g: OpGraph, nodes: Iterable[str], segments: Mapping[str, int] | None = None) -> _Layout:
    members = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
    order = [v for v in g.topological_order() if v in members]
    memories = _memories(g, members, order)
    return _Layout(members, order, memories, *_kept_to_end(g, members, memories, order, segments))


def _walk(problem: Problem, nodes: Iterable[str] | _Layout, device: Device | None,
          saves: Mapping[str, int] | None) -> _Working:
    """:func:`working_memory` before the other micro-batches are added (``nodes`` or their
    :class:`_Layout`, where the caller has it)."""
    g = problem.graph
    members, order, memories, held, sent = nodes if isinstance(nodes, _Layout) else _layout(g, nodes)
    m = microbatches(problem)
    end = len(order)
    last: dict[Memory, int] = {}
    for i, v in enumerate(order):
        for u in g.predecessors(v):
            for key in _kept(g, memories, u, v):
                last[key] = max(last.get(key, -1), i)
    for key in held | sent.keys():
        last[key] = end
    receives = device is None or device.pays_transfer
    frees: dict[int, int] = defaultdict(int)
    live = 0
    for (u, part), i in last.items():
        if u not in members and receives:  # a received copy: what was moved
            live += _per_microbatch(g.record(u).output_bytes, m)
            frees[i] += _per_microbatch(g.record(u).output_bytes, m)
    peak = live
    for i, v in enumerate(order):
        r = g.record(v)
        peak = max(peak, live + _per_microbatch(r.own_peak, m))
        for part, nbytes in _parts(r).items():  # its own memories (a view's part is never read as one)
            if last.get((v, part), -1) > i:
                live += _per_microbatch(nbytes, m)
                frees[last[v, part]] += _per_microbatch(nbytes, m)
        live += (saves or {}).get(v, 0)
        live -= frees.pop(i, 0)
    peak = max(peak, live)
    holding = sum(_memory_bytes(g, key, members, receives, m) for key in held)
    sending: dict[int | None, int] = defaultdict(int)
    for key, hops in sent.items():
        sending[hops] += _memory_bytes(g, key, members, receives, m)
    return _Working(peak, holding, dict(sending))


def _kept_to_end(g: OpGraph, members: Collection[str], memories: Memories, order: Sequence[str],
                 segments: Mapping[str, int] | None = None) -> tuple[set[Memory], dict[Memory, int | None]]:
    """The memories ``members`` keep to the end of a pass: what the model outputs they make live
    in (``held``), and what the values they send to other devices live in (``sent``, those
    outside ``held``; a reader of only a size keeps nothing), each with the most segment
    boundaries it crosses to a reader (``None``: not known). With ``segments``
    (:func:`plan_segments`) a value a member of a later segment reads is sent too: the
    micro-batch carries it past other devices' segments and back (a non-contiguous device)."""
    outputs = set(g.meta.get("outputs", ()))
    held: set[Memory] = set()
    sent: dict[Memory, int | None] = {}
    for v in order:
        if outputs.intersection(g.record(v).fx_nodes):
            held.update(_all(memories[v]))
            continue
        for w in g.successors(v):
            if not _reads(g, v, w) or (w in members and not _hops(segments, v, w)):
                continue  # a reader in the same segment: the walk frees it after the last one
            for k in _kept(g, memories, v, w):  # a view's memory is carried from where it was made
                sent[k] = _farther(sent.get(k, 0), _hops(segments, k[0], w))
    return held, {k: hops for k, hops in sent.items() if k not in held}


def _farther(a: int | None, b: int | None) -> int | None:
    """The longer of two distances in segment boundaries, ``None`` (not known: any) the longest."""
    return None if a is None or b is None else max(a, b)


def _hops(segments: Mapping[str, int] | None, u: str, w: str) -> int | None:
    """Segment boundaries between ``u`` and its reader ``w`` (:func:`plan_segments`; ``None``: not
    known, where ``segments`` is ``None`` or does not place both; 0 for nodes of one segment)."""
    if segments is None or u not in segments or w not in segments:
        return None
    return max(segments[w] - segments[u], 0)


class _Working(NamedTuple):
    """:func:`working_memory`'s walk: the peak of one micro-batch, and the bytes of one
    micro-batch's model outputs (``holding``) and sent tensors (``sending``, by the segment
    boundaries they cross: :func:`queued`) that the device keeps for each of the other micro-batches."""

    peak: int
    holding: int
    sending: Mapping[int | None, int]

    @property
    def sent(self) -> int:
        """One micro-batch's bytes of sent tensors."""
        return sum(self.sending.values())

    def total(self, m: int, others: int | None, most: int | None = None) -> int:
        """The peak with ``others`` micro-batches' outputs and sends held (``None``: inference's
        ``m - 1`` outputs and :func:`queued` sends; a send of unknown distance at ``most`` hops)."""
        if others is not None:
            return self.peak + others * (self.holding + self.sent)
        return self.peak + (m - 1) * self.holding + sum(queued(m, most if hops is None else hops) * b
                                                        for hops, b in self.sending.items())


Memory = tuple[str, str]
"""A memory :func:`working_memory` follows: (the node that made it, its part of the node's
outputs, ``NodeRecord.resident_parts``' key; ``""`` for a node whose outputs are one memory)."""


def _memory_bytes(g: OpGraph, key: Memory, members: Collection[str], receives: bool, m: int) -> int:
    """One micro-batch's bytes of a memory on a device holding ``members``: a member's part, or
    a tensor received from another device (what was moved; 0 where the device reads it in place)."""
    u, part = key
    if u in members:
        return _per_microbatch(_parts(g.record(u))[part], m)
    return _per_microbatch(g.record(u).output_bytes, m) if receives else 0


def _parts(record: NodeRecord) -> Mapping[str, int]:
    """The memories a node's outputs keep: ``resident_parts``, or one of ``resident`` bytes."""
    return record.resident_parts or {"": record.resident}


Memories = Mapping[str, Mapping[str, tuple[Memory, ...]]]
"""Member -> each of its parts (:func:`_parts`) -> the memories that part keeps alive."""


def _memories(g: OpGraph, members: Collection[str], order: Sequence[str]) -> dict[str, dict[str, tuple[Memory, ...]]]:
    """Each member's parts and the memories each keeps (:data:`Memories`): its own, or for a view
    (``graph.meta["aliases"]``: the whole node; ``graph.meta["part_aliases"]``: one part) what
    it views of its base's, followed through members down to a member or a received tensor."""
    aliases = g.meta.get("aliases") or {}
    part_aliases = g.meta.get("part_aliases") or {}
    out: dict[str, dict[str, tuple[Memory, ...]]] = {}

    def viewed(base: str, v: str) -> tuple[Memory, ...]:
        return _kept(g, out, base, v) or _all(out.get(base)) or ((base, ""),)

    for v in order:  # topological: a view's base has its memories already
        r = g.record(v)
        base = aliases.get(v)  # a view holds no memory of its own (not a merged group named like one)
        if base is not None and base in g and g.nx.has_edge(base, v) and r.resident == 0:
            out[v] = dict.fromkeys(_parts(r), viewed(base, v))
            continue
        borrowed = part_aliases.get(v) or {}
        out[v] = {part: viewed(borrowed[part], v) if borrowed.get(part) in g and g.nx.has_edge(borrowed[part], v)
                  else ((v, part),) for part in _parts(r)}
    return out


def _all(parts: Mapping[str, tuple[Memory, ...]] | None) -> tuple[Memory, ...]:
    """Every memory the parts keep, once each (``()`` for ``None``)."""
    return tuple(dict.fromkeys(key for keys in (parts or {}).values() for key in keys))


def _kept(g: OpGraph, memories: Memories, u: str, w: str) -> tuple[Memory, ...]:
    """The memories of ``u`` that its reader ``w`` keeps alive: those of the parts of ``u`` that
    ``w`` reads (``NodeRecord.reads``; of a view's part, what it views, so a reader of only a size
    the same node makes keeps nothing), all of them where ``w`` does not say; for ``u`` not in
    ``memories`` (a received tensor), ``u`` whole."""
    if u not in memories:
        return ((u, ""),)
    parts, reads = g.record(u).resident_parts, g.record(w).reads
    if not parts or not reads:
        return _all(memories[u])
    return _all({part: keys for part, keys in memories[u].items() if part in reads})


def backward_peak(problem: Problem, forwards: Collection[str] | _Layout, device: Device | None = None, *,
                  saves: Mapping[str, int] | None = None, backwards: Collection[str] | None = None,
                  graded: Collection[str] | None = None) -> int:
    """The most bytes one micro-batch's backward pass holds at once on a device whose forward
    nodes are ``forwards`` (training; the other micro-batches aside). ``saves``: what each forward
    node saved for backward (:func:`saved_increments`), alive until its backward ran;
    ``backwards``: the backward nodes the device runs (``None``: those of ``forwards``);
    ``graded``: :func:`_needs_grad` of the graph, and ``forwards`` their :class:`_Layout`, where
    the caller has them.

    Backward runs the forward nodes in reverse order. Held throughout: this micro-batch's values
    the device sent on or made as model outputs (the executor drops them after the backward).
    The gradients of the model outputs (the loss's) and, on a device that pays transfers, those
    of the values it sent arrive first, and are held to the end (``torch.autograd.backward``
    keeps the gradients it is given until it returns). A gradient made here lives from the first
    of its readers' backward until its own node's backward ran, sized as the output it is the
    gradient of, and only for nodes with weights before them (:func:`_needs_grad`); one sent back
    to another device is counted to the end. Each backward node adds its own peak while it runs.
    """
    g, m = problem.graph, microbatches(problem)
    # the model outputs and values sent on (held, sent) are kept to the end
    members, order, _, held, sent = forwards if isinstance(forwards, _Layout) else _layout(g, forwards)
    outputs = set(g.meta.get("outputs", ()))
    receives = device is None or device.pays_transfer
    graded = _needs_grad(g) if graded is None else graded
    saves = saves or {}
    live = sum(saves.get(v, 0) for v in order)
    alive: dict[str, int] = {}  # node -> bytes of its output's gradient, alive until its backward
    given: set[str] = set()  # nodes whose gradient the executor hands to autograd (the loss's, or sent back)
    for v in order:
        r = g.record(v)
        makes = bool(outputs.intersection(r.fx_nodes))
        readers = [w for w in g.successors(v) if w not in members and not g.record(w).backward]
        if v in graded and (makes or any(_reads_tensor(g, v, w) for w in readers)):
            given.add(v)
            if makes or receives:  # arrived: autograd keeps it to the end of the pass
                live += _per_microbatch(r.output_bytes, m)
    live += sum(_memory_bytes(g, key, members, receives, m) for key in held | sent.keys())
    peak = live
    # a trainable shared tensor read by several members: autograd keeps the gradient of each read
    # until the last (in backward order) is in, summing them out of place (the first is a transposed
    # view: not stealable); from the first read's backward to the last's
    tied = [(t.nbytes, [v for v in order if v in t.readers]) for t in g.shared_tensors() if t.trainable]
    tied = [(nbytes, readers) for nbytes, readers in tied if len(readers) > 1]
    for v in reversed(order):
        own = max((_backward_own_peak(g, b, m) for b in g.successors(v)
                   if g.record(b).backward and (backwards is None or b in backwards) and _is_backward_of(g, b, v)),
                  default=0)
        summed = _summed_gradient(g, v, members, graded, alive.keys() | given, m)
        peak = max(peak, live + own + summed + sum(n for n, readers in tied if v in readers[:-1]))
        live += sum(n for n, readers in tied if v == readers[-1]) - sum(n for n, readers in tied if v == readers[0])
        live -= alive.pop(v, 0) + saves.get(v, 0)
        for u in g.predecessors(v):
            if g.record(u).backward or u not in graded or not _reads_tensor(g, u, v):  # no gradient flows to
                continue  # what no weight made, nor through a size
            grad = _per_microbatch(g.record(u).output_bytes, m)
            if u in members:
                if u not in alive:
                    alive[u] = grad
                    live += grad
            else:
                live += grad  # sent back to the device that made u
    return peak


def _summed_gradient(g: OpGraph, v: str, members: Collection[str], graded: Collection[str], has: Collection[str],
                     m: int) -> int:
    """Bytes of the largest gradient ``v``'s backward adds to one its member predecessor has
    already (``has``: another reader's, or one handed to autograd). Autograd sums them in place
    only when it owns the first alone (``InputBuffer::accumulate``); one the executor gave it, or
    one an add's backward passes to both its inputs, is summed into a new tensor, beside both
    while ``v``'s backward still holds its own (a residual input read on another device too:
    0.87 of the measured peak without it)."""
    return max((_per_microbatch(g.record(u).output_bytes, m) for u in g.predecessors(v)
                if u in members and u in has and u in graded and not g.record(u).backward
                and _reads_tensor(g, u, v)), default=0)


def _backward_own_peak(g: OpGraph, b: str, m: int) -> int:
    """What backward node ``b`` holds while it runs on one micro-batch of ``m``: its own peak (a
    micro-batch's share), and at least, where it makes weight gradients (``param_bytes``), a new
    gradient of its forward node's weights, which autograd adds into ``.grad`` after the node ran
    and whose size does not shrink with the micro-batch (a first layer's backward makes no input
    gradient, and its own peak at the whole batch was that input gradient)."""
    return max(_per_microbatch(g.record(b).own_peak, m), weight_gradient_bytes(g, b))


def weight_gradient_bytes(g: OpGraph, b: str) -> int:
    """Bytes of the new weight gradient backward node ``b`` makes on any micro-batch: its forward
    node's weights where it holds gradients (``param_bytes``), and the trainable shared tensors
    (a tied weight) its forward node reads but does not own, whose bytes are their owner's."""
    forwards = [u for u in g.predecessors(b) if not g.record(u).backward]
    shared = sum(t.nbytes for t in g.shared_tensors() for u in forwards
                 if t.trainable and u in t.readers and u != t.owner)
    if not g.record(b).param_bytes:
        return shared
    return sum(g.record(u).param_bytes for u in forwards) + shared


def waiting_gradients(problem: Problem, forwards: Collection[str], device: Device | None = None, *,
                      graded: Collection[str] | None = None) -> tuple[int, int]:
    """Per micro-batch, the bytes of gradients that wait on a device for another device's backward
    (training): ``(sent back, arrived)``.

    A device's backward sends the gradient of each value it read from another device back to it,
    where it waits until that device runs the micro-batch's backward. On a device that reads the
    values in place (a CPU: :attr:`Device.pays_transfer` false) the gradient stays in its memory
    while it waits (*sent back*); on one that receives them (``device=None`` too) it is copied
    over, and waits on the receiving side: the gradients that *arrived* for the values this
    device sent on. Each value's gradient once (its readers' contributions are summed), and only
    for values with weights before them (:func:`_needs_grad`).

    How many micro-batches' gradients wait follows from the schedule: a device that holds ``k``
    micro-batches in flight (:func:`in_flight`) ran the forward of micro-batch ``i`` after the
    backward of ``i - k`` (1F1B; under GPipe ``k = m`` and every forward ran first), so while the
    reader works on ``i``, those of ``i - k + 1 .. i - 1`` may wait: ``k - 1`` other micro-batches,
    ``k`` the producer's (sent back) or the device's own (arrived). :func:`memory_parts` charges them.
    ``graded``: :func:`_needs_grad` of the graph, where the caller has it.
    """
    g, m = problem.graph, microbatches(problem)
    members = forwards if isinstance(forwards, (set, frozenset)) else set(forwards)
    graded = _needs_grad(g) if graded is None else graded
    receives = device is None or device.pays_transfer
    if receives:
        arrived = {v for v in members if v in graded and any(
            w not in members and not g.record(w).backward and _reads_tensor(g, v, w) for w in g.successors(v))}
        return 0, sum(_per_microbatch(g.record(v).output_bytes, m) for v in arrived)
    sent_back = {u for v in members for u in g.predecessors(v)
                 if u not in members and u in graded and not g.record(u).backward and _reads_tensor(g, u, v)}
    return sum(_per_microbatch(g.record(u).output_bytes, m) for u in sent_back), 0


def _needs_grad(g: OpGraph) -> set[str]:
    """The forward nodes whose outputs get a gradient: those with trainable weights (their
    backward node holds gradients: ``param_bytes``; or they read a trainable shared tensor), and
    every node after one of them."""
    trainable = {u for b, r in g.records() if r.backward and r.param_bytes
                 for u in g.predecessors(b) if not g.record(u).backward}
    trainable |= {v for t in g.shared_tensors() if t.trainable for v in t.readers}
    out: set[str] = set()
    for v in g.topological_order():
        r = g.record(v)
        if not r.backward and (v in trainable or any(u in out and _reads_tensor(g, u, v) for u in g.predecessors(v))):
            out.add(v)
    return out


def _reads_tensor(g: OpGraph, u: str, w: str) -> bool:
    """Whether ``w`` reads a tensor ``u`` makes, so that a gradient flows back from ``w`` to ``u``:
    not when it reads only sizes ``u`` makes (``NodeRecord.reads`` against ``u``'s
    ``resident_parts``, its tensors; true where either does not say)."""
    parts, reads = g.record(u).resident_parts, g.record(w).reads
    return not parts or not reads or any(p in parts for p in reads)


def _is_backward_of(g: OpGraph, b: str, v: str) -> bool:
    """Whether backward node ``b`` is forward node ``v``'s (its only forward predecessor)."""
    return all(g.record(u).backward or u == v for u in g.predecessors(b))


def saved_parts(record: NodeRecord, node: str) -> Mapping[str, int]:
    """``record.saved_parts``, or for a record without them ``saved_bytes`` as a key of the node's own."""
    if record.saved_parts:
        return record.saved_parts
    return {f"\0{node}": record.saved_bytes} if record.saved_bytes else {}


def saved_increments(graph: OpGraph, order: Iterable[str], m: int = 1, *, in_place: bool = False,
                     exclude: Collection[str] = ()) -> dict[str, int]:
    """Per micro-batch of ``m``, the bytes each forward node of ``order`` saves for backward that
    no node before it in ``order`` saved already (:func:`saved_parts`; each storage kept once).
    ``in_place``: the nodes run on a device that reads other devices' values where they are (a
    CPU), so a saved storage made by a node outside ``order`` takes none of its memory;
    ``exclude``: saved storages not counted (held otherwise)."""
    order = list(order)
    seen: set[str] = set(exclude) | (_foreign(graph, order) if in_place else set())
    out: dict[str, int] = {}
    for v in order:
        r = graph.record(v)
        if r.backward:
            continue
        parts = saved_parts(r, v)
        out[v] = _per_microbatch(sum(b for k, b in parts.items() if k not in seen), m)
        seen.update(parts)
    return out


def saved_union(graph: OpGraph, nodes: Iterable[str], *, in_place: bool = False) -> int:
    """Bytes the forward nodes in ``nodes`` keep for backward together, each saved storage once
    (``saved_parts``; the sum of ``saved_bytes`` where no node has them). ``in_place``: as in
    :func:`saved_increments`, storages made outside ``nodes`` count nothing."""
    nodes = list(nodes)
    foreign = _foreign(graph, nodes) if in_place else set()
    forwards = (v for v in nodes if not graph.record(v).backward)
    return sum(b for k, b in union_of_saved(saved_parts(graph.record(v), v) for v in forwards).items()
               if k not in foreign)


def _foreign(graph: OpGraph, nodes: Collection[str]) -> set[str]:
    """The saved-storage keys of the forward nodes in ``nodes`` made by no fx node of theirs: the
    values they read from other devices (and the model's inputs)."""
    made = {f for v in nodes for f in graph.record(v).fx_nodes}
    return {k for v in nodes if not graph.record(v).backward for k in graph.record(v).saved_parts
            if saved_producer(k) not in made}


def _kept_and_saved(g: OpGraph, members: Collection[str], kept: Iterable[Memory]) -> dict[str, int]:
    """The saved storages (``saved_parts`` keys of the forward nodes in ``members``, with their
    bytes) that are a memory in ``kept`` (one the device keeps to the end of a pass anyway: a
    value it sends, a model output), together no larger than it. A memory is a node's part by
    its fx node, or the whole output of a node made of one fx node (a group's output is not
    known)."""
    saved: dict[str, int] = {}
    for v in members:
        if not g.record(v).backward:
            for k, b in g.record(v).saved_parts.items():
                if not k.endswith("~"):  # a node's temporaries are no output
                    saved[k] = max(saved.get(k, 0), b)
    by_producer: dict[str, list[str]] = defaultdict(list)
    for k in saved:
        by_producer[saved_producer(k)].append(k)
    out: dict[str, int] = {}
    for u, part in kept:
        if u not in members:
            continue
        own = g.record(u).fx_nodes
        fx = part or (own[0] if len(own) == 1 else None)
        room = _parts(g.record(u)).get(part, 0)
        for k in by_producer.get(fx or "", ()):
            if saved[k] <= room:
                out[k], room = saved[k], room - saved[k]
    return out


def _reads(g: OpGraph, v: str, w: str) -> bool:
    """Whether edge ``v -> w`` keeps ``v``'s output alive as working memory: not the edge from a
    forward node to a backward one (what autograd keeps for backward is ``saved_bytes``, counted
    per micro-batch in flight)."""
    return not g.record(w).backward or g.record(v).backward


QUEUE_SIZE = 2
"""Micro-batches a queue between two segments of an inference pipeline holds: the default
``queue_size`` of :class:`~torchplace.runtime.pipeline.PipelineExecutor` and of the call clock
(:func:`torchplace.callmodel.simulate_inference`): one constant for the memory, the clock and the run."""


def queued(m: int, hops: int | None = None) -> int:
    """Other micro-batches whose sent tensors a device may still hold while it works on one, for
    tensors whose last reader is ``hops`` segment boundaries on (:func:`plan_segments`; ``None``:
    anywhere). Each boundary holds up to :data:`QUEUE_SIZE` in its queue and one in the worker
    past it (working on it, or waiting to pass it on), and there are ``m - 1`` others: ``min(m - 1,
    hops (QUEUE_SIZE + 1))``. How many really wait depends on the devices' speeds (0 to 2 measured
    beside the one the next device works on, ``benchmarks/memory_fidelity.py``): the queues fill
    where a device after the sender is slower than it (two logical CPUs, the second slowed: 3 of 3
    at 4 micro-batches, where 2 were charged before)."""
    return m - 1 if hops is None else min(m - 1, hops * (QUEUE_SIZE + 1))


def memory(problem: Problem, nodes: Iterable[str], *, in_flight: int | None = None, recompute: bool = False,
           device: Device | None = None, upstream_in_flight: int | None = None,
           segments: Mapping[str, int] | None = None) -> int:
    """Bytes a device needs for ``nodes``.

    Parameters (and, on backward nodes, gradients and optimizer state) plus working memory. A
    tensor several nodes read (:meth:`OpGraph.shared_tensors`) is in its owner's ``param_bytes``; a
    device that holds some of its readers but not its owner holds a copy and pays for it too, so
    every tensor is counted once per device that holds it.

    With a training :class:`~torchplace.problem.Pipeline` of ``m`` micro-batches (the graph's bytes
    are those of the whole step's batch; one micro-batch is ``ceil(bytes / m)``):

        params + working(one micro-batch) + in_flight x saved(one micro-batch)

    where ``saved`` is what the forward nodes keep for backward, or with ``recompute`` only the
    stage's inputs (none on a CPU, which reads them where they are), plus one micro-batch's saved
    activations while it is recomputed. ``in_flight``
    is the number of micro-batches whose activations the device holds at its peak
    (:func:`in_flight`); ``None`` takes the most any device can hold, ``m``. ``upstream_in_flight``:
    the most micro-batches in flight on a device whose values ``nodes`` read
    (:func:`upstream_in_flight`; ``None``: ``m``), for the gradients sent back that wait for its
    backward.

    With liveness (:func:`uses_liveness`) working memory is :func:`working_memory` on ``device``
    (inference: with the plan's ``segments``, :func:`plan_segments`, where known).
    """
    return sum(memory_parts(problem, nodes, in_flight=in_flight, recompute=recompute, device=device,
                            upstream_in_flight=upstream_in_flight, segments=segments).values())


MEMORY_KINDS = ("parameters", "gradients + optimizer", "shared copies", "working", "activations")
"""The parts :func:`memory_parts` splits a device's memory into, in drawing order."""


def copy_bytes(problem: Problem, tensor: SharedTensor) -> tuple[int, int]:
    """(copy, gradient) bytes a device holds for a shared tensor it reads but does not own: the
    copy, and in training the copy's gradient when the tensor is trainable (its readers there make
    one). :func:`memory_parts` and :func:`torchplace.solvers.shared.replicated` both charge this."""
    return tensor.nbytes, tensor.nbytes if problem.mode == "training" and tensor.trainable else 0


def memory_parts(problem: Problem, nodes: Iterable[str], *, in_flight: int | None = None,
                 recompute: bool = False, device: Device | None = None,
                 upstream_in_flight: int | None = None, segments: Mapping[str, int] | None = None) -> dict[str, int]:
    """:func:`memory` split by kind (:data:`MEMORY_KINDS`); the parts sum to :func:`memory`.

    ``parameters``: the forward nodes' parameters and buffers; ``gradients + optimizer``: what
    backward nodes hold (gradients and optimizer state); ``shared copies``: copies of tensors owned
    elsewhere; ``working``: temporaries (one micro-batch's in a training pipeline; the liveness
    peak of one micro-batch with :func:`uses_liveness`);
    ``activations``: what is kept for backward for the micro-batches in flight (0 for inference).
    """
    live = uses_liveness(problem)
    coarse = problem.coarsened
    if live and coarse is not None and problem.graph is coarse.graph:  # the original graph's memory of the members
        original = replace(problem, graph=coarse.original, coarsened=None)
        fine = None if segments is None else {v: i for c, i in segments.items() for v in coarse.members.get(c, ())}
        return memory_parts(original, [v for c in nodes for v in coarse.members[c]], in_flight=in_flight,
                            recompute=recompute, device=device, upstream_in_flight=upstream_in_flight,
                            segments=fine)
    g = problem.graph
    members = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
    params = sum(g.record(v).param_bytes for v in members if not g.record(v).backward)
    grads = sum(g.record(v).param_bytes for v in members if g.record(v).backward)
    copies = [copy_bytes(problem, t) for t in g.shared_tensors()
              if t.owner not in members and not t.readers.isdisjoint(members)]
    grads += sum(grad for _, grad in copies)
    training, m = problem.mode == "training", microbatches(problem)
    k = m if in_flight is None else in_flight
    in_place = device is not None and not device.pays_transfer  # reads other devices' values where they are
    if training:
        saved = saved_union(g, members, in_place=in_place) if live else sum(g.record(v).saved_bytes for v in members)
        inputs = 0 if in_place else stage_input_bytes(problem, members)  # what a recomputing device keeps
        kept = _per_microbatch(inputs if recompute else saved, m)  # per micro-batch in flight
        activations = k * kept + (_per_microbatch(saved, m) if recompute else 0)  # + the one recomputed
    if live and training:
        work = _training_working(problem, members, device, in_flight=k, kept=kept, in_place=in_place,
                                 recompute=recompute, upstream=m if upstream_in_flight is None else upstream_in_flight)
    elif live:
        work = working_memory(problem, members, device, segments=segments)
    else:
        work = sum(g.record(v).temp_bytes for v in members)
    parts = dict.fromkeys(MEMORY_KINDS, 0)
    parts.update({"parameters": params, "gradients + optimizer": grads, "shared copies": sum(c for c, _ in copies),
                  "working": work})
    if training and problem.pipeline is not None:
        parts.update({"working": work if live else _per_microbatch(work, m), "activations": activations})
    return parts


def _training_working(problem: Problem, members: Collection[str], device: Device | None, *, in_flight: int,
                      upstream: int, kept: int, in_place: bool, recompute: bool) -> int:
    """Training working memory with liveness (module docstring): one micro-batch's forward or its
    backward, never both at once, with what the other micro-batches in flight hold meanwhile.
    ``kept``: the bytes each micro-batch in flight keeps for its backward (the activations);
    ``in_place``: saved values of other devices take no memory here (:func:`saved_increments`);
    ``recompute``: the backward runs the forward again, whose outputs are a second copy beside
    those the device still holds for their readers."""
    g, m = problem.graph, microbatches(problem)
    others = in_flight - 1  # held until their backward
    outputs = set(g.meta.get("outputs", ()))
    makes = [v for v in members if not g.record(v).backward and outputs.intersection(g.record(v).fx_nodes)]
    grad_out = sum(_per_microbatch(g.record(v).output_bytes, m) for v in makes)  # the loss's gradient arrives
    loss = _per_microbatch(loss_bytes(g), m) if makes else 0  # the loss runs where the outputs are
    backward = max((_backward_own_peak(g, v, m) for v in members if g.record(v).backward), default=0)
    # the forward's peak with what its nodes saved so far (the saved tensors it still reads are
    # counted twice: an upper bound), beside the saved activations of this micro-batch
    forwards = {v for v in members if not g.record(v).backward}
    layout = _layout(g, forwards)
    # a value sent on (or a model output) that a node also saves for backward is one storage: the
    # walks hold it as kept to the end, not as saved too, and the activations count it
    both = {} if recompute else _kept_and_saved(g, forwards, layout.held | layout.sent.keys())
    saves = saved_increments(g, layout.order, m, in_place=in_place, exclude=both)
    saved_now = sum(saved_increments(g, layout.order, m, in_place=in_place).values())
    walk = _walk(problem, layout, device, saves)
    # what the other micro-batches in flight keep here meanwhile, through this one's backward too:
    # their values (less those saved for backward: the activations count them), and the gradients
    # the loss made of their outputs (waiting for their backward)
    forward = walk.total(m, others) - others * (sum(both.values()) // m)  # rounded down: never more than counted
    held_others = forward - walk.peak + others * grad_out
    graded = _needs_grad(g)
    wait_forward, wait_backward = _waiting(problem, forwards, device, in_flight=in_flight, upstream=upstream, kept=kept,
                                           graded=graded)
    # the loss runs right after the forward (other micro-batches' values still held under GPipe)
    # the backward's, as it frees what each node saved (the activations count them all)
    backward_pass = backward_peak(problem, layout, device, saves=saves, graded=graded,
                                  backwards={v for v in members if g.record(v).backward}) - saved_now
    if recompute:
        backward_pass += walk.holding + walk.sent
    return max(forward - saved_now + loss + wait_forward + others * grad_out,
               held_others + wait_backward + max(backward_pass, grad_out + max(backward, loss)))


def _waiting(problem: Problem, forwards: Collection[str], device: Device | None, *, in_flight: int, upstream: int,
             kept: int, graded: Collection[str]) -> tuple[int, int]:
    """Bytes of the other micro-batches' gradients waiting on a device (:func:`waiting_gradients`)
    beyond its ``in_flight`` micro-batches' activations (``kept`` bytes each), at the peaks of its
    forward and of its backward passes.

    At its ``i``-th backward (``i = 0 .. m-1``) a device keeps the activations of ``min(k, m - i)``
    micro-batches (``k = in_flight``; 1F1B's drain frees them), and the gradients it sent back
    for up to ``min(i, upstream - 1)`` earlier ones wait for their producers: beyond ``k``
    activations, ``max_i min(k, m - i) kept + min(i, upstream - 1) sent_back - k kept``. Under
    1F1B the forward of micro-batch ``i + k`` follows the backward of ``i``, so ``min(m - k,
    upstream - 1)`` of them wait at a forward too; under GPipe every forward runs before any
    backward, and none does. The gradients arrived for the values it sent wait for its own
    backward, those of its other ``k - 1`` micro-batches in flight, at both (GPipe: the backward).
    """
    m = microbatches(problem)
    sent_back, arrived = waiting_gradients(problem, forwards, device, graded=graded)
    k, ahead = in_flight, upstream - 1
    backward = max(min(k, m - i) * kept + min(i, ahead) * sent_back for i in range(m)) - k * kept
    backward += (k - 1) * arrived
    gpipe = problem.pipeline is not None and problem.pipeline.schedule == "gpipe"
    forward = 0 if gpipe else max(min(m - k, ahead), 0) * sent_back + (k - 1) * arrived
    return forward, max(backward, 0)


def loss_bytes(graph: OpGraph) -> int:
    """Bytes the training loss holds beyond the model's outputs for the whole example batch
    (``graph.meta["loss_bytes"]``, :mod:`torchplace.profiling.loss`; 0 where not profiled)."""
    return int(graph.meta.get("loss_bytes") or 0)


def device_memory_parts(problem: Problem, stages: Sequence[StageLike]) -> dict[str, dict[str, int]]:
    """:func:`memory_parts` of each device of a plan, with the plan's in-flight micro-batches and
    recomputation (the parts sum to :func:`device_memory`)."""
    options = _plan_memory_options(problem, stages)
    return {d: memory_parts(problem, nodes, device=_device(problem, d), **options[d])
            for d, nodes in _nodes_by_device(stages).items()}


def memory_elsewhere(problem: Problem, stages: Sequence[StageLike]) -> Callable[[str, Device], int]:
    """``need(d, device)``: the bytes the nodes a plan runs on device ``d`` would need on ``device``
    instead, the plan's micro-batches in flight, recomputation and segments kept (a plan with its
    devices renamed; ``need(d, cluster.device(d))`` is :func:`device_memory`'s ``d``)."""
    options, nodes = _plan_memory_options(problem, stages), _nodes_by_device(stages)
    return lambda d, device: memory(problem, nodes[d], device=device, **options[d])


def _device(problem: Problem, name: str) -> Device | None:
    try:
        return problem.cluster.device(name)
    except (KeyError, ValueError, LookupError):
        return None


def _per_microbatch(nbytes: int, m: int) -> int:
    return -(-nbytes // m)


def stage_input_bytes(problem: Problem, nodes: Collection[str]) -> int:
    """Bytes of the forward values a node set reads from outside it (what a recomputing stage
    keeps), each producer once."""
    g = problem.graph
    members = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
    producers = {u for v in members if not g.record(v).backward for u in g.predecessors(v)
                 if u not in members and not g.record(u).backward}
    return sum(g.record(u).output_bytes for u in producers)


def in_flight(problem: Problem, stages: Sequence[StageLike]) -> dict[str, int]:
    """Micro-batches whose activations each device holds at its peak, under the problem's
    :class:`~torchplace.problem.Pipeline` (every device: ``m`` without one).

    Under 1F1B the forward stage at position ``j`` of ``S`` holds ``min(m, S - j)`` (its warm-up
    forwards before its first backward), as the executor runs them, and a device the most of its
    stages' (the first; a device with two stages in a row holds its first stage's count);
    under GPipe every device holds ``m``.
    """
    g, p = problem.graph, problem.pipeline
    m = p.microbatches if p is not None else 1
    holds = {s.device: m for s in stages}
    if p is not None and p.schedule == "1f1b":
        forwards = [s.device for s in stages if any(not g.record(v).backward for v in s.nodes)]
        for j, d in reversed(list(enumerate(forwards))):  # the first stage of a device sets its count
            holds[d] = min(m, len(forwards) - j)
    return holds


def upstream_in_flight(problem: Problem, stages: Sequence[StageLike],
                       holds: Mapping[str, int] | None = None) -> dict[str, int]:
    """Per device of a plan, the most micro-batches in flight (``holds``, :func:`in_flight`) on
    another device whose values its forward nodes read: the gradients it sends back wait for that
    device's backward (:func:`waiting_gradients`); 1 for a device that reads none."""
    g = problem.graph
    holds = in_flight(problem, stages) if holds is None else holds
    where = {v: s.device for s in stages for v in s.nodes}
    out = dict.fromkeys(holds, 1)
    for v, d in where.items():
        if g.record(v).backward:
            continue
        for u in g.predecessors(v):
            e = where.get(u)
            if e is not None and e != d and not g.record(u).backward:
                out[d] = max(out[d], holds[e])
    return out


class _PlanMemory(TypedDict):
    """What :func:`memory` takes from a plan for one device."""

    in_flight: int
    upstream_in_flight: int
    recompute: bool
    segments: Mapping[str, int] | None


def _plan_memory_options(problem: Problem, stages: Sequence[StageLike]) -> dict[str, _PlanMemory]:
    """Per device of a plan, what :func:`memory` takes from the plan: the micro-batches in flight
    there and upstream, whether it recomputes, and (inference) the plan's segments."""
    holds, recomputing = in_flight(problem, stages), _recomputes(stages)
    upstream = upstream_in_flight(problem, stages, holds)
    segments = plan_segments(stages) if problem.mode != "training" else None
    return {d: _PlanMemory(in_flight=holds[d], upstream_in_flight=upstream[d], recompute=d in recomputing,
                           segments=segments) for d in holds}


def plan_segments(stages: Sequence[StageLike]) -> dict[str, int]:
    """The segment of each node of an inference plan: segments are the runs of consecutive stages
    on one device (:func:`torchplace.runtime.schedule.segments`), numbered in order; a micro-batch
    crosses a queue between two (:func:`queued`). The grouping is the executors' own, written
    again here: importing :mod:`torchplace.runtime` imports torch, which ``torchplace solve``
    never does (it starts in a fraction of a second); a test holds the two to the same answer."""
    out: dict[str, int] = {}
    segment, device = -1, None
    for s in stages:
        if s.device != device:
            segment, device = segment + 1, s.device
        out.update(dict.fromkeys(s.nodes, segment))
    return out


def _recomputes(stages: Iterable[StageLike]) -> set[str]:
    return {s.device for s in stages if getattr(s, "recompute", False)}


def device_cost(problem: Problem, nodes: Collection[str], device: Device, *, in_flight: int | None = None,
                recompute: bool = False, upstream_in_flight: int | None = None,
                segments: Mapping[str, int] | None = None) -> StageCost:
    """Cost of placing node set ``nodes`` on ``device`` (recomputing its forward nodes' activations
    in the backward pass runs them twice; ``segments``: the plan's, :func:`memory`)."""
    compute = math.fsum(problem.node_time(v, device) for v in nodes)
    if recompute:
        compute += math.fsum(problem.node_time(v, device) for v in nodes if not problem.graph.record(v).backward)
    t_in, t_out = transfers(problem, nodes) if device.pays_transfer else (0.0, 0.0)
    mem = memory(problem, nodes, in_flight=in_flight, recompute=recompute, device=device,
                 upstream_in_flight=upstream_in_flight, segments=segments)
    return StageCost(device.name, len(nodes), compute, t_in, t_out, mem)


def device_memory(problem: Problem, stages: Sequence[StageLike]) -> dict[str, int]:
    """Bytes each device of a plan needs (:func:`memory` with the plan's in-flight micro-batches
    and recomputation)."""
    options = _plan_memory_options(problem, stages)
    return {d: memory(problem, nodes, device=_device(problem, d), **options[d])
            for d, nodes in _nodes_by_device(stages).items()}


def _nodes_by_device(stages: Iterable[StageLike]) -> dict[str, list[str]]:
    by_device: dict[str, list[str]] = defaultdict(list)
    for s in stages:
        by_device[s.device].extend(s.nodes)
    return by_device


def evaluate_stages(problem: Problem, stages: Sequence[StageLike]) -> tuple[float, list[StageCost]]:
    """The objective of ``stages`` and the per-device breakdown (devices in first-use order).

    Throughput: the max device load. Latency: the makespan of :func:`simulate`, with each device's
    transfer columns holding the seconds its ports were busy.
    """
    if problem.parallel is not None:
        return _piper_evaluate(problem, stages)
    if problem.objective == "latency":
        sched = simulate(problem, stages)
        return sched.makespan, sched.costs(problem)
    options = _plan_memory_options(problem, stages)
    costs = [device_cost(problem, set(nodes), problem.cluster.device(name), **options[name])
             for name, nodes in _nodes_by_device(stages).items()]
    return max((c.load for c in costs), default=0.0), costs


def evaluate(problem: Problem, plan: object) -> float:
    """The objective of a plan (anything with ``.stages``) under ``problem``'s cost model."""
    return evaluate_stages(problem, plan.stages)[0]  # type: ignore[attr-defined]


# -- Piper ----------------------------------------------------------------------------------------
def piper_resync_bytes(param_bytes: float, d: int, microbatches: int) -> float:
    """Bytes per sample each replica sends to all-reduce ``param_bytes`` of weights ``d`` ways once
    per batch of ``microbatches`` (Piper Sec. 3.4: ``4 (d-1)/d w``, PipeDream's parameter-server
    model)."""
    return 4.0 * (d - 1) * param_bytes / d / microbatches


def piper_edge_bytes(problem: Problem, v: str, x: TMPC, members: Collection[str]) -> tuple[float, float]:
    """(in, out) bytes node ``v`` in TMPC ``x`` moves over edges that cross the boundary of
    ``members``: ``2 (c + c^fw)`` per edge in, ``2 (c + c^bw)`` per edge out (forward + backward,
    Piper Sec. 4 and App. B)."""
    g = problem.graph
    fin = math.fsum(2.0 * (g.edge_bytes(u, v) + x.sync_in.get(u, 0.0)) for u in g.predecessors(v) if u not in members)
    fout = math.fsum(2.0 * (g.edge_bytes(v, w) + x.sync_out.get(w, 0.0)) for w in g.successors(v) if w not in members)
    return fin, fout


def piper_tmpc(problem: Problem, v: str, t: int, tmpc_id: str) -> TMPC:
    """The TMPC ``tmpc_id`` of node ``v`` for degree ``t``.

    Raises:
        InvalidPlanError: naming the node and the TMPCs it has.
    """
    from torchplace.errors import InvalidPlanError

    for x in problem.graph.record(v).tmpcs.get(t, ()):
        if x.id == tmpc_id:
            return x
    have = [x.id for x in problem.graph.record(v).tmpcs.get(t, ())]
    raise InvalidPlanError(f"node {v!r} has no TMPC {tmpc_id!r} for tensor-parallel degree {t}; it has {have}")


def piper_stage(problem: Problem, nodes: Collection[str], t: int, d: int, s: int,
                tmpcs: Mapping[str, str], name: str = "") -> StageCost:
    """Piper's cost of one stage (module docstring): ``load`` is its time per sample, ``memory``
    its bytes per device with ``s`` micro-batches in flight over it and the stages after it."""
    par = problem.parallel
    assert par is not None, "piper_stage needs a problem with a Parallel setting"
    members = set(nodes)
    compute = t_in = t_out = resync = 0.0
    mem = 0.0
    y = -(-s // d)
    for v in sorted(members):
        if v not in tmpcs:
            from torchplace.errors import InvalidPlanError

            raise InvalidPlanError(f"stage {name!r}: no TMPC chosen for node {v!r}")
        x = piper_tmpc(problem, v, t, tmpcs[v])
        fin, fout = piper_edge_bytes(problem, v, x, members)
        compute += x.time / d
        t_in += fin / d / par.bandwidth
        t_out += fout / d / par.bandwidth
        resync += piper_resync_bytes(x.param_bytes, d, par.microbatches) / par.bandwidth
        mem += x.mem_a * y + x.mem_b
    return StageCost(name, len(members), compute, t_in, t_out, int(math.ceil(mem)), resync)


def _piper_evaluate(problem: Problem, stages: Sequence[StageLike]) -> tuple[float, list[StageCost]]:
    s = sum(getattr(st, "data_parallel", 1) for st in stages)
    costs = []
    for st in stages:
        d, t = getattr(st, "data_parallel", 1), getattr(st, "tensor_parallel", 1)
        costs.append(piper_stage(problem, st.nodes, t, d, s, getattr(st, "tmpcs", {}), st.device))
        s -= d
    return max((c.load for c in costs), default=0.0), costs


# -- latency ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """One tensor moving between devices in a latency schedule."""

    node: str
    src: str
    dst: str
    start: float
    finish: float


@dataclass(frozen=True)
class Schedule:
    """The simulation of one sample (see the module docstring).

    Attributes:
        makespan: time the last node finishes (the latency objective).
        start, finish: per node.
        device_of: node -> device name.
        order: per device, its nodes in execution order.
        transfers: every cross-device transfer, in plan order.
    """

    makespan: float
    start: dict[str, float]
    finish: dict[str, float]
    device_of: dict[str, str]
    order: dict[str, list[str]]
    transfers: list[Transfer]

    def costs(self, problem: Problem) -> list[StageCost]:
        """Per device: compute seconds, seconds its in/out ports were busy, memory."""
        t_in: dict[str, float] = defaultdict(float)
        t_out: dict[str, float] = defaultdict(float)
        for t in self.transfers:
            t_in[t.dst] += t.finish - t.start
            t_out[t.src] += t.finish - t.start
        out = []
        for dev, nodes in self.order.items():
            compute = math.fsum(self.finish[v] - self.start[v] for v in nodes)
            out.append(StageCost(dev, len(nodes), compute, t_in[dev], t_out[dev],
                                 memory(problem, nodes, device=problem.cluster.device(dev))))
        return out


def plan_order(problem: Problem, stages: Sequence[StageLike]) -> list[tuple[str, str]]:
    """Every (node, device) in plan order: stage by stage, topological inside a stage."""
    topo = {v: i for i, v in enumerate(problem.graph.topological_order())}
    return [(v, s.device) for s in stages for v in sorted(s.nodes, key=topo.__getitem__)]


def simulate(problem: Problem, stages: Sequence[StageLike]) -> Schedule:
    """Run one sample of ``stages`` through the simulation of the module docstring.

    Nodes are taken in plan order; each starts as early as its device, its inputs and the order
    allow, and then reserves its transfers (destinations in name order) on its ports.

    Raises:
        ValueError: if a node comes before one of its inputs in the plan order (a plan that
            :meth:`Plan.validate` accepts never does).
    """
    g, cluster = problem.graph, problem.cluster
    sequence = plan_order(problem, stages)
    devices = {d: cluster.device(d) for d in dict.fromkeys(d for _, d in sequence)}
    device_of = dict(sequence)
    order: dict[str, list[str]] = {d: [] for d in devices}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    arrival: dict[tuple[str, str], float] = {}  # (node, device) -> time its output is there
    free = dict.fromkeys(devices, 0.0)
    out_port = dict.fromkeys(devices, 0.0)
    in_port = dict.fromkeys(devices, 0.0)
    moved: list[Transfer] = []
    for v, dev in sequence:
        ready = [free[dev]]
        for u in g.predecessors(v):
            if (u, dev) not in arrival:
                raise ValueError(f"the plan runs {v!r} before its input {u!r}: order the stages so every "
                                 "input comes from the same or an earlier stage")
            ready.append(arrival[(u, dev)])
        start[v] = max(ready)
        finish[v] = free[dev] = arrival[(v, dev)] = start[v] + problem.node_time(v, devices[dev])
        order[dev].append(v)
        for dst in sorted({device_of[w] for w in g.successors(v)} - {dev}):
            dur = problem.link_time(v, devices[dev], devices[dst])
            if dur > 0:
                begin = max(finish[v], out_port[dev], in_port[dst])
                out_port[dev] = in_port[dst] = arrival[(v, dst)] = begin + dur
                moved.append(Transfer(v, dev, dst, begin, begin + dur))
            else:  # a 0-s transfer holds no port
                arrival[(v, dst)] = finish[v]
    return Schedule(max(finish.values(), default=0.0), start, finish, device_of, order, moved)


# -- per stage (pictures and fidelity) ----------------------------------------------------------
def stage_costs(problem: Problem, stages: Sequence[StageLike]) -> list[StageCost]:
    """The cost of each stage on its own (:func:`device_cost` of its nodes), in plan order.

    For a device with one stage this is the device's cost; a device with several stages is
    charged per stage here, so a stage's load is what it adds to one micro-batch's pass through
    the pipeline (the predicted stage time that :mod:`torchplace.report` draws and compares).
    """
    recomputing = _recomputes(stages)
    return [device_cost(problem, set(s.nodes), problem.cluster.device(s.device), in_flight=1,
                        recompute=s.device in recomputing) for s in stages]


def training_stage_times(problem: Problem, stages: Sequence[StageLike]) -> list[tuple[str, float, float]]:
    """(device, forward seconds, backward seconds) of each stage that holds forward nodes, for the
    graph's unit of work (the whole batch), in plan order.

    A backward node belongs to the stage of the forward node it shares a colocation group with
    (the training graph pairs them so); one with no such partner is split evenly over its
    device's forward stages. A recomputing device's backward also runs its forward again.
    Forward stages pay their transfers as in :func:`device_cost`.
    """
    g = problem.graph
    forward = [s for s in stages if any(not g.record(v).backward for v in s.nodes)]
    group_stage = {g.record(v).colocation: i for i, s in enumerate(forward) for v in s.nodes
                   if not g.record(v).backward and g.record(v).colocation is not None}
    backward = [0.0] * len(forward)
    by_device: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(forward):
        by_device[s.device].append(i)
    recomputing = _recomputes(stages)
    for s in stages:
        device = problem.cluster.device(s.device)
        for v in s.nodes:
            r = g.record(v)
            if not r.backward:
                continue
            owners = [group_stage[r.colocation]] if r.colocation in group_stage else by_device.get(s.device, [])
            for i in owners:
                backward[i] += problem.node_time(v, device) / len(owners)
    out = []
    for i, s in enumerate(forward):
        device = problem.cluster.device(s.device)
        nodes = {v for v in s.nodes if not g.record(v).backward}
        fwd = math.fsum(problem.node_time(v, device) for v in nodes)
        t_in, t_out = transfers(problem, nodes) if device.pays_transfer else (0.0, 0.0)
        again = fwd if s.device in recomputing else 0.0
        out.append((s.device, fwd + t_in + t_out, backward[i] + again))
    return out
