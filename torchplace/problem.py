"""Problem: everything a solver sees — the graph, the cluster, the objective and the mode."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torchplace.devices import Cluster, Device
from torchplace.graph import OpGraph

__all__ = ["Coarsened", "Mode", "Objective", "Parallel", "Pipeline", "Problem", "Schedule"]

Objective = Literal["throughput", "latency"]
Mode = Literal["inference", "training"]
Schedule = Literal["gpipe", "1f1b"]
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Pipeline:
    """How a training pipeline runs, which decides the memory its activations take.

    Attributes:
        microbatches: ``m``, the micro-batches of one step; the graph's unit of work (its times and
            bytes) is the whole step's batch, so one micro-batch is ``1/m`` of its activations.
        schedule: ``"gpipe"`` (fill-drain: every device holds the activations of all ``m``
            micro-batches before the first backward) or ``"1f1b"`` (PipeDream-flush: the device at
            position ``j`` of ``S`` in the pipeline holds at most ``min(m, S - j)``; Narayanan et
            al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021).
        recompute: whether a solver may let a device recompute its activations in the backward
            pass (keeping only its inputs, at the cost of running its forward nodes again).
    """

    microbatches: int = 1
    schedule: Schedule = "1f1b"
    recompute: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive whole number, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


@dataclass(frozen=True)
class Parallel:
    """Piper's training setting (Sec. 3.6): ``devices`` identical accelerators of ``memory_bytes``
    each on a flat network of ``bandwidth`` bytes/s, and at most ``microbatches`` (``N``) micro-
    batches in a batch, which bounds the sum of data-parallel degrees. A stage may be replicated
    ``d`` ways (``d`` divides ``N``) and tensor-split ``t`` ways over the TMPCs of its nodes
    (:attr:`~torchplace.graph.NodeRecord.tmpcs`); its cost is
    :func:`torchplace.costmodel.piper_stage`.
    """

    devices: int
    memory_bytes: float
    bandwidth: float
    microbatches: int

    def __post_init__(self) -> None:
        for name in ("devices", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Parallel.{name} must be a positive whole number, got {v!r}")
        for name in ("memory_bytes", "bandwidth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise ValueError(f"Parallel.{name} must be a positive finite number, got {v!r}")

    @property
    def memory_limit(self) -> float:
        """The bytes a stage may need per device: the whole bytes of ``memory_bytes`` (the cost
        model rounds a stage's memory up to whole bytes, so a stage of 10.5 bytes does not fit in
        10.7; it fits exactly when its unrounded memory is at most this)."""
        return float(math.floor(self.memory_bytes))

    @property
    def max_in_flight(self) -> int:
        """The largest useful sum of data-parallel degrees: ``min(N, K)``."""
        return min(self.microbatches, self.devices)


@dataclass(frozen=True)
class Coarsened:
    """Where a coarse problem's graph came from (:meth:`torchplace.fusion.Coarsening.coarse_problem`).

    Attributes:
        original: the original graph.
        graph: the coarse graph made from it, kept to tell the problem it was made for from one
            derived with other records (a solver's relaxation or restriction: another graph, and
            its own memory).
        members: coarse node id -> its original node ids (``Coarsening.mapping``).
    """

    original: OpGraph
    graph: OpGraph
    members: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class Problem:
    """A placement problem.

    Attributes:
        graph: the operator DAG with costs.
        cluster: devices, memory and links.
        objective: ``"throughput"`` minimises the max stage load (time per sample of a pipeline);
            ``"latency"`` minimises the makespan of one sample.
        mode: ``"inference"`` or ``"training"`` (backward nodes present and colocated with their
            forward nodes).
        contiguous: whether each device must hold one contiguous piece (Tarnawski Def. 3.1) per
            side (forward / backward), with the devices' pieces in an order in which data only
            flows forward — the space of the ideals DP (Fact 5.2). ``False`` lets a device hold
            several pieces (Sec. 5.2).
        pipeline: for a training graph profiled from a model, how its pipeline runs (memory of
            activations in flight, recomputation); for inference on a profiled graph only its
            ``microbatches`` matter (working memory is one micro-batch's liveness peak,
            :func:`torchplace.costmodel.working_memory`); ``None`` for graphs whose per-node memory
            is given as it is (the published workloads) or one sample at a time (latency).
        parallel: Piper's data x tensor x pipeline setting; when set, a plan's stages carry their
            degrees and TMPCs and the cluster describes one device of the ``devices`` alike.
        coarsened: for a problem on a coarsened graph, the original graph and each coarse node's
            members: while ``graph`` is that coarse graph (the identity is checked: a problem
            derived with new records has its own memory), a device's memory with liveness, all of
            its kinds, is the original graph's for its members
            (:func:`torchplace.costmodel.memory_parts`), the memory its plan is checked against
            once expanded. ``None`` otherwise.
    """

    graph: OpGraph
    cluster: Cluster
    objective: Objective = "throughput"
    mode: Mode = "inference"
    contiguous: bool = True
    pipeline: Pipeline | None = None
    parallel: Parallel | None = None
    coarsened: Coarsened | None = None

    def __post_init__(self) -> None:
        if self.objective not in ("throughput", "latency"):
            raise ValueError(f"objective must be 'throughput' or 'latency', got {self.objective!r}")
        if self.mode not in ("inference", "training"):
            raise ValueError(f"mode must be 'inference' or 'training', got {self.mode!r}")
        self.graph.check_dag()
        self.graph.check_numbers()

    def transfer_time(self, node: str) -> float:
        """Seconds to move ``node``'s output across a device boundary (paid once per crossing side)."""
        r = self.graph.record(node)
        return r.transfer_time if r.transfer_time is not None else self.cluster.transfer_time(r.output_bytes)

    def link_time(self, node: str, src: Device, dst: Device) -> float:
        """Seconds to move ``node``'s output from ``src`` to ``dst`` (latency objective).

        In order: 0 on one device; the node's own per-pair time (``NodeRecord.link_times``); its
        per-side ``transfer_time`` paid by each end that pays transfers (the host-memory model of
        Tarnawski Sec. 3, so accelerator to accelerator pays twice, CPU to CPU nothing); else the
        cluster's link for the output's bytes when either end pays transfers or the cluster lists a
        link between them (two CPU-kind boxes on a network).
        """
        if src.name == dst.name:
            return 0.0
        r = self.graph.record(node)
        pair = f"{src.name}->{dst.name}"
        if pair in r.link_times:
            return r.link_times[pair]
        if r.transfer_time is not None:
            return r.transfer_time * (src.pays_transfer + dst.pays_transfer)
        if not (src.pays_transfer or dst.pays_transfer or self.cluster.has_explicit_link(src.name, dst.name)):
            return 0.0  # logical CPUs share host memory
        return self.cluster.link_time(r.output_bytes, src.name, dst.name)

    def node_time(self, node: str, device: Device) -> float:
        """Seconds ``node`` takes on ``device`` (``inf`` if it cannot run there)."""
        return self.graph.record(node).time_on(device.kind)
