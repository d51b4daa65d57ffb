"""Run a placed model: split its GraphModule into stages and execute them.

Two executors apply a plan: :class:`PipelineExecutor` (throughput: micro-batches through the
stages in order) and :class:`LatencyExecutor` (latency: one sample, each device's stages on its own
worker, every stage as soon as its inputs exist).

Typical use (the API layer does this)::

    stages = split_stages(gm, stage_of, num_stages)
    executor = PipelineExecutor(stages, stage_devices, stage_workers, GraphIO(gm))
    y = executor.run((x,), {}, microbatches=4)

This package never imports :mod:`torchplace.solvers`: it applies a plan, it does not make one.
"""
from torchplace.runtime.graph_io import GraphIO
from torchplace.runtime.latency import LatencyExecutor
from torchplace.runtime.pipeline import PipelineExecutor
from torchplace.runtime.schedule import clock_cycles, segments, worker_orders
from torchplace.runtime.spans import StageSpan
from torchplace.runtime.split import StageModule, split_stages

__all__ = [
    "GraphIO",
    "LatencyExecutor",
    "PipelineExecutor",
    "StageModule",
    "StageSpan",
    "clock_cycles",
    "segments",
    "split_stages",
    "worker_orders",
]
