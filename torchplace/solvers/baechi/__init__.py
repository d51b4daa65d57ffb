"""Baechi's memory-constrained list schedulers for the latency objective (Jeon et al. 2020).

https://doi.org/10.1145/3419111.3421302 — "Baechi: Fast Device Placement of Machine Learning
Graphs", SoCC 2020.

* :func:`m_topo` — topological order, devices filled up to a memory share (Sec. 2.2);
* :func:`m_etf` — earliest task first over (operator, device) pairs, full devices skipped (Sec. 2.3);
* :func:`m_sct` — favourite children from the SCT LP relaxation, rounded, then ETF that keeps a
  favourite child on its parent's device (Sec. 2.4, 4.3);
* :func:`simulate_memory` — the dynamic memory of a plan over time (Sec. 4.2), reported in every
  plan's ``meta["peak_memory"]``.

All three share :class:`~torchplace.solvers.baechi.state.ListState`: static memory
(:func:`torchplace.costmodel.memory`, what plans are validated against) is never exceeded,
colocation groups are placed whole when their first member is (Sec. 3.1; a training graph's
backward nodes, colocated with their forward nodes, thereby follow them: Baechi's forward-operator
placement, Sec. 3.3), and ``sequential_comm=True`` models the communication queues of Sec. 3.4 in
the scheduler's own estimate. Co-placement and fusion (Sec. 3.2-3.3) are graph passes in
:mod:`torchplace.fusion.coplace`, applied before scheduling.

Each returns a ``"feasible"`` :class:`~torchplace.plan.Plan` over the problem made non-contiguous,
whose plan order is the scheduler's start order (:func:`torchplace.plan.stages_from_order`): the
simulation (:func:`torchplace.costmodel.simulate`) runs every device's nodes and serves every port
in that order. The plan's objective is that simulation, ``meta["scheduler_makespan"]`` the
scheduler's own estimate.

Example:
    >>> from torchplace.solvers.baechi import m_etf
    >>> plan = m_etf(problem)                       # doctest: +SKIP
    >>> plan.objective, plan.meta["peak_memory"]    # doctest: +SKIP
"""
from __future__ import annotations

from torchplace.solvers.baechi.etf import m_etf
from torchplace.solvers.baechi.memsim import MemoryTrace, simulate_memory
from torchplace.solvers.baechi.sct import m_sct
from torchplace.solvers.baechi.topo import m_topo

__all__ = ["MemoryTrace", "m_etf", "m_sct", "m_topo", "simulate_memory"]
