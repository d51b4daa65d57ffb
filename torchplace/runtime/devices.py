"""Devices, CUDA streams and autograd modes for the executors' worker threads.

Shared by :mod:`~torchplace.runtime.pipeline` and :mod:`~torchplace.runtime.latency`. CUDA rules:
copies to CUDA are ``non_blocking``; copies to the CPU are blocking (a non-blocking device-to-host
copy could be read before it lands); a tensor used on another stream is marked with
``record_stream``; a consumer's stream waits on the producer's event when both are on one device,
and its thread synchronizes on the event otherwise.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from torchplace.errors import StageError

__all__ = [
    "as_stage_error",
    "autograd_mode",
    "move_module",
    "normalize_device",
    "stream_context",
    "to_device",
    "wait_for_producers",
]


def normalize_device(device: str | torch.device) -> torch.device:
    """``torch.device`` with an explicit index for CUDA (``"cuda"`` -> ``cuda:<current>``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def move_module(module: torch.nn.Module, device: torch.device, memo: dict[int, Any]) -> None:
    """Move a stage's parameters and buffers to ``device`` without touching shared containers.

    Tensors already on ``device`` are kept as they are (same objects). Others are replaced by
    copies; ``memo`` (keyed by the original tensor's id) makes a tensor used twice on one device,
    e.g. a tied weight, one copy.
    """
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.device != device:
                if id(param) not in memo:
                    moved = param.detach().to(device)
                    memo[id(param)] = torch.nn.Parameter(moved, param.requires_grad)
                sub._parameters[name] = memo[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                if id(buf) not in memo:
                    memo[id(buf)] = buf.to(device)
                sub._buffers[name] = memo[id(buf)]


def to_device(value: Any, device: torch.device, stream: Any) -> Any:
    """Move every tensor in ``value`` to ``device`` (see the module docstring for CUDA rules)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            if stream is not None:
                tensor.record_stream(stream)
            return tensor
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return tensor.to(device, non_blocking=device.type == "cuda")

    return tree_map_only(torch.Tensor, move, value)


def wait_for_producers(events: Sequence[tuple[torch.device, Any]], device: torch.device,
                        stream: Any) -> None:
    """Order this stage after the CUDA work that produced its inputs."""
    for event_device, event in events:
        if stream is not None and event_device == device:
            stream.wait_event(event)
        else:
            event.synchronize()


def stream_context(stream: Any) -> AbstractContextManager[Any]:
    """``torch.cuda.stream(stream)`` for a CUDA stream, a no-op for None."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


@contextmanager
def autograd_mode(grad_enabled: bool, inference_mode: bool) -> Iterator[None]:
    """Apply the caller's thread-local autograd modes in a worker thread."""
    with torch.inference_mode(inference_mode), torch.set_grad_enabled(grad_enabled):
        yield


def as_stage_error(worker: str, error: BaseException) -> StageError:
    """``error`` as the :class:`~torchplace.errors.StageError` a worker reports (chained from it)."""
    if isinstance(error, StageError):
        return error
    wrapped = StageError(f"worker {worker} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
