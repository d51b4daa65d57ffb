"""Kept worker threads (torchplace.runtime.workers)."""
from __future__ import annotations

import threading

from torchplace.runtime.workers import WorkerThreads


def test_jobs_of_one_worker_share_a_thread_and_errors_do_not_kill_it() -> None:
    pool = WorkerThreads("test")
    idents: list[int] = []
    for _ in range(3):  # one call after another, as the executors' runs are
        assert pool.submit("a", lambda: idents.append(threading.get_ident())).join(5)
    failing = pool.submit("a", lambda: 1 / 0)
    assert failing.join(5) and isinstance(failing.error, ZeroDivisionError)
    assert pool.submit("a", lambda: idents.append(threading.get_ident())).join(5)
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    assert pool.busy() == []


def test_a_stuck_job_does_not_block_the_next_call() -> None:
    pool = WorkerThreads("test")
    release = threading.Event()
    stuck = pool.submit("a", release.wait)
    assert pool.busy() == ["a"]
    done = pool.submit("a", lambda: None)  # a fresh thread takes the worker
    assert done.join(5) and stuck.is_alive()
    release.set()
    assert stuck.join(5)


def test_a_worker_without_its_own_threads_computes_with_the_callers_count() -> None:
    """A thread started before the caller's torch.set_num_threads would keep the old count and
    round differently from the caller; each job takes the caller's count at submit time."""
    import torch

    workers = WorkerThreads("test")
    seen = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        workers.submit("cpu:0", lambda: seen.append(torch.get_num_threads())).join(10)  # the thread starts
        torch.set_num_threads(1)
        workers.submit("cpu:0", lambda: seen.append(torch.get_num_threads())).join(10)
        assert seen == [2, 1]
        own = WorkerThreads("test", {"cpu:0": 2})
        own.submit("cpu:0", lambda: seen.append(torch.get_num_threads())).join(10)
        assert seen[-1] == 2  # a device with its own threads keeps them
    finally:
        torch.set_num_threads(before)
