"""``method="auto"``: choose solvers by objective and size, keep the best plan and the best bound.

Throughput (Tarnawski Sec. 5; Archer Sec. 3-4):

1. the ideals DP when the graph's ideals are few enough (optimal among contiguous splits) and it
   ends within three quarters of the time, else SliceGraph over random topological orders
   followed by BRKGA (until :data:`BRKGA_PATIENCE` generations bring nothing better), within the
   time left; neither runs on once a split meets the lower bound;
2. when the problem allows non-contiguous splits, that plan is improved by moving windows of
   operators between devices (:mod:`~torchplace.solvers.polish`, within :data:`POLISH_SHARE` of
   the time left), and the contiguous plan is the incumbent of the max-load MILP (Tarnawski
   App. C), which runs within ``time_limit`` on graphs of at most ``milp_nodes`` nodes;
3. the lower bound is the best proven one: combinatorial (Archer Lemma 3.3) and the cut bound
   (:mod:`~torchplace.solvers.cut_bound`, transfers priced, within :data:`CUT_BOUND_SHARE` of the
   time left) always, the MILP's bound when it ran; a plan a bound proves optimal over any split
   ends the search. With ``bounds="mip"`` also Archer's guess-the-bottleneck bound (Sec. 3.3;
   it contains the three-superblock MIP of Sec. 3.2, so it is never weaker) within
   :data:`MIP_BOUND_SHARE` of the time left, and then the non-contiguous max-load MILP, started
   from the contiguous plan, within the rest, on any graph its model fits (the polished plan's
   value is recorded beside it, also on a contiguous problem): its proven bound holds for
   every split, contiguous or not (on a contiguous problem only the bound is kept, as its plan
   need not be contiguous). Both are certificates over any split; the DP's ``"optimal"`` is the
   certificate within contiguous splits. Neither runs once a bound meets a plan over any split
   (on a contiguous problem, the polished one): no bound can exceed a plan's value.

Training with a :class:`~torchplace.problem.Pipeline`: the DP, and SliceGraph and BRKGA over each
order they slice, cost pieces at their 1F1B positions with recomputation; the MILP and the MIP
bounds work through the per-node memory relaxation and restriction
(:mod:`torchplace.solvers.pipelined`). Every plan fits and every bound holds.

Latency (MOIRAI Sec. III-D; Baechi Sec. 2): m-SCT and m-ETF always; the MOIRAI MILP within
``time_limit`` on graphs of at most ``milp_nodes`` nodes, starting from the better of the two
schedulers' plans; the best plan wins, and the bound is the best of the combinatorial latency
bound and the MILP's.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from torchplace.errors import (InfeasibleError, ModelTooLargeError, SolverError, SolverLimitError, TooManyIdealsError,
                               UsageError)
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.bounds import round_up_bound
from torchplace.solvers.cut_bound import cut_lower_bound
from torchplace.solvers.limits import stop_if_interrupted
from torchplace.solvers.polish import polish

__all__ = ["BRKGA_PATIENCE", "DEFAULT_TIME_LIMIT", "MILP_NODES", "contiguous_plan", "solve_auto"]

DEFAULT_TIME_LIMIT = 30.0
"""Seconds ``auto`` takes in all when the caller sets no limit."""

DP_SHARE = 0.75
"""Share of the time the exact DP may take before ``auto`` falls back to the searches."""

LAST_RESORT_SECONDS = 0.25
"""Seconds SliceGraph still gets when the DP used up the time: a plan slightly past the limit beats
``SolverLimitError`` (on a 2-layer Llama's training graph at ``time_limit=2`` the DP's 0.375 s
share went to enumerating ideals; SliceGraph splits such graphs in milliseconds)."""

MILP_NODES = 60
"""Largest graph (nodes) on which ``auto`` tries a MILP for its plan: beyond it HiGHS rarely beats the heuristics."""

BRKGA_PATIENCE = 5
"""Generations without improvement after which ``auto`` stops BRKGA (it has already sliced
SliceGraph's random orders). On T5-small's and Whisper-tiny's operator graphs, 20 generations found
nothing the first orders had not (3-5 s each on 2 cores); Archer et al. (App. C.1, Table 2) report
brkga-100 within 1% of brkga-10000."""

CUT_BOUND_SHARE = 0.1
"""The share of the time left that the cut bound's exact cuts may take (its one-hop values always run)."""

POLISH_SHARE = 0.1
"""The share of the time left that the local search on a non-contiguous plan may take."""

MIP_BOUND_SHARE = 1 / 3
"""With ``bounds="mip"``: the share of the time left that guess-the-bottleneck may take before the MILP."""


def _best(problem: Problem, plans: list[Plan], bounds: list[float], tried: dict[str, Any], t0: float) -> Plan:
    best = min(plans, key=lambda p: p.objective)
    bound = round_up_bound(problem, max([best.lower_bound, *bounds]))
    if bound > best.objective * (1 + 1e-6) + 1e-12:
        raise AssertionError(f"auto: bound {bound} exceeds the best plan's objective {best.objective}: {tried}")
    bound = min(bound, best.objective)  # solver tolerance only
    status = best.status
    if bound >= best.objective * (1 - 1e-9) and status != "optimal":
        status = "optimal"  # a bound proved it, even if the plan's own solver could not
    meta = {**best.meta, "auto": tried}
    return dataclasses.replace(best, lower_bound=bound, status=status, seconds=time.perf_counter() - t0, meta=meta)


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.perf_counter())


