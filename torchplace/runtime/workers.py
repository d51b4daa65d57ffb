"""Long-lived worker threads, one per plan device, shared by every executor's runs.

Each worker key (``"cuda:0"``, ``"cpu:1"``) gets a daemon thread, started on first use and kept for
later calls. CUDA libraries keep per-thread state (cuDNN and cuBLAS handles among it), so a thread
started for every call pays for it on every call: measured on an H100, a 28-operator CNN stage
took 19.4 ms per call from a fresh thread, 1.0 ms from a kept one and 0.9 ms in the caller's own.

A job still running when the next call needs its worker (a stage that ignored its run's stop
signal) keeps its thread; the worker gets a fresh one, so one stuck job never blocks later calls.
The threads hold no reference to their owner and end when it is garbage-collected.

:func:`peak_live_bytes` measures, while it is open, the tensor memory each worker's jobs
allocate (the measured side of the memory benchmarks and tests).

A worker may have its own count of intra-op threads (``Device.threads``; ``share_cores=True``
splits the machine's cores among the CPU devices). torch's OpenMP thread count is per calling thread, so each
job runs under :func:`~torchplace.machine.intra_op_threads` on its worker's thread, and two
logical CPUs no longer both spread every operator over all cores.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchplace.machine import intra_op_threads
from torchplace.profiling.livebytes import LiveBytes

__all__ = ["Job", "WorkerThreads", "peak_live_bytes"]

_peaks: list[dict[str, int]] = []  # open peak_live_bytes() measurements, innermost last


@contextlib.contextmanager
def peak_live_bytes() -> Iterator[dict[str, int]]:
    """While open, each job a worker thread runs is measured with
    :class:`~torchplace.profiling.livebytes.LiveBytes`; yields ``{worker: peak bytes}``, the most
    tensor memory one job of that worker's allocated and still held at once: what a call's stages
    or a training step's actions hold, counted on the thread that made each tensor (a logical
    CPU's memory; a copy a worker makes onto another device counts on that worker)."""
    peaks: dict[str, int] = {}
    _peaks.append(peaks)
    try:
        yield peaks
    finally:
        _peaks.remove(peaks)


def _measured(fn: Callable[..., Any], worker: str, peaks: dict[str, int]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        mode = LiveBytes()
        try:
            with mode:
                return fn(*args)
        finally:
            peaks[worker] = max(peaks.get(worker, 0), mode.peak)
    return run


class Job:
    """One submitted call; ``is_alive`` and ``join`` read like a thread's."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None  # what escaped the callable, if anything

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the job has run; False if ``timeout`` passed first."""
        return self._done.wait(timeout)


@dataclass
class _Slot:
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    current: Job | None = None


def _serve(jobs: queue.SimpleQueue) -> None:
    """A worker thread: run jobs until told to stop (``None``)."""
    while (item := jobs.get()) is not None:
        fn, args, job, threads = item
        del item
        try:
            with intra_op_threads(threads):
                fn(*args)
        except BaseException as error:  # noqa: BLE001 - the thread must live on for later calls
            job.error = error
        finally:
            job._done.set()
        del fn, args, job  # hold nothing of the owner between calls


def _stop(slots: dict[str, _Slot]) -> None:
    for slot in slots.values():
        slot.jobs.put(None)


class WorkerThreads:
    """One kept thread per worker key (see the module docstring).

    Args:
        prefix: thread names are ``torchplace-<prefix>-<worker>``.
        threads: intra-op threads per worker (missing or ``None``: the submitting thread's
            count at each call, so a worker computes as the caller would, even after the caller
            changed ``torch.set_num_threads``; CPU kernels round by thread count).
    """

    def __init__(self, prefix: str, threads: Mapping[str, int | None] | None = None) -> None:
        self._prefix = prefix
        self.threads = dict(threads or {})
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _stop, self._slots)

    def submit(self, worker: str, fn: Callable[..., Any], *args: Any) -> Job:
        """Run ``fn(*args)`` on ``worker``'s thread; returns at once. Meant for one job per worker
        at a time (a run's): a worker whose last job is still running gets a fresh thread."""
        job = Job()
        if _peaks:
            fn = _measured(fn, worker, _peaks[-1])
        with self._lock:
            slot = self._slots.get(worker)
            if slot is None or (slot.current is not None and slot.current.is_alive()):
                fresh = _Slot()
                threading.Thread(target=_serve, args=(fresh.jobs,), name=f"torchplace-{self._prefix}-{worker}",
                                 daemon=True).start()  # may raise ("can't start new thread"): nothing changed yet
                if slot is not None:
                    slot.jobs.put(None)  # the busy thread ends after its job
                slot = self._slots[worker] = fresh
            slot.current = job
            threads = self.threads.get(worker)
            slot.jobs.put((fn, args, job, torch.get_num_threads() if threads is None else threads))
        return job

    def busy(self) -> list[str]:
        """Workers whose latest job has not finished (after a run: none, unless a stage hangs)."""
        with self._lock:
            return [w for w, slot in self._slots.items() if slot.current is not None and slot.current.is_alive()]
