"""The demo (README's main job) and its side-by-side throughput measurement."""
from __future__ import annotations

import time

import pytest

from torchplace import demo


def test_interleaved_rates_are_each_functions_own_and_rotate_the_order():
    calls: list[str] = []

    def sleeper(name: str, seconds: float):
        def fn() -> None:
            calls.append(name)
            time.sleep(seconds)
        return fn

    rates = demo.interleaved_samples_per_second({"fast": sleeper("fast", 0.01), "slow": sleeper("slow", 0.03)},
                                                batch=8, seconds=0.2, warmup=1, rounds=4)
    # 8 samples per call: at most 800 and 267 samples/s (a sleep overshoots, never undershoots;
    # by up to 10 ms on a loaded host, which keeps the ratio above 2)
    assert 400 < rates["fast"] <= 800 and 100 < rates["slow"] <= 8 / 0.03
    assert 2 < rates["fast"] / rates["slow"] < 3.2
    # warm-up, then rounds in rotated order: fast slow | slow fast | fast slow | slow fast, which
    # runs together into 5 stretches (8 without the rotation)
    assert calls[:2] == ["fast", "slow"]
    stretches = [name for i, name in enumerate(calls[2:], 2) if name != calls[i - 1] or i == 2]
    assert stretches == ["fast", "slow", "fast", "slow", "fast"]


def test_no_functions_measure_nothing():
    assert demo.interleaved_samples_per_second({}, batch=8, seconds=0.1) == {}


@pytest.mark.filterwarnings("ignore::torchplace.errors.PlacementWarning")
def test_the_quick_demo_runs_and_every_placed_model_matches(capsys):
    pytest.importorskip("transformers")
    assert demo.main(quick=True) == 0
    out = capsys.readouterr().out
    assert out.count("throughput (samples/s, side by side)") == 2 and "all outputs matched" in out
