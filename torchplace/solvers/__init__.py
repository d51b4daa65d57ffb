"""Solvers: every algorithm behind one contract, ``solve(problem, **opts) -> Plan``.

Solvers see only a Problem and return a validated Plan whose objective is the cost model's value.
They never import torch.
"""
