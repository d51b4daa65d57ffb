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
