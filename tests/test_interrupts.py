"""held_interrupt: Ctrl-C held over a block, raised once it is done."""
from __future__ import annotations

import signal
import threading

import pytest

from torchplace.interrupts import held_interrupt


def test_ctrl_c_in_the_block_is_raised_after_it_and_the_handler_put_back():
    done, asked = [], []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupt(lambda: asked.append(True)):
            signal.raise_signal(signal.SIGINT)
            done.append(True)  # the block runs to its end
    assert done == [True] and asked == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held_interrupt():
        pass  # no signal, nothing raised
    with pytest.raises(KeyboardInterrupt) as stopped:
        with held_interrupt():
            signal.raise_signal(signal.SIGINT)
            raise ValueError("what the stop made of the block")
    assert isinstance(stopped.value.__context__, ValueError)


def test_the_block_s_own_error_propagates_and_off_the_main_thread_nothing_changes():
    with pytest.raises(ValueError):
        with held_interrupt():
            raise ValueError("own")
    seen = []

    def off_main() -> None:
        with held_interrupt():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(10)
    assert seen == [signal.default_int_handler]
