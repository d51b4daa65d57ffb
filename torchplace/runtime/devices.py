"""Devices, CUDA streams and autograd modes for the executors' worker threads.

Shared by :mod:`~torchplace.runtime.pipeline` and :mod:`~torchplace.runtime.latency`. CUDA rules:
copies to CUDA are ``non_blocking``; copies to the CPU are blocking (a non-blocking device-to-host
copy could be read before it lands); a tensor used on another stream is marked with
``record_stream``; a consumer's stream waits on the producer's event when both are on one device,
and its thread synchronizes on the event otherwise.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from torchplace.errors import StageError, UnsupportedError

__all__ = [
    "as_stage_error",
    "autograd_mode",
    "check_autocast",
    "check_eager_call",
    "copy_to",
    "move_module",
    "normalize_device",
    "stream_context",
    "to_device",
    "wait_for_producers",
]


@contextmanager
def random_state_kept() -> Iterator[None]:
    """A block after which the random number generators are as it found them: the CPU's, and each
    CUDA device's already in use (``torch.random.fork_rng``). Where the block is the first to use
    CUDA (seed, build the model on the CPU, then place it on GPUs), the CUDA generators it started
    are seeded again with ``torch.initial_seed()``, as the first use after the block would have
    found them (``torch.manual_seed`` seeds them so when CUDA starts)."""
    started = torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if started else []):
        try:
            yield
        finally:
            if not started and torch.cuda.is_initialized():
                torch.cuda.manual_seed_all(torch.initial_seed())


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


ALIGNMENT = 64
"""Bytes of a tensor's storage offset its copies keep (:func:`copy_to`): the CPU allocator aligns
storage to 64 bytes, the CUDA caching allocator to 512, and vector loads need at most 64."""


def copy_to(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` laid out as it is: the same strides, and its storage
    offset's place within :data:`ALIGNMENT` bytes.

    ``Tensor.to`` and ``clone`` give a view with gaps (``x[:, :-1]``) contiguous strides and any
    view a fresh, aligned start. A kernel reading such a copy may take another path than on the
    original and round differently: measured on the CPU, a Linear on ``x[:, :-1]`` and on its
    contiguous copy differ by 1.2e-7. The copy keeps the gaps only where they are at most
    :data:`GAPS` times its elements (a view that picks a few rows of a large tensor, ``x[:, 0]``
    of BERT's hidden states, would carry 448 times its bytes, which the memory model does not
    charge): otherwise it is dense, its dimensions in the original's order. A tensor whose elements
    overlap (an ``expand``) is copied by ``Tensor.to``, as one that is not strided.
    """
    if tensor.layout != torch.strided or tensor.numel() == 0 or _overlaps(tensor):
        return tensor.to(device, non_blocking=non_blocking, copy=True)
    item = tensor.element_size()
    shift = tensor.storage_offset() * item % ALIGNMENT // item
    strides = tensor.stride()
    extent = 1 + sum((n - 1) * step for n, step in zip(tensor.shape, strides))
    if extent > (1 + GAPS) * tensor.numel():
        strides, extent = _dense_strides(tensor), tensor.numel()
    storage = torch.empty(shift + extent, dtype=tensor.dtype, device=device)
    return storage.as_strided(tensor.shape, strides, shift).copy_(tensor, non_blocking=non_blocking)


GAPS = 7.0
"""The most a copy of a view keeps of its gaps, as a multiple of its elements (:func:`copy_to`):
a chunk of a strided slice (``h[:, ::2].chunk(2, -1)``, 3.6 times its elements, which BatchNorm
reads with other rounding when dense) keeps its layout; one row of a sequence per sample
(``x[:, 0]``, 448 times) is copied dense, which the matrix kernels read alike."""


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``tensor``'s shape whose dimensions lie in memory in the order
    ``tensor``'s do (the largest stride outermost)."""
    order = sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), d))  # innermost first
    strides, step = [0] * tensor.dim(), 1
    for d in order:
        strides[d] = step
        step *= tensor.shape[d]
    return tuple(strides)


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory: unless, its dimensions sorted by
    stride, each stride passes the extent of those before it."""
    reach = 0
    for step, n in sorted((step, n) for n, step in zip(tensor.shape, tensor.stride()) if n > 1):
        if step <= reach:
            return True
        reach += (n - 1) * step
    return False


def to_device(value: Any, device: torch.device, stream: Any) -> Any:
    """Move every tensor in ``value`` to ``device`` (see the module docstring for CUDA rules), each
    laid out as it is (:func:`copy_to`)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            if stream is not None:
                tensor.record_stream(stream)
            return tensor
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return copy_to(tensor, device, non_blocking=device.type == "cuda")

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


