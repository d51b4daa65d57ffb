"""The streamed ideals DP (torchplace/solvers/dp_stream.py, issue 16 item 2): the same optimum as
the tabled DP and brute force, without the pair table; refused with a typed error beyond limits."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace.errors import ModelTooLargeError
from torchplace.solvers import dp, limits
from torchplace.workloads.synthetic import inception_like

from .graphs import brute_force_contiguous, problems, training_problems, zero_rich_problems


@settings(max_examples=120, deadline=None)
@given(st.one_of(problems(), training_problems(), zero_rich_problems()))
def test_streamed_dp_equals_tabled_dp_and_brute_force(problem):
    try:
        tabled = dp.solve(problem, stream=False).objective
    except Exception as e:  # noqa: BLE001 - infeasible: the streamed DP must say so too
        with pytest.raises(type(e)):
            dp.solve(problem, stream=True)
        return
    plan = dp.solve(problem, stream=True)
    assert plan.meta["streamed"]
    plan.validate(problem)
    assert plan.objective == pytest.approx(tabled, rel=1e-9)
    assert plan.objective == pytest.approx(brute_force_contiguous(problem), rel=1e-9)


@pytest.mark.parametrize("blocks, branches", [(1, [1, 2]), (2, [1, 2, 2]), (3, [2, 3])])
def test_streamed_dp_on_small_inception_like_graphs(blocks, branches):
    problem = inception_like(blocks, branches, accelerators=2)
    tabled, streamed = dp.solve(problem, stream=False), dp.solve(problem, stream=True)
    assert streamed.objective == pytest.approx(tabled.objective, rel=1e-12)
    assert streamed.meta["ideals"] == tabled.meta["ideals"] and streamed.meta["ideal_pairs"] == tabled.meta["ideal_pairs"]
    if blocks == 1:
        assert streamed.objective == pytest.approx(brute_force_contiguous(problem), rel=1e-9)


def test_the_dp_streams_when_the_pair_table_would_not_fit(monkeypatch):
    problem = inception_like(3, [3, 4, 4])
    expected = dp.solve(problem).objective
    monkeypatch.setattr(limits, "MEMORY_BUDGET", 2**20)  # its pair table (~3 MB) is refused, the stream (~0.2 MB) fits
    plan = dp.solve(problem)
    assert plan.meta["streamed"] and plan.objective == pytest.approx(expected, rel=1e-12)


def test_a_streamed_dp_past_the_time_limit_is_refused_before_it_starts(monkeypatch):
    """The estimate (pairs x states x classes x the measured cost of one) is checked first."""
    monkeypatch.setattr(dp, "STREAM_SECONDS_PER_PAIR", 1e-3)  # as if the machine were 400,000 times slower
    problem = inception_like(3, [3, 4, 4])
    with pytest.raises(ModelTooLargeError, match=r"streamed DP over 37 supernodes, 302 ideals and 37,353 ideal pairs would take about .*'slicegraph'"):
        dp.solve(problem, stream=True, time_limit=10)


@pytest.mark.slow
def test_inception_like_layer_graph_with_36962_ideals_is_solved_exactly():
    """The size of the published InceptionV3 layer graph (36,596 ideals, 5.8e8 pairs): the pair
    table would need ~35 GB; streamed it is exact in minutes (benchmarks/dp_workloads.py)."""
    problem = inception_like(11, [5, 6, 7, 9])
    plan = dp.solve(problem, ideal_limit=50_000)
    assert plan.meta["streamed"] and plan.meta["ideals"] == 36_962 and plan.status == "optimal"
    plan.validate(problem)