def solve_auto(
    problem: Problem,
    *,
    time_limit: float | None = None,
    bounds: str = "combinatorial",
    milp_nodes: int = MILP_NODES,
    **opts: Any,
) -> Plan:
    """The best plan ``auto`` finds for ``problem`` and the best lower bound it proves.

    Args:
        time_limit: seconds for everything ``auto`` runs (default :data:`DEFAULT_TIME_LIMIT`).
        bounds: ``"combinatorial"`` or ``"mip"`` (also Archer's MIP-based bounds, throughput).
        milp_nodes: largest graph on which a MILP is tried.
        opts: passed to the DP (e.g. ``ideal_limit``).

    Raises:
        InfeasibleError: if no method finds a plan that fits.
        SolverLimitError: if the time limit passed before any method found a plan.
        UsageError: (a ValueError) for an unknown ``bounds`` value, or for options a latency
            problem would ignore (``opts``, ``bounds="mip"``).
    """
    if bounds not in ("combinatorial", "mip"):
        raise UsageError(f"bounds must be 'combinatorial' or 'mip', got {bounds!r}")
    t0 = time.perf_counter()
    deadline = t0 + (DEFAULT_TIME_LIMIT if time_limit is None else time_limit)
    if problem.objective == "latency":
        # contiguous= that the problem already has is not ignored: solve() applied it (contiguous=False)
        ignored = [*sorted(k for k, v in opts.items()
                           if v is not None and not (k == "contiguous" and v == problem.contiguous)),
                   *(["bounds='mip'"] if bounds == "mip" else [])]
        if ignored:  # they shape the DP and Archer's bounds, which a latency problem does not run
            raise UsageError(f"{', '.join(ignored)} would be ignored: auto solves a latency problem with the latency "
                             "methods (no DP, no MIP bounds); leave it out")
        return _latency(problem, deadline, milp_nodes, t0)
    return _throughput(problem, deadline, bounds, milp_nodes, t0, opts)


def _throughput(problem: Problem, deadline: float, bounds: str, milp_nodes: int, t0: float,
                opts: dict[str, Any]) -> Plan:
    tried: dict[str, Any] = {}
    contiguous = dataclasses.replace(problem, contiguous=True)
    try:
        first = _contiguous_plan(contiguous, deadline, deadline - t0, tried, opts)
    except InfeasibleError as e:
        if problem.contiguous:
            raise
        return _noncontiguous_only(problem, deadline, bounds, milp_nodes, t0, tried, e)
    tried[first.solver] = first.objective
    plans = [first if problem.contiguous else _rebuild(problem, first)]
    cut = cut_lower_bound(problem, time_limit=_remaining(deadline) * CUT_BOUND_SHARE)
    tried["cut_bound"] = cut
    proven: list[float] = [cut]
    if _closed(plans, proven):  # proven optimal over any split: nothing can do better
        return _best(problem, plans, proven, tried, t0)
    # Plans over any split: once a bound meets one, no bound can rise further. A contiguous
    # problem returns a contiguous plan; with bounds="mip" its loose twin's polished plan is only
    # recorded, and stops the bound MIPs when a bound meets it.
    loose, start, anysplit = problem, plans[0], plans
    if not problem.contiguous:
        plans.append(_polished(problem, start, deadline, tried))  # start again if nothing helps
    elif bounds == "mip":
        loose = dataclasses.replace(problem, contiguous=False)
        start = _rebuild(loose, plans[0])
        anysplit = [_polished(loose, start, deadline, tried)]
    if _closed(plans, proven):
        return _best(problem, plans, proven, tried, t0)
    if bounds == "mip" and _remaining(deadline) > 0 and not _closed(anysplit, proven):
        from torchplace.solvers.milp import bounds as mip_bounds

        value = mip_bounds.guess_the_bottleneck_bound(problem, time_limit=_remaining(deadline) * MIP_BOUND_SHARE)
        tried["guess_the_bottleneck_bound"] = value
        proven.append(value)
        if _closed(plans, proven):
            return _best(problem, plans, proven, tried, t0)
    # The MILP starts from the contiguous plan, not the polished one: HiGHS 1.16's presolve was
    # seen to hang past its time limit from a polished start (BERT-6, 418 nodes, 2-3 s limits).
    if not problem.contiguous and (len(problem.graph) <= milp_nodes or bounds == "mip") and _remaining(deadline) > 0:
        _run_milp("ip", problem, deadline, tried, plans, proven, warm_start=start)
    elif bounds == "mip" and _remaining(deadline) > 0 and not _closed(anysplit, proven):
        _run_milp("ip", loose, deadline, tried, [], proven, warm_start=start)  # only its bound is kept
    return _best(problem, plans, proven, tried, t0)


