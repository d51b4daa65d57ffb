"""Ctrl-C held back over a step that an interrupt would leave half done, then raised.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives.
Two places cannot take it there:

* an import: a module cut short in the middle of its first import leaves its package half
  initialised in ``sys.modules`` (``torch._dynamo``, which ``torch.export`` imports on first use,
  then fails every later export in the process with ``partially initialized module``);
* a native solver calling back into Python: HiGHS raises nothing out of its interrupt callback, so
  a ``KeyboardInterrupt`` raised there is dropped and the solve runs on to its time limit.

:func:`held_interrupt` installs a SIGINT handler for the block that only records the signal (and
tells a solver to stop, ``on_interrupt``), and once the block is done hands the signal to the
handler it replaced, which raises ``KeyboardInterrupt``.
Torch-free.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["held_interrupt"]


@contextmanager
def held_interrupt(on_interrupt: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, then raise ``KeyboardInterrupt``.

    Args:
        on_interrupt: called (on the main thread, from the signal handler) for each SIGINT in the
            block, e.g. to ask a solver to stop soon; it must not raise.

    Raises:
        KeyboardInterrupt: at the end of the block when SIGINT arrived in it (from the handler it
            replaced: the default one raises it), also when the block raised (its exception is the
            ``__context__``): a solver stopped by Ctrl-C may end in an error of its own.

    Only the main thread receives signals, and only a handler Python installed (the default one,
    or one a caller set) is replaced: elsewhere, or where SIGINT is ignored, the block runs as it is.

    Example:
        >>> with held_interrupt():
        ...     import json  # an import Ctrl-C cannot cut in half
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    caught: list[int] = []

    def record(signum: int, frame: object) -> None:
        caught.append(signum)
        on_interrupt()

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:  # over the block's own exception, if any: the user asked to stop
            previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
