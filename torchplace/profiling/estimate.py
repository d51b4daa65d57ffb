"""Analytic (roofline) time estimates for device kinds this machine does not have.

Each fx node is run once on the CPU under :class:`torch.utils.flop_counter.FlopCounterMode` to
count its FLOPs; the bytes it moves are the bytes of its input and output tensors (plus a called
module's parameters); its dtype is that of its first floating output (else input). On a device of
kind ``k`` with spec ``s = DEVICE_SPECS[k]``::

    time = max(flops / s.peak(dtype), bytes / s.mem_bandwidth) + s.overhead

(:meth:`DeviceSpec.seconds`; ``s.peak(dtype)`` is the device's peak for that dtype: an A100's
tensor cores run float16 matmuls 16 times faster than its float32 units), the roofline model
(Williams, Waterman & Patterson, CACM 2009) plus a fixed per-op launch cost. It ignores caching,
fusion and the fact that views move no data, so it is an estimate to rank placements when no
device is present to measure, not a measurement.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
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
        peak_flops: FLOP/s the device reaches on large dense float32 kernels (and on any dtype
            ``dtype_peak_flops`` does not name).
        mem_bandwidth: bytes/s between the device's memory and its compute units.
        overhead: seconds of fixed cost per operator (kernel launch, dispatch).
        dtype_peak_flops: FLOP/s on large dense kernels by dtype name (``"float16"``,
            ``"bfloat16"``; a ``torch.dtype`` key is taken by its name), where it differs from
            ``peak_flops``: a GPU's tensor-core peaks.

    Example:
        >>> DeviceSpec(19.5e12, 1.555e12, 5e-6, {"float16": 312e12}).peak(torch.float16)
        312000000000000.0
    """

    peak_flops: float
    mem_bandwidth: float
    overhead: float
    dtype_peak_flops: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        table = {_dtype_name(k): v for k, v in dict(self.dtype_peak_flops).items()}
        bad = [(k, v) for k, v in table.items() if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0]
        if bad:
            raise UsageError(f"DeviceSpec.dtype_peak_flops maps dtype names to FLOP/s > 0, got {bad[0][0]!r}: "
                             f"{bad[0][1]!r}")
        object.__setattr__(self, "dtype_peak_flops", table)

    def peak(self, dtype: torch.dtype | str | None = None) -> float:
        """FLOP/s on large dense kernels in ``dtype``: its entry in ``dtype_peak_flops``, else
        ``peak_flops`` (also for ``None``)."""
        return self.dtype_peak_flops.get(_dtype_name(dtype), self.peak_flops) if dtype is not None else self.peak_flops

    def seconds(self, flops: float, nbytes: float, dtype: torch.dtype | str | None = None) -> float:
        """Roofline time of an operation doing ``flops`` in ``dtype`` and moving ``nbytes``:
        ``max(flops / peak(dtype), nbytes / mem_bandwidth) + overhead``."""
        return max(flops / self.peak(dtype), nbytes / self.mem_bandwidth) + self.overhead


def _dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float16`` / ``"torch.float16"`` / ``"float16"`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


DEVICE_SPECS: dict[str, DeviceSpec] = {
    # NVIDIA A100 (40 GB): 19.5 TFLOP/s FP32 (no tensor cores), 1.555 TB/s HBM2, ~5 us launch; dense
    # tensor-core peaks 312 TFLOP/s FP16 and BF16 (NVIDIA A100 Tensor Core GPU datasheet, "Peak
    # BFLOAT16 / FP16 Tensor Core 312 TF", 624 TF with sparsity, not counted). PyTorch runs float32
    # matmuls without TF32 by default (torch.backends.cuda.matmul.allow_tf32 is False), so FP32 stays.
    "cuda": DeviceSpec(peak_flops=19.5e12, mem_bandwidth=1.555e12, overhead=5e-6,
                       dtype_peak_flops={"float16": 312e12, "bfloat16": 312e12}),
    # A generic inference accelerator: higher peak, lower bandwidth, costlier dispatch (no datasheet:
    # one rate for every dtype).
    "accel": DeviceSpec(peak_flops=50e12, mem_bandwidth=0.8e12, overhead=10e-6),
    # A server CPU socket: ~1 TFLOP/s FP32 with AVX-512, ~100 GB/s DRAM, ~1 us per op (one rate: a
    # CPU without AMX runs 16-bit matmuls no faster than float32 ones).
    "cpu": DeviceSpec(peak_flops=1e12, mem_bandwidth=100e9, overhead=1e-6),
    # NVIDIA T4: 8.1 TFLOP/s FP32, 320 GB/s GDDR6 (the slow GPU of examples/clusters/two-gpus-and-cpu.json);
    # 65 TFLOP/s mixed-precision FP16 tensor cores (NVIDIA T4 datasheet, "Mixed Precision (FP16/FP32)
    # 65 TFLOPS"). Turing has no bfloat16 tensor cores: bfloat16 falls back to the FP32 peak.
    "cuda-t4": DeviceSpec(peak_flops=8.1e12, mem_bandwidth=320e9, overhead=5e-6, dtype_peak_flops={"float16": 65e12}),
}


@dataclass(frozen=True)
class NodeCost:
    """Work of one fx node: FLOPs counted by FlopCounterMode, bytes read plus written, and the
    dtype it computes in (its first floating output's, else input's; None without one)."""

    flops: int
    bytes: int
    dtype: str | None = None


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
        self.costs[n.name] = NodeCost(counter.get_total_flops(), moved, _compute_dtype(out, (args, kwargs)))
        return out


def _compute_dtype(*values: Any) -> str | None:
    """Name of the dtype of the first floating tensor among ``values``' pytree leaves, in order."""
    for value in values:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return _dtype_name(t.dtype)
    return None


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
        node_id: sum(spec.seconds(costs[n].flops, costs[n].bytes, costs[n].dtype) for n in record.fx_nodes)
        for node_id, record in traced.graph.records()
    }
