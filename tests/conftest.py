"""Shared test fixtures: paths to the published workloads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKLOADS = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"
DNN = WORKLOADS / "dnn-partitioning" / "throughput"


@pytest.fixture(scope="session")
def workloads_dir() -> Path:
    if not WORKLOADS.is_dir():
        pytest.fail(f"shared workloads not found at {WORKLOADS}: clone the project next to ../shared")
    return WORKLOADS


@pytest.fixture
def mha_fastpath_off():
    """Run references on PyTorch's ordinary attention path.

    In eval mode under ``no_grad``, ``nn.MultiheadAttention`` takes a fused "fast path" kernel that
    a traced graph (decomposed ops) does not contain; it agrees with the ordinary path only to
    float rounding. Traced and placed models are bitwise equal to the ordinary path.
    """
    import torch

    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(before)