def caller_autocast() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """The caller's ``torch.autocast`` settings (thread-local, like the grad mode: a worker thread
    must enter them again, or it computes in the default precision)."""
    return tuple((kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
                 for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind))


def check_autocast(guards: Sequence[str]) -> None:
    """Refuse a call under ``torch.autocast`` of a graph with dtype checks in place of conversions, or
    dtypes fixed as the trace saw them (:func:`torchplace.fxutil.dtype_guards`), before any stage runs.

    Raises:
        UnsupportedError: saying why and what runs instead.
    """
    if guards and caller_autocast():
        raise UnsupportedError(
            f"this model was traced by torch.export, which fixed the dtypes of {len(guards)} of its dtype conversions "
            "and tensor constructors as it saw them without autocast: a conversion that converted nothing is a check "
            "(x.float(), .to(torch.float32), type_as: RMSNorm and the like), and a dtype read from a tensor "
            "(.to(h.dtype), torch.full(..., dtype=h.dtype), torch.finfo(h.dtype).min) stays float32's; under "
            "torch.autocast they convert, so the placed graph would not compute what the model does (a dtype check "
            "fails, or outputs and gradients differ). Call the placed model without autocast "
            "(for bfloat16 compute, convert the model with model.to(torch.bfloat16) before placing it), or place it "
            "traced by torch.fx, whose graph autocast runs as it runs the model: trace_method='fx', with the modules "
            "fx cannot trace (one that enters torch.autocast itself, say) kept whole by leaf_modules=[...]")


def check_eager_call() -> None:
    """Refuse a call of a placed model under a function transform (``torch.func.vmap``, ``grad``,
    ``jacrev``, ...) or ``torch.jit.trace``, before any stage runs: the stages run on worker threads
    and other devices, where neither the transform nor the tracer follows them.

    Raises:
        UnsupportedError: saying what to transform or trace instead.
    """
    if torch.jit.is_tracing():
        raise UnsupportedError(
            "torch.jit.trace cannot record a placed model: its stages run on worker threads (and other devices) "
            "the tracer does not follow. Trace or export the original model, or call the placed model as it is")
    if torch._C._are_functorch_transforms_active():
        raise UnsupportedError(
            "a placed model cannot run under a torch.func transform (vmap, grad, jacrev, ...): its stages run on "
            "worker threads (and other devices) the transform does not follow. Apply the transform to the original "
            "model, or call the placed model on the whole batch (it takes gradients with .backward())")


@contextmanager
def autocast_of(settings: Sequence[tuple[str, torch.dtype, bool]]) -> Iterator[None]:
    """Enter the autocast settings :func:`caller_autocast` took."""
    with ExitStack() as stack:
        for kind, dtype, cache in settings:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        yield


@contextmanager
def autograd_mode(grad_enabled: bool, inference_mode: bool,
                  autocast: Sequence[tuple[str, torch.dtype, bool]] = ()) -> Iterator[None]:
    """Apply the caller's thread-local autograd and autocast modes in a worker thread."""
    with torch.inference_mode(inference_mode), torch.set_grad_enabled(grad_enabled), autocast_of(autocast):
        yield


def as_stage_error(worker: str, error: BaseException) -> StageError:
    """``error`` as the :class:`~torchplace.errors.StageError` a worker reports (chained from it)."""
    if isinstance(error, StageError):
        return error
    wrapped = StageError(f"worker {worker} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