def _noncontiguous_only(problem: Problem, deadline: float, bounds: str, milp_nodes: int, t0: float,
                        tried: dict[str, Any], error: InfeasibleError) -> Plan:
    """No contiguous split fits, yet a problem that lets a device hold several pieces may still
    have a split that does (Tarnawski Sec. 5.2): the non-contiguous max-load MILP decides, where it
    runs (its infeasible verdict is exact and propagates); else ``error`` stands.

    Raises:
        InfeasibleError: ``error`` where the MILP does not run (a graph larger than
            ``milp_nodes``, no time left), or the MILP's verdict with ``error``'s memory that fits
            (a contiguous split that fits is a split).
        SolverLimitError: if the MILP found no split within the time left.
    """
    tried["contiguous"] = f"infeasible: {error}"
    if not (len(problem.graph) <= milp_nodes or bounds == "mip") or _remaining(deadline) <= 0:
        raise error
    plans: list[Plan] = []
    proven: list[float] = [cut_lower_bound(problem, time_limit=_remaining(deadline) * CUT_BOUND_SHARE)]
    try:
        _run_milp("ip", problem, deadline, tried, plans, proven, find_start=False)  # none is contiguous
    except InfeasibleError as e:  # what the contiguous split's error says would fit still does
        raise InfeasibleError(f"no split fits ({e}); no contiguous one either: {error}", error.min_memory_bytes) from e
    if not plans:
        raise SolverLimitError(f"auto: no contiguous split fits ({error}), and the max-load IP found no other split "
                               f"in time ({tried['ip']}); raise the time limit, or allow more memory", deadline - t0)
    return _best(problem, plans, proven, tried, t0)


def _polished(problem: Problem, plan: Plan, deadline: float, tried: dict[str, Any]) -> Plan:
    """``plan`` improved by :func:`~torchplace.solvers.polish.polish` within :data:`POLISH_SHARE`
    of the time left (non-contiguous problems only)."""
    better = polish(problem, plan, time_limit=_remaining(deadline) * POLISH_SHARE)
    if better is not plan:
        tried["polish"] = better.objective
    return better


def _closed(plans: list[Plan], proven: list[float]) -> bool:
    """Whether a proven bound meets the best plan (optimal over any split: no MILP can improve it)."""
    return max(proven, default=0.0) >= min(p.objective for p in plans) * (1 - 1e-9)


