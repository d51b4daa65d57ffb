"""Readers for published workload files: each returns a :class:`~torchplace.problem.Problem`.

* :func:`read_dnn_partitioning` — msr-fiddle/dnn-partitioning JSON (Tarnawski et al. 2020);
  throughput by default.
* :func:`read_expert_split` — a human expert split of one of those workloads, as node -> device.
* :func:`read_piper` — the Piper JSON (TMPCs per node and tensor-parallel degree; data x tensor x
  pipeline training, Tarnawski et al. 2021).
* :func:`read_moirai_csv` — the MOIRAI example CSV (heterogeneous devices, latency).
"""
from torchplace.workloads.dnn_partitioning import (
    read_dnn_partitioning,
    read_expert_split,
)
from torchplace.workloads.moirai import read_moirai_csv
from torchplace.workloads.piper import read_piper

__all__ = ["read_dnn_partitioning", "read_expert_split", "read_moirai_csv", "read_piper"]
