"""Analytic (roofline) time estimates for device kinds this machine does not have.

Each fx node is run once on the CPU under :class:`torch.utils.flop_counter.FlopCounterMode` to
count its FLOPs; the bytes it moves are the bytes of its input and output tensors (plus a called
module's parameters). On a device of kind ``k`` with spec ``s = DEVICE_SPECS[k]``::

    time = max(flops / s.peak_flops, bytes / s.mem_bandwidth) + s.overhead

the roofline model (Williams, Waterman & Patterson, CACM 2009) plus a fixed per-op launch cost.
It ignores caching, fusion and the fact that views move no data, so it is an estimate to rank
placements when no device is present to measure, not a measurement.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from torchplace.errors import UsageError
from torchplace.fxutil import Interpreter, is_compute, tensor_bytes
from torchplace.profiling.effects import StateSnapshot
from torchplace.profiling.trace import Traced

__all__ = ["DEVICE_SPECS", "DeviceSpec", "NodeCost", "estimate_times", "node_costs"]


@dataclass(frozen=True)
class DeviceSpec:
    """Roofline parameters of a device kind.

    Attributes:
        peak_flops: FLOP/s the device reaches on large dense kernels.
        mem_bandwidth: bytes/s between the device's memory and its compute units.
        overhead: seconds of fixed cost per operator (kernel launch, dispatch).
    """

    peak_flops: float
    mem_bandwidth: float
    overhead: float


DEVICE_SPECS: dict[str, DeviceSpec] = {
    # NVIDIA A100 (40 GB): 19.5 TFLOP/s FP32 (no tensor cores), 1.555 TB/s HBM2, ~5 us launch.
    "cuda": DeviceSpec(peak_flops=19.5e12, mem_bandwidth=1.555e12, overhead=5e-6),
    # A generic inference accelerator: higher peak, lower bandwidth, costlier dispatch.
    "accel": DeviceSpec(peak_flops=50e12, mem_bandwidth=0.8e12, overhead=10e-6),
    # A server CPU socket: ~1 TFLOP/s FP32 with AVX-512, ~100 GB/s DRAM, ~1 us per op.
    "cpu": DeviceSpec(peak_flops=1e12, mem_bandwidth=100e9, overhead=1e-6),
    # NVIDIA T4: 8.1 TFLOP/s FP32, 320 GB/s GDDR6 (the slow GPU of examples/clusters/two-gpus-and-cpu.json).
    "cuda-t4": DeviceSpec(peak_flops=8.1e12, mem_bandwidth=320e9, overhead=5e-6),
}


@dataclass(frozen=True)
class NodeCost:
    """Work of one fx node: FLOPs counted by FlopCounterMode and bytes read plus written."""

    flops: int
    bytes: int


class _CostCounter(Interpreter):
    """Runs the graph once, counting FLOPs and bytes of every compute node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.costs: dict[str, NodeCost] = {}

    def run_node(self, n: fx.Node) -> Any:
        if not is_compute(n):
            return super().run_node(n)
        counter = FlopCounterMode(display=False)
        with counter:
            out = super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        moved = tensor_bytes((args, kwargs)) + tensor_bytes(out) + _module_bytes(self.module, n)
        self.costs[n.name] = NodeCost(counter.get_total_flops(), moved)
        return out


def _module_bytes(gm: nn.Module, n: fx.Node) -> int:
    """Bytes of a called module's parameters and buffers (0 for other nodes)."""
    if n.op != "call_module":
        return 0
    sub = gm.get_submodule(str(n.target))
    return tensor_bytes([*sub.parameters(), *sub.buffers()])


def node_costs(traced: Traced, example_inputs: Sequence[Any],
               example_kwargs: Mapping[str, Any] | None = None) -> dict[str, NodeCost]:
    """FLOPs and bytes of each compute fx node, keyed by fx node name (one run on copies of the
    inputs; the model's parameters and buffers are restored afterwards)."""
    counter = _CostCounter(traced.gm)
    snapshot = StateSnapshot(traced.gm)
    try:
        with torch.no_grad():
            counter.run(*traced.flat_inputs(example_inputs, example_kwargs))
    finally:
        snapshot.restore()
    return counter.costs


def _roofline(cost: NodeCost, spec: DeviceSpec) -> float:
    return max(cost.flops / spec.peak_flops, cost.bytes / spec.mem_bandwidth) + spec.overhead


def estimate_times(traced: Traced, example_inputs: Sequence[Any], kind: str,
                   example_kwargs: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Roofline time of every OpGraph node on a device of ``kind``.

    Args:
        traced: the output of :func:`torchplace.profiling.trace`.
        example_inputs: the inputs the model was traced with.
        kind: a key of :data:`DEVICE_SPECS` (``"cuda"``, ``"accel"``, ``"cpu"``).
        example_kwargs: keyword inputs the model was traced with.

    Returns:
        Seconds per OpGraph node id: the sum of its fx nodes' roofline times.

    Raises:
        UsageError: (a ``ValueError``) for a kind with no :class:`DeviceSpec` (the message lists the
            known kinds).
    """
    if kind not in DEVICE_SPECS:
        raise UsageError(
            f"no device spec for kind {kind!r} to estimate times with (no such device is attached to time it "
            f"on): give the device one of the known kinds {sorted(DEVICE_SPECS)}, or add a DeviceSpec for "
            f"{kind!r} to torchplace.profiling.estimate.DEVICE_SPECS"
        )
    spec = DEVICE_SPECS[kind]
    costs = node_costs(traced, example_inputs, example_kwargs)
    return {
        node_id: sum(_roofline(costs[name], spec) for name in record.fx_nodes)
        for node_id, record in traced.graph.records()
    }
