"""Profiling by operator signature (torchplace/profiling/signature.py, issue 16 item 4): the same
records as timing every node, nodes of one signature timed in their places and pooled, rare
signatures looped, repeats that stop when the median settles. Nothing here asserts a measured time."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import torchplace
from torchplace.errors import UsageError
from torchplace.fxutil import is_compute
from torchplace.profiling import profile, trace
from torchplace.profiling.cache import _structure
from torchplace.profiling.signature import BUDGET, LONG_RUN, Sampler, signature

profile_module = sys.modules["torchplace.profiling.profile"]


class Blocks(nn.Module):
    """Four identical blocks (same shapes), then a head of another width."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class WritesInPlace(nn.Module):
    """Four identical in-place adds: run twice, each would add twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        for _ in range(4):
            h.add_(1)
        return h + 1


@pytest.fixture
def traced_blocks():
    torch.manual_seed(0)
    model, x = Blocks().eval(), torch.randn(4, 16)
    with torch.no_grad():
        return model, x, trace(model, (x,))


def _signatures(traced, inputs: tuple) -> dict[str, object]:
    """Each compute fx node's signature on the example run (recorded by the sharing interpreter)."""
    seen: dict[str, object] = {}

    class Recording(profile_module._SharingInterpreter):
        def run_node(self, n):
            if is_compute(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                seen[n.name] = signature(n, self.module, args, kwargs)
            return super().run_node(n)

    with torch.no_grad():
        Recording(traced.gm, profile_module._CpuTimer, None, 0, 1).run(*traced.flat_inputs(inputs))
    return seen


def test_sharing_gives_the_records_of_per_node_profiling_but_times(traced_blocks):
    _, x, traced = traced_blocks
    shared = profile(traced, (x,), progress=False, warmup=0, repeats=2)
    exhaustive = profile(traced, (x,), progress=False, warmup=0, repeats=2, exhaustive=True)
    assert _structure(shared) == _structure(exhaustive)  # nodes, edges, bytes, names: exact
    assert set(shared) == set(exhaustive)
    for node_id, record in shared.records():
        assert set(record.times) == set(exhaustive.record(node_id).times) == {"cpu"}
        assert record.times["cpu"] > 0


def test_nodes_with_one_signature_share_one_measurement(traced_blocks):
    _, x, traced = traced_blocks
    sigs = _signatures(traced, (x,))
    fx_times = profile_module._measure_shared(traced, (x,), {}, "cpu", 1, 3, False)
    assert set(fx_times) == set(sigs)  # every compute node has a time
    by_sig: dict[object, set[float]] = {}
    for name, sig in sigs.items():
        by_sig.setdefault(sig, set()).add(fx_times[name])
    assert all(len(times) == 1 for times in by_sig.values())  # identical nodes get the shared median
    assert len(set(sigs.values())) < len(sigs)


def test_repeated_signatures_are_timed_in_their_places_and_rare_ones_in_a_loop(traced_blocks, monkeypatch):
    """The four blocks' linear, GELU and add are each timed once per block, in the graph run (one
    warm-up, then three samples: the most asked for); the head's linear, alone of its kind, is
    timed in a loop of its own after its run in place, whose output the graph keeps."""
    model, x, traced = traced_blocks
    calls: list[str] = []
    real = profile_module._SharingInterpreter._call

    def counting(self, n, args, kwargs):
        call = real(self, n, args, kwargs)
        return lambda: calls.append(n.name) or call()

    monkeypatch.setattr(profile_module._SharingInterpreter, "_call", counting)
    interpreter = profile_module._SharingInterpreter(traced.gm, profile_module._CpuTimer, None, 1, 3)
    with torch.no_grad():
        out = interpreter.run(*traced.flat_inputs((x,)))
        assert torch.equal(out, model(x))
    linears = [n.name for n in traced.gm.graph.nodes if n.op == "call_function" and "linear" in n.name]
    head = linears[-1]
    assert interpreter.looped == [head]
    runs = {name: calls.count(name) for name in interpreter.times}
    assert runs[head] == 1 + 3  # in its place (the warm-up), then three samples in the loop
    assert all(count == 1 for name, count in runs.items() if name != head)
    block = interpreter.samplers[interpreter.key_of[linears[0]]]
    assert len(block.samples) == 3 and interpreter.times[linears[0]] == block.median


def test_a_signature_too_rare_to_settle_in_its_places_is_looped_where_it_can_no_longer():
    torch.manual_seed(0)
    model, x = Blocks(depth=2).eval(), torch.randn(4, 16)
    with torch.no_grad():
        traced = trace(model, (x,))
    interpreter = profile_module._SharingInterpreter(traced.gm, profile_module._CpuTimer, None, 1, 3)
    with torch.no_grad():
        interpreter.run(*traced.flat_inputs((x,)))
    first = [n.name for n in traced.gm.graph.nodes if is_compute(n)]
    # two blocks cannot give one warm-up and three samples: each kind is looped on its first node
    assert interpreter.looped == [name for name in first if name not in first[3:6]]
    assert all(interpreter.samplers[interpreter.key_of[name]].done for name in first)


def test_a_short_graph_runs_again_until_the_budget_and_a_long_one_once(traced_blocks, monkeypatch):
    """Every run adds in-place timings to the same pools: a graph of a millisecond runs ``warmup +
    repeats`` times (a stall of the machine then moves one run's samples, not all); one that
    takes the budget runs once."""
    _, x, traced = traced_blocks
    runs: list[int] = []
    real = profile_module._SharingInterpreter.run

    def counting(self, *args):
        runs.append(1)
        return real(self, *args)

    monkeypatch.setattr(profile_module._SharingInterpreter, "run", counting)
    monkeypatch.setattr(profile_module, "BUDGET", 1e9)  # a loaded machine never ends it early
    times = profile_module._measure_shared(traced, (x,), {}, "cpu", 1, 3, False)
    assert len(runs) == 1 + 3 and all(t > 0 for t in times.values())
    runs.clear()
    monkeypatch.setattr(profile_module, "BUDGET", 0.0)
    profile_module._measure_shared(traced, (x,), {}, "cpu", 1, 3, False)
    assert len(runs) == 1


def test_a_graph_that_runs_again_times_its_rare_signatures_in_their_places(traced_blocks, monkeypatch):
    """A looped operator runs on warm caches and is timed low. When the graph runs again (a
    short graph: the budget holds several runs), the head, one per run, gets its samples in its
    place over the runs: nothing is looped, every signature has its samples. When the graph runs
    once, the head is looped as before."""
    _, x, traced = traced_blocks
    interpreters: list = []
    real = profile_module._SharingInterpreter.__init__

    def keeping(self, *args, **kwargs):
        real(self, *args, **kwargs)
        interpreters.append(self)

    monkeypatch.setattr(profile_module._SharingInterpreter, "__init__", keeping)
    monkeypatch.setattr(profile_module, "BUDGET", 1e9)
    with torch.no_grad():
        profile_module._measure_shared(traced, (x,), {}, "cpu", 1, 3, False)
    (short,) = interpreters
    assert short.runs == 1 + 3 and short.looped == []
    assert all(len(s.samples) >= s.min_repeats for s in short.samplers.values())
    interpreters.clear()
    monkeypatch.setattr(profile_module, "BUDGET", 0.0)
    with torch.no_grad():
        profile_module._measure_shared(traced, (x,), {}, "cpu", 1, 3, False)
    (long,) = interpreters
    head = [n.name for n in traced.gm.graph.nodes if n.op == "call_function" and "linear" in n.name][-1]
    assert long.runs == 1 and long.looped == [head]


def test_a_pooled_signature_with_samples_enough_is_not_looped_to_settle(traced_blocks, monkeypatch):
    """Samples in their places that have not settled are kept, not topped up by a loop."""
    _, x, traced = traced_blocks
    times = iter([1e-6, 2e-6] * 100)  # every sample moves the median: nothing ever settles
    monkeypatch.setattr(profile_module._SharingInterpreter, "_timed", lambda self, call: (call(), next(times)))
    interpreter = profile_module._SharingInterpreter(traced.gm, profile_module._CpuTimer, None, 0, 5)
    with torch.no_grad():
        interpreter.run(*traced.flat_inputs((x,)))
    block = [n.name for n in traced.gm.graph.nodes if n.op == "call_function" and "linear" in n.name][0]
    assert block not in interpreter.looped and len(interpreter.samplers[interpreter.key_of[block]].samples) == 4


def test_signature_tells_shapes_and_operations_apart(traced_blocks):
    _, x, traced = traced_blocks
    sigs = _signatures(traced, (x,))
    linears = [sigs[n.name] for n in traced.gm.graph.nodes if n.op == "call_function" and "linear" in n.name]
    assert len(linears) == 5  # four blocks and the head
    assert len(set(linears[:4])) == 1 and linears[4] != linears[0]  # the head's weight is 3 x 16
    gelus = {sigs[n.name] for n in traced.gm.graph.nodes if "gelu" in n.name}
    assert len(gelus) == 1 and not gelus & set(linears)


def test_a_node_that_writes_in_place_runs_and_is_timed_once():
    model, x = WritesInPlace(), torch.randn(2, 3)
    with torch.no_grad():
        traced = trace(model, (x,))
    writers = set(traced.effects.written)
    assert len(writers) == 4
    interpreter = profile_module._SharingInterpreter(traced.gm, profile_module._CpuTimer, None, 2, 5,
                                                     once=writers)
    with torch.no_grad():
        out = interpreter.run(*traced.flat_inputs((x,)))
    assert torch.equal(out, model(x))  # no add ran twice
    assert writers <= set(interpreter.times)
    graph = profile(traced, (x,), progress=False)
    assert all("cpu" in r.times for _, r in graph.records())


def test_sampler_stops_once_the_median_is_stable():
    s = Sampler(warmup=2, max_repeats=10)
    runs = 0
    while not s.done:
        s.add(0.001)
        runs += 1
    assert runs == 2 + 3 and len(s.samples) == 3 and s.median == 0.001


def test_sampler_respects_the_most_repeats_when_the_median_keeps_moving():
    s = Sampler(warmup=1, max_repeats=6)
    t, runs = 1e-4, 0
    while not s.done:
        s.add(t)
        t *= 1.5  # every sample moves the median by more than rtol
        runs += 1
    assert len(s.samples) == 6 and runs == 7


def test_sampler_shortens_the_warm_up_and_the_repeats_of_a_long_operator():
    s = Sampler(warmup=2, max_repeats=5)
    s.add(LONG_RUN)  # one long warm-up run is enough
    assert not s.done and s.samples == []
    s.add(BUDGET)  # one timed run that fills the budget
    assert s.done and s.samples == [BUDGET]
    s = Sampler(warmup=2, max_repeats=5)
    s.add(2 * BUDGET)  # a first run of the whole budget is warm enough: it is the sample
    assert s.done and s.samples == [2 * BUDGET]


def test_place_takes_the_profiling_option():
    torch.manual_seed(0)
    model, x = Blocks().eval(), torch.randn(4, 16)
    with pytest.raises(UsageError, match="profiling must be 'fast'"):
        torchplace.place(model, ["cpu:0", "cpu:1"], (x,), profiling="quick", progress=False)
    for how in ("fast", "exhaustive"):
        placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), profiling=how, progress=False, warmup=0, repeats=1,
                                  microbatches=1)
        assert torch.equal(placed(x), model(x))
