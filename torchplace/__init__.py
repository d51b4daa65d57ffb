"""torchplace: decide where every part of a model runs, prove how good that is, and run it there.

    import torchplace
    placed = torchplace.place(model, ["cuda:0", "cpu"], example_inputs=(x,))
    y = placed(x)
    print(placed.plan)
"""
from torchplace.devices import Cluster, Device, make_cluster, parse_memory
from torchplace.errors import (
    DistributedError,
    InfeasibleError,
    InvalidPlanError,
    MicrobatchError,
    MissingDependencyError,
    ModelTooLargeError,
    PlacementWarning,
    SolverError,
    SolverLimitError,
    StageError,
    TooManyIdealsError,
    TorchplaceError,
    TraceError,
    UnsupportedError,
    UsageError,
    WorkloadFormatError,
)
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem

__version__ = "0.1.0"

_LAZY = {"place", "placed", "plan_model", "PlacedModule"}  # need torch; imported on first use so solvers stay torch-free
_LAZY_HF = {"infer_device_map", "plan_device_map"}  # Hugging Face device maps (torchplace.hf), also lazy


def __getattr__(name: str):
    if name in _LAZY:
        from torchplace import api

        return getattr(api, name)
    if name in _LAZY_HF:
        from torchplace import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'torchplace' has no attribute {name!r}")


__all__ = [
    "Cluster",
    "Device",
    "DistributedError",
    "InfeasibleError",
    "InvalidPlanError",
    "MicrobatchError",
    "MissingDependencyError",
    "ModelTooLargeError",
    "NodeRecord",
    "OpGraph",
    "PlacedModule",
    "PlacementWarning",
    "Plan",
    "Problem",
    "SolverError",
    "SolverLimitError",
    "Stage",
    "StageError",
    "TooManyIdealsError",
    "TorchplaceError",
    "TraceError",
    "UnsupportedError",
    "UsageError",
    "WorkloadFormatError",
    "infer_device_map",
    "make_cluster",
    "parse_memory",
    "place",
    "placed",
    "plan_device_map",
    "plan_model",
]
