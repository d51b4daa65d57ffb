"""Shared test fixtures: paths to the published workloads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Property tests draw the same examples on every run, so the suite's verdict on a commit does not
# depend on luck; ``pytest --hypothesis-profile=explore`` draws new ones (run it when a solver changes).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")

WORKLOADS = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"
DNN = WORKLOADS / "dnn-partitioning" / "throughput"


@pytest.fixture(scope="session")
def workloads_dir() -> Path:
    if not WORKLOADS.is_dir():
        pytest.fail(f"shared workloads not found at {WORKLOADS}: clone the project next to ../shared")
    return WORKLOADS


@pytest.fixture(scope="session", autouse=True)
def keep_splits():
    """Tests place models to exercise splits: keep them split (place()'s default runs the whole model
    on one device when that is predicted faster, which for the suite's tiny models it nearly always
    is, and the split would go untested). Session-wide, so module-scoped fixtures see it too; tests
    marked ``single_device_fallback`` get place()'s own default back (:func:`place_default`)."""
    import torchplace.callplan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torchplace.callplan, "ALLOW_SINGLE_DEVICE", False)
        yield


@pytest.fixture(autouse=True)
def place_default(request, monkeypatch):
    if request.node.get_closest_marker("single_device_fallback") is not None:
        import torchplace.callplan

        monkeypatch.setattr(torchplace.callplan, "ALLOW_SINGLE_DEVICE", True)


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
