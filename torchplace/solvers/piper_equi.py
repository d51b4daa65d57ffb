"""The *equi* baseline of Piper's Sec. 5 (PipeDream-2BW's planner, extended with tensor parallelism).

Equi-partition the layers into ``w`` stages of equal size (the later stages take one more when it
does not divide), give every stage the same data-parallel degree ``d`` (dividing ``N``) and
tensor-parallel degree ``t``, and recompute activations everywhere or nowhere; the nodes before
the first layer and after the last go either with the first and last stage or on stages of their
own. The best over all valid ``(w, d, t, recompute, separate)`` wins.

"Layers" are the nodes that share the most common name (BERT's ``ParallelTransformerLayer``); when
no name repeats, every node is a layer, in topological order. Every stage is a segment of one
topological order: nodes among the layers (none in BERT) go with the layer before them.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from torchplace import costmodel
from torchplace.errors import InfeasibleError, UsageError
from torchplace.graph import TMPC
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers.piper import work_lower_bound

__all__ = ["solve"]


def _layers(problem: Problem) -> tuple[list[str], list[str], list[str], list[str]]:
    """Segments of one topological order: (the nodes before the first layer, the nodes from the
    first layer to the last, the nodes after), and the layers themselves."""
    order = problem.graph.topological_order()
    names = Counter(problem.graph.record(v).name for v in order)
    name, count = names.most_common(1)[0]
    if count < 2:
        return [], order, [], order
    layers = [v for v in order if problem.graph.record(v).name == name]
    first, last = order.index(layers[0]), order.index(layers[-1])
    return order[:first], order[first:last + 1], order[last + 1:], layers


@dataclass(frozen=True)
class _Sums:
    compute: float
    edges: float
    weights: float
    a: float
    b: float


def _choice(problem: Problem, nodes: tuple[str, ...], t: int, recompute: bool) -> dict[str, str] | None:
    """The TMPC of each node: the (first) one that recomputes or not as asked, else None."""
    out = {}
    for v in nodes:
        xs = problem.graph.record(v).tmpcs.get(t, ())
        pick = next((x for x in xs if x.recompute == recompute), xs[0] if len(xs) == 1 else None)
        if pick is None:
            return None
        out[v] = pick.id
    return out


def _sums(problem: Problem, nodes: tuple[str, ...], t: int, tmpcs: dict[str, str]) -> _Sums:
    members = set(nodes)
    xs: list[tuple[str, TMPC]] = [(v, costmodel.piper_tmpc(problem, v, t, tmpcs[v])) for v in nodes]
    edges = sum(sum(costmodel.piper_edge_bytes(problem, v, x, members)) for v, x in xs)
    return _Sums(sum(x.time for _, x in xs), edges, sum(x.param_bytes for _, x in xs),
                 sum(x.mem_a for _, x in xs), sum(x.mem_b for _, x in xs))


def _layouts(problem: Problem) -> list[list[tuple[str, ...]]]:
    """Each stage a segment of one topological order, so that stages are contiguous and data flows
    forward: a group of layers takes the nodes among the layers up to the next group's first layer."""
    before, middle, after, layers = _layers(problem)
    at = {v: i for i, v in enumerate(middle)}
    out = []
    for separate in (False, True):
        if separate and not (before or after):
            continue
        for w in range(1, len(layers) + 1):
            size, larger = divmod(len(layers), w)
            starts, i = [], 0
            for g in range(w):
                starts.append(at[layers[i]] if g else 0)
                i += size + (g >= w - larger)
            groups = [list(middle[lo:hi]) for lo, hi in zip(starts, [*starts[1:], len(middle)])]
            if separate:
                stages = ([tuple(before)] if before else []) + [tuple(g) for g in groups] + ([tuple(after)] if after else [])
            else:
                groups[0] = before + groups[0]
                groups[-1] = groups[-1] + after
                stages = [tuple(g) for g in groups]
            out.append(stages)
    return out


def solve(problem: Problem, *, tensor_parallel: bool = True, data_parallel: bool = True, recompute: bool = True,
          time_limit: float | None = None) -> Plan:
    """The best equi-partitioned configuration (module docstring); ``tensor_parallel=False`` is
    *equi-no TP*, the surrogate for PipeDream-2BW's planner. ``data_parallel=False`` keeps
    ``d = 1`` and ``recompute=False`` never recomputes (for bounds of Piper's baselines).

    Raises:
        UsageError: for a problem without a Parallel setting.
        InfeasibleError: when no equi configuration fits in memory.
    """
    par = problem.parallel
    if par is None:
        raise UsageError("method 'piper-equi' needs a Piper problem (Problem.parallel)")
    start = time.perf_counter()
    degrees = sorted({t for _, r in problem.graph.records() for t in r.tmpcs})
    degrees = [t for t in degrees if tensor_parallel or t == 1]
    best: tuple[float, list[Stage]] | None = None
    for stages in _layouts(problem):
        w = len(stages)
        for t in degrees:
            for everywhere in (False, True) if recompute else (False,):
                choices = [_choice(problem, s, t, everywhere) for s in stages]
                if not recompute and any(costmodel.piper_tmpc(problem, v, t, x).recompute
                                         for c in choices if c for v, x in c.items()):
                    continue
                if any(c is None for c in choices):
                    continue
                sums = [_sums(problem, s, t, c) for s, c in zip(stages, choices)]  # type: ignore[arg-type]
                for d in range(1, (par.microbatches if data_parallel else 1) + 1):
                    if w * d > min(par.devices, par.microbatches) or w * d * t > par.devices:
                        break
                    if par.microbatches % d:
                        continue
                    tps = 0.0
                    for i, x in enumerate(sums):
                        if x.a * (w - i) + x.b > par.memory_limit:
                            tps = float("inf")
                            break
                        resync = costmodel.piper_resync_bytes(x.weights, d, par.microbatches)
                        tps = max(tps, x.compute / d + (x.edges / d + resync) / par.bandwidth)
                    if best is None or tps < best[0]:
                        best = (tps, [Stage(f"dev[{i * d * t}:{(i + 1) * d * t}]", s, data_parallel=d,
                                            tensor_parallel=t, tmpcs=c)  # type: ignore[arg-type]
                                      for i, (s, c) in enumerate(zip(stages, choices))])
    if best is None or best[0] == float("inf"):
        raise InfeasibleError(f"no equi-partitioned configuration fits in {par.memory_bytes / 2**30:.3g} GiB per device")
    return Plan.build(problem, best[1], solver="piper-equi" + ("" if tensor_parallel else "-no-tp"),
                      seconds=time.perf_counter() - start, lower_bound=work_lower_bound(problem), status="feasible",
                      meta={"stages": len(best[1]), "contiguous": True})
