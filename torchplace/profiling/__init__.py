"""Profiling: trace a model into an OpGraph and measure (or estimate) what each node costs."""
from torchplace.fxutil import TensorInfo
from torchplace.profiling.estimate import DEVICE_SPECS, DeviceSpec, estimate_times
from torchplace.profiling.profile import present_kinds, profile
from torchplace.profiling.trace import Traced, trace

__all__ = [
    "DEVICE_SPECS",
    "DeviceSpec",
    "TensorInfo",
    "Traced",
    "estimate_times",
    "present_kinds",
    "profile",
    "trace",
]
