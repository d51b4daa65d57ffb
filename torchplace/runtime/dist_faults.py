"""Faults of a multi-process run: every rank ends with an error that names the rank and stage
that failed, and no rank waits forever.

The processes share the rendezvous store of ``torch.distributed`` (a ``TCPStore``). Two keys:

* ``torchplace/fault/N``: the first failure of the ``N``-th placement of the launch (each has its
  own key, so a placement after a failed one starts clean), ``"rank R failed in stage S (forward
  of micro-batch i): ValueError: ..."``, written (once: ``compare_set``) by the rank that raised, or
  by the first rank that noticed a peer stop;
* ``torchplace/hb/R``: rank ``R``'s heartbeat, a counter and what it runs, written every
  :data:`BEAT_S` seconds by its :class:`Faults` thread.

What happens:

1. A rank whose stage (or loss) raises writes the fault and raises
   :class:`~torchplace.errors.DistributedError` with the same message from ``step`` / ``run``.
2. A rank blocked in a send or receive gets the backend's error when a peer's process ends
   (gloo: "Connection closed by peer"): it reads the fault (waiting up to :data:`SETTLE_S`), or
   else finds the rank whose heartbeat stopped (a killed process), publishes that, and raises
   :class:`~torchplace.errors.DistributedError` naming it.
3. A rank still inside ``step`` / ``run`` :data:`GRACE_S` seconds after it saw a peer's fault (it
   waits on a live peer: one that caught the error, or one that waits too) prints the fault on
   stderr and exits with status 1, from its heartbeat thread (a blocked backend call cannot be
   interrupted from Python).
4. Anything else is bounded by the process group's timeout (``init_process_group(timeout=...)``).

So after one rank fails every rank ends within :data:`GRACE_S` + :data:`BEAT_S` seconds of the
fault's publication (those that get the backend's error sooner, within :data:`SETTLE_S`), and at
worst within the process group's timeout.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from torchplace.errors import DistributedError

__all__ = ["BEAT_S", "GRACE_S", "SETTLE_S", "Activity", "Faults", "first_line"]

BEAT_S = 0.25
"""Seconds between heartbeats."""

SETTLE_S = 3.0
"""Seconds a rank that lost a peer waits for the fault report or for the dead peer's heartbeat to stop."""

GRACE_S = 5.0
"""Seconds a rank still running a step may take to end by itself after a fault was published."""

FAULT = "torchplace/fault"
"""The fault key (of the placement ``N``: ``f"{FAULT}/{N}"``)."""


class Activity:
    """What this rank runs now (engine stage, pass, micro-batch), named in fault messages."""

    def __init__(self, publish: Callable[[str], None] | None = None) -> None:
        self.now = "setting up"
        self._publish = publish
        self._phase: tuple[int, str] | None = None

    def set(self, stage: int, kind: str, chunk: int | None = None) -> None:
        """Record what runs; when the stage or pass changes, publish it at once (a killed process
        sends no more heartbeats, so its last one must already name the stage it died in)."""
        self.now = f"stage {stage} ({kind}{'' if chunk is None else f' of micro-batch {chunk}'})"
        if self._publish is not None and (stage, kind) != self._phase:
            self._phase = (stage, kind)
            self._publish(self.now)