def _contiguous_plan(problem: Problem, deadline: float, limit: float, tried: dict[str, Any],
                     opts: dict[str, Any]) -> Plan:
    """The DP's optimal contiguous plan; past its ideal limit, its memory or its share of the time,
    the better of SliceGraph's and BRKGA's within the time left.

    Raises:
        InfeasibleError: if SliceGraph proves no split along its orders fits.
        SolverLimitError: if neither search found a plan in time.
    """
    from torchplace.solvers import call_method

    try:
        return call_method("dp", problem, time_limit=_remaining(deadline) * DP_SHARE, **opts)
    except TooManyIdealsError as e:
        tried["dp"] = f"skipped: more than {e.limit} ideals"
    except SolverLimitError as e:
        tried["dp"] = f"stopped: {e}"
    except SolverError as e:  # the DP's sums lost precision: the searches do not claim an optimum
        tried["dp"] = f"failed: {e}"
    plans = []
    for name, share in (("slicegraph", 0.5), ("brkga", 1.0)):
        last_resort = name == "slicegraph" and "dp" in tried  # the DP ran out of time: a plan a little late beats none
        if _remaining(deadline) <= 0 and not last_resort:
            tried[name] = "skipped: no time left"
            continue
        if plans and plans[0].status == "optimal":
            tried[name] = "skipped: SliceGraph's plan meets the lower bound"
            continue
        options = {"patience": BRKGA_PATIENCE} if name == "brkga" else {}
        try:
            seconds = max(_remaining(deadline) * share, LAST_RESORT_SECONDS if last_resort else 0.0)
            plans.append(call_method(name, problem, time_limit=seconds, **options))
            tried[name] = plans[-1].objective
            stop_if_interrupted(plans[-1].meta)  # a search alone returns its best plan on Ctrl-C; auto stops
        except SolverLimitError as e:
            tried[name] = f"stopped: {e}"
        except InfeasibleError:
            if name == "slicegraph":
                raise
    if not plans:
        raise SolverLimitError(f"auto: no method found a plan within the {limit:g} s time limit ({tried}); raise "
                               "the time limit, or coarsen the graph (place(..., fuse=True) or granularity='module')",
                               limit)
    return min(plans, key=lambda p: p.objective)


def contiguous_plan(problem: Problem, seconds: float) -> Plan:
    """The contiguous plan ``auto`` starts from (:func:`_contiguous_plan`) within ``seconds``: the
    max-load IP's start (:func:`torchplace.solvers.milp.maxload.solve_started`).

    Raises:
        InfeasibleError, SolverLimitError: as :func:`_contiguous_plan`.
    """
    return _contiguous_plan(problem, time.perf_counter() + seconds, seconds, {}, {})


def _run_milp(name: str, problem: Problem, deadline: float, tried: dict[str, Any], plans: list[Plan],
              proven: list[float], **opts: Any) -> None:
    """Run MILP ``name`` within the time left; add its plan and its proven bound (also when the
    limit stopped it before any plan). An infeasible verdict propagates: the heuristics' plans
    would contradict it."""
    from torchplace.solvers import call_method

    try:
        plan = call_method(name, problem, time_limit=_remaining(deadline), **opts)
    except ModelTooLargeError as e:
        tried[name] = f"refused: {e}"
        return
    except SolverError as e:  # the other methods' plans stand; their bounds too
        tried[name] = f"failed: {e}"
        return
    except SolverLimitError as e:
        tried[name] = "no incumbent within the time limit"
        if e.bound is not None:
            proven.append(e.bound)
        return
    tried[name] = plan.objective
    plans.append(plan)
    proven.append(plan.lower_bound)


def _rebuild(problem: Problem, plan: Plan) -> Plan:
    """``plan`` re-evaluated under ``problem`` (a contiguous plan is a valid non-contiguous one)."""
    return Plan.build(problem, plan.stages, solver=plan.solver, seconds=plan.seconds,
                      lower_bound=plan.lower_bound, status="feasible", meta=plan.meta)


def _latency(problem: Problem, deadline: float, milp_nodes: int, t0: float) -> Plan:
    from torchplace.solvers import call_method

    tried: dict[str, Any] = {}
    found: dict[str, Plan] = {}
    proven: list[float] = []
    for name in ("m-etf", "m-sct"):  # the list scheduler first: m-SCT's LP may take all the time
        if _remaining(deadline) <= 0:  # its set-up alone takes seconds on a large graph
            tried[name] = "skipped: no time left"
            continue
        try:  # each scheduler runs within the time left
            found[name] = call_method(name, problem, time_limit=_remaining(deadline))
        except InfeasibleError as e:
            tried[name] = f"infeasible: {e}"
            continue
        except SolverLimitError:
            tried[name] = "no schedule within the time limit"
            continue
        tried[name] = found[name].objective
    plans = [found[name] for name in ("m-sct", "m-etf") if name in found]  # m-SCT's plan wins a tie
    if len(problem.graph) <= milp_nodes and _remaining(deadline) > 0:
        start = min(plans, key=lambda p: p.objective) if plans else None
        _run_milp("moirai", problem, deadline, tried, plans, proven, warm_start=start)
    if not plans:
        if all(isinstance(t, str) and t.startswith(("no schedule", "skipped")) for t in tried.values()):
            raise SolverLimitError(f"no scheduler finished within the time limit: {tried}; raise the time limit "
                                   f"or coarsen the graph (place(..., fuse=True))", None)
        raise InfeasibleError(f"no scheduler found a placement that fits: {tried}")
    return _best(problem, plans, [b for b in proven if math.isfinite(b)], tried, t0)
