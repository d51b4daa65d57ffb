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

    rates = demo.interleaved_samples_per_second({"fast": sleeper("fast", 0.004), "slow": sleeper("slow", 0.012)},
                                                batch=8, seconds=0.1, warmup=1, rounds=4)
    # 8 samples per call: about 2000 and 667 samples/s (a sleep overshoots a little, never undershoots)
    assert 1500 < rates["fast"] <= 2000 and 500 < rates["slow"] <= 667
    assert 2.5 < rates["fast"] / rates["slow"] < 3.5
    # warm-up, then rounds in rotated order: fast slow | slow fast | fast slow | slow fast, which
    # runs together into 5 stretches (8 without the rotation)
    assert calls[:2] == ["fast", "slow"]
    stretches = [name for i, name in enumerate(calls[2:], 2) if name != calls[i - 1] or i == 2]
    assert stretches == ["fast", "slow", "fast", "slow", "fast"]


@pytest.mark.filterwarnings("ignore::torchplace.errors.PlacementWarning")
def test_the_quick_demo_runs_and_every_placed_model_matches(capsys):
    pytest.importorskip("transformers")
    assert demo.main(quick=True) == 0
    out = capsys.readouterr().out
    assert out.count("throughput (samples/s, side by side)") == 2 and "all outputs matched" in out
