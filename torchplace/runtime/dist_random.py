"""The random numbers of the engine stages on many processes: a stream of their own for each.

In one process the stages draw their random numbers (dropout masks, ``torch.rand`` in a forward)
from the one default generator, in pipeline order, so no two draws repeat. Over
``torch.distributed`` every process has its own generator, and processes that start alike (every
rank seeds ``torch.manual_seed(0)`` to build the same model) draw alike: engine stage 1 on rank 1
drew the masks engine stage 0 drew on rank 0, and data-parallel copies drew each other's masks for
other micro-batches. Megatron-LM seeds each pipeline rank apart for the same reason.

Here each engine stage of each data-parallel copy draws from a stream of its own
(:class:`RandomStream`): at every call, each rank draws one seed from its default generator
(:func:`call_seed`; ranks that start alike draw the same one, and the user's seeding still decides
every call's numbers), and the stream of engine stage ``k`` of copy ``j`` starts from that seed
mixed with ``(k, j)``. Tensor-parallel ranks of one stage share the stream, so they draw the same
masks for the activations they all hold. The default generators are restored around each stage,
so its draws leave the caller's sequence as it was but for the one seed per call.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["RandomStream", "call_seed"]

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from ``values`` (SplitMix64's finaliser folded over them): distinct inputs give
    unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


def call_seed() -> int:
    """One seed for this call's streams, drawn from the default CPU generator (it advances once)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


class RandomStream:
    """The generator state engine stage ``stage`` of data-parallel copy ``copy`` draws from.

    :meth:`start` begins a call's stream; :meth:`drawing` runs one micro-batch's forward with the
    default generators of the CPU and of ``devices`` (CUDA indices) set to the stream, and puts the
    caller's back afterwards.
    """

    def __init__(self, stage: int, copy: int, devices: Sequence[int] = ()) -> None:
        self.stage, self.copy, self.devices = stage, copy, tuple(devices)
        self._seed: int | None = None
        self._states: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def start(self, seed: int) -> None:
        """Begin a call: the stream starts from ``seed`` mixed with this stage and copy."""
        self._seed, self._states = _mix(seed, self.stage, self.copy), None

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        if self._seed is None:
            raise RuntimeError("RandomStream.drawing() before start(): the pipeline starts every call's streams")
        with torch.random.fork_rng(devices=list(self.devices)):
            if self._states is None:
                torch.random.default_generator.manual_seed(self._seed)
                for i in self.devices:
                    torch.cuda.default_generators[i].manual_seed(self._seed)
            else:
                cpu, cuda = self._states
                torch.set_rng_state(cpu)
                for i, state in zip(self.devices, cuda):
                    torch.cuda.set_rng_state(state, i)
            yield
            self._states = (torch.get_rng_state(), [torch.cuda.get_rng_state(i) for i in self.devices])
