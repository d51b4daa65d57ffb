"""BRKGA: a biased random-key genetic algorithm over topological orders, decoded by SliceGraph.

Archer et al. 2024 (papers/archer2024-pipeline-bounds.txt), Sec. 4.2, Algorithm 2 and App. C.1: a
chromosome is one priority key per supernode of the contracted graph; Kahn's algorithm taking the
ready supernode of highest key (App. B.1, Algorithm 3) decodes it into a topological order, and
SliceGraph (:mod:`torchplace.solvers.slicegraph`) slices that order optimally, giving the
chromosome's fitness (the split's max load). Each generation keeps the elite, adds random mutants
and fills the rest with biased crossover offspring. Fitness evaluation is pruned: a chromosome is
sliced with the worst elite's fitness as the window bound, so orders that cannot enter the elite
are abandoned cheaply (see the slicegraph module docstring).
"""
from __future__ import annotations

import math

import numpy as np

from torchplace.errors import UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.slicegraph import Search, progress_bar

__all__ = ["solve"]


def solve(problem: Problem, *, seed: int = 0, population: int = 20, generations: int = 20,
          elite: float = 0.2, mutants: float = 0.15, rho: float = 0.7, patience: int | None = None,
          time_limit: float | None = None, progress: bool | None = None) -> Plan:
    """BRKGA over node priorities decoded by Kahn + SliceGraph (Archer Sec. 4.2, Algorithm 2, App. C.1).

    Each generation keeps the elite chromosomes, adds random mutants, and fills the rest with
    offspring of one elite and one non-elite parent, each key taken from the elite parent with
    probability ``rho``. The first chromosome is the first random order of
    :func:`torchplace.solvers.slicegraph.solve` with the same seed, so the result is never worse
    than that order's.

    Args:
        problem: a throughput problem.
        seed: seeds ``numpy.random.default_rng``.
        population, generations: chromosomes per generation, generations after the first.
        elite, mutants: fractions of the population (at least one chromosome each).
        rho: probability of inheriting a key from the elite parent.
        patience: stop after this many generations in a row that did not improve the best split
            (the "generations without improvement" stopping rule of BRKGA, Goncalves & Resende
            2011, ref. [15] of Archer et al.); ``None``: run every generation. The search also
            stops when the best split meets the lower bound (it is then optimal).
        time_limit: seconds for everything (preparation included); the search stops when it passes.
        progress: show a tqdm bar (default: when stderr is a terminal).

    Returns:
        A Plan (status ``"feasible"``, or ``"time_limit"`` when the limit cut the search short;
        simple lower bound); ``meta`` as
        :func:`torchplace.solvers.slicegraph.solve`, plus ``generations`` completed.

    Training with a :class:`~torchplace.problem.Pipeline`: each order is decoded exactly under the
    pipeline's memory, as SliceGraph slices it (1F1B positions, recomputation where needed).

    Raises:
        InfeasibleError: if no decoded order has a split that fits.
        SolverLimitError: if the time limit passed before any split was found.
        UsageError: (a ValueError) for fractions that leave no room for offspring.

    Example:
        >>> plan = solve(problem, population=8, generations=4, time_limit=10.0)  # doctest: +SKIP
    """
    n_elite, n_mut = _count(elite, population, "elite"), _count(mutants, population, "mutants")
    if n_elite + n_mut >= population or not 0 <= rho <= 1:
        raise UsageError(f"need elite + mutants < population and 0 <= rho <= 1; got {n_elite} + {n_mut} of "
                         f"{population}, rho={rho}")
    if patience is not None and patience < 1:
        raise UsageError(f"patience must be a positive number of generations or None, got {patience!r}")
    search = Search(problem, time_limit, name="BRKGA")
    rng = np.random.default_rng(seed)
    keys = rng.random((population, search.n))
    fitness = np.full(population, math.inf)
    done, interrupted, stale, best = 0, False, 0, math.inf
    with progress_bar(progress, population * (generations + 1), "brkga") as bar:
        try:
            for gen in range(generations + 1):
                if gen:
                    stale = 0 if search.best_value < best else stale + 1
                    best = search.best_value
                    if patience is not None and stale >= patience:
                        break
                    keys, fitness = _next_generation(rng, keys, fitness, n_elite, n_mut, rho)
                for r in range(n_elite if gen else 0, population):  # elites keep their fitness
                    threshold = np.partition(fitness, n_elite - 1)[n_elite - 1]  # an elite's worst
                    fitness[r] = search.evaluate(search.order(keys[r].tolist()), bound=threshold)
                    bar.update()
                    if search.done():
                        break
                else:
                    done = gen
                    continue
                break
        except KeyboardInterrupt:
            if search.best_pieces is None:
                raise
            interrupted = True
    meta = {"seed": seed, "generations": done, "population": population, "elite": n_elite, "mutants": n_mut, "rho": rho}
    return search.plan("brkga", interrupted, meta)


def _count(x: float, population: int, name: str) -> int:
    """Chromosomes for a fraction ``x`` of the population (at least one)."""
    if not 0 < x < 1:
        raise UsageError(f"{name} is a fraction of the population in (0, 1), got {x!r}")
    return max(1, round(x * population))


def _next_generation(rng: np.random.Generator, keys: np.ndarray, fitness: np.ndarray, n_elite: int, n_mut: int,
                     rho: float) -> tuple[np.ndarray, np.ndarray]:
    """Elites kept (with their fitness), then mutants, then biased crossover offspring (unevaluated)."""
    rank = np.argsort(fitness, kind="stable")
    elite, rest = rank[:n_elite], rank[n_elite:]
    pop, n = keys.shape
    new = np.empty_like(keys)
    new[:n_elite] = keys[elite]
    new[n_elite:n_elite + n_mut] = rng.random((n_mut, n))
    n_off = pop - n_elite - n_mut
    mothers, fathers = rng.choice(elite, n_off), rng.choice(rest, n_off)
    take = rng.random((n_off, n)) < rho
    new[n_elite + n_mut:] = np.where(take, keys[mothers], keys[fathers])
    new_fitness = np.full(pop, math.inf)
    new_fitness[:n_elite] = fitness[elite]
    return new, new_fitness
