"""Problem: everything a solver sees — the graph, the cluster, the objective and the mode."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchplace.devices import Cluster, Device
from torchplace.graph import OpGraph

__all__ = ["Mode", "Objective", "Problem"]

Objective = Literal["throughput", "latency"]
Mode = Literal["inference", "training"]


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
        contiguous: whether each device must hold one contiguous subgraph (Tarnawski Def. 3.1).
    """

    graph: OpGraph
    cluster: Cluster
    objective: Objective = "throughput"
    mode: Mode = "inference"
    contiguous: bool = True

    def __post_init__(self) -> None:
        if self.objective not in ("throughput", "latency"):
            raise ValueError(f"objective must be 'throughput' or 'latency', got {self.objective!r}")
        if self.mode not in ("inference", "training"):
            raise ValueError(f"mode must be 'inference' or 'training', got {self.mode!r}")
        self.graph.check_dag()

    def transfer_time(self, node: str) -> float:
        """Seconds to move ``node``'s output across a device boundary (paid once per crossing side)."""
        r = self.graph.record(node)
        return r.transfer_time if r.transfer_time is not None else self.cluster.transfer_time(r.output_bytes)

    def node_time(self, node: str, device: Device) -> float:
        """Seconds ``node`` takes on ``device`` (``inf`` if it cannot run there)."""
        return self.graph.record(node).time_on(device.kind)