def _communication_error(error: BaseException) -> bool:
    """Whether ``error`` is the backend reporting a lost peer or a timeout, not a stage's own error."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistBackendError", ())):
        return True
    text = str(error).lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                                   "gloo", "nccl", "socket"))


class Faults:
    """The fault reports and heartbeat of one rank (see the module docstring).

    Args:
        store: the rendezvous store (``torch.distributed.distributed_c10d._get_default_store()``).
        rank, world: this rank and the number of ranks.
        exit_on_peer_fault: end this process (status 1) when a peer's fault leaves it blocked
            for :data:`GRACE_S` seconds; ``False`` only waits for the process group's timeout.
        key: the store key of the fault (one per placement: ``f"{FAULT}/{N}"``).
    """

    def __init__(self, store: Any, rank: int, world: int, exit_on_peer_fault: bool = True, key: str = FAULT) -> None:
        self.store, self.rank, self.world, self.key = store, rank, world, key
        self.activity = Activity(self._heartbeat)
        self.exit_on_peer_fault = exit_on_peer_fault
        self._busy_since: float | None = None
        self._beats = 0
        self._seen: float | None = None  # when this rank first saw a peer's fault while busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"torchplace-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S + 1)

    # -- the main thread ----------------------------------------------------------------------------
    def guard(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, its failure reported to every rank and raised as :class:`DistributedError`."""
        self._busy_since = time.monotonic()
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - every failure is reported to the other ranks
            raise self._failure(error) from error
        finally:
            self._busy_since = None

    def _failure(self, error: BaseException) -> DistributedError:
        reported = self.fault()
        if reported is None and _communication_error(error):
            reported = self._wait_for_fault() or self._publish(self._lost_peers(error))
        if reported is None:
            cause = error.__cause__ or error.__context__
            reported = self._publish(f"rank {self.rank} failed in {self.activity.now}: "
                                     f"{type(error).__name__}: {first_line(error)}"
                                     + (f" (from {type(cause).__name__}: {first_line(cause)})" if cause else ""))
        if not reported.startswith(f"rank {self.rank} "):
            reported = f"{reported}; rank {self.rank} stopped in {self.activity.now}"
        return DistributedError(reported)

    def fault(self) -> str | None:
        """The fault some rank published, or ``None``."""
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode()
        except Exception:  # noqa: BLE001 - the store's host is gone
            return None
        return None

    def _publish(self, message: str) -> str:
        """Publish ``message`` as the fault unless one is already there; return the fault."""
        try:
            self.store.compare_set(self.key, "", message)
            return self.store.get(self.key).decode()
        except Exception:  # noqa: BLE001 - the store's host is gone: report what this rank knows
            return message

    def _wait_for_fault(self) -> str | None:
        end = time.monotonic() + SETTLE_S / 2
        while time.monotonic() < end:
            found = self.fault()
            if found is not None:
                return found
            time.sleep(BEAT_S / 2)
        return None

    def _lost_peers(self, error: BaseException) -> str:
        """Name the ranks whose heartbeat stopped; the store's host if the store is gone."""
        try:
            before = self._beats_of_others()
            time.sleep(SETTLE_S / 2)
            after = self._beats_of_others()
        except Exception:  # noqa: BLE001
            return ("rank 0 stopped (killed or crashed): the rendezvous store it hosts no longer answers "
                    f"(rank {self.rank} saw {type(error).__name__}: {first_line(error)})")
        dead = [r for r in before if before[r][0] == after.get(r, ("", ""))[0]]
        if not dead:
            return f"rank {self.rank} lost a peer in {self.activity.now}: {type(error).__name__}: {first_line(error)}"
        return "; ".join(f"rank {r} stopped (killed or crashed) in {before[r][1]}" for r in dead)

    def _beats_of_others(self) -> dict[int, tuple[str, str]]:
        out = {}
        for r in range(self.world):
            if r != self.rank and self.store.check([f"torchplace/hb/{r}"]):
                count, _, now = self.store.get(f"torchplace/hb/{r}").decode().partition("|")
                out[r] = (count, now)
        return out

    # -- the heartbeat thread -------------------------------------------------------------------------
    def _heartbeat(self, now: str) -> None:
        self._beats += 1
        try:
            self.store.set(f"torchplace/hb/{self.rank}", f"{self._beats}|{now}")
        except Exception:  # noqa: BLE001 - the store's host is gone; the backend's errors tell the rest
            pass

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._heartbeat(self.activity.now)
                if self._busy_since is not None and self.exit_on_peer_fault:
                    self._exit_if_peer_failed()
            except Exception:  # noqa: BLE001 - the store's host is gone; the backend's timeout ends the run
                continue

    def _exit_if_peer_failed(self) -> None:
        """End the process when a peer's fault has been published for :data:`GRACE_S` seconds and this
        rank is still inside a step (blocked in the backend, which Python cannot interrupt)."""
        found = self.fault()
        if found is None or found.startswith(f"rank {self.rank} "):
            return
        if self._seen is None:
            self._seen = time.monotonic()
        elif time.monotonic() - self._seen > GRACE_S and self._busy_since is not None:
            print(f"torchplace: error: {found}; rank {self.rank} stopped in {self.activity.now}", file=sys.stderr,
                  flush=True)
            os._exit(1)


def first_line(error: BaseException) -> str:
    """The error's message on one line, at most 400 characters (the engine's run over several)."""
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:397] + "..."
