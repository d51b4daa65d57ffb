"""Profiling: trace a model into an OpGraph and measure (or estimate) what each node costs."""
from torchplace.profiling.estimate import DEVICE_SPECS, DeviceSpec, estimate_times
from torchplace.profiling.profile import present_kinds, profile
from torchplace.profiling.trace import TensorInfo, Traced, trace

__all__ = [
    "trace",
    "profile",
    "Traced",
    "TensorInfo",
    "estimate_times",
    "DeviceSpec",
    "DEVICE_SPECS",
    "present_kinds",
]
