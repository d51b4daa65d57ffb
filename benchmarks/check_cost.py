"""What place()'s exactness checks cost: GPT-2 small placed with the checks and with them off.

Run:  HF_HUB_OFFLINE=1 python benchmarks/check_cost.py [--rounds 2]

The checks (torchplace.batchdim: the model beside its trace on one sample, the trace on one and
two samples; torchplace.profiling.gradcheck for training: both models' gradients on two samples)
are switched off by replacing them with no-ops, alternated with the real ones in one process, so
the machine's noise falls on both. Prints the median place() time of each and the difference.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import torchplace
import torchplace.api as api

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_fidelity  # noqa: E402 - the benchmark's GPT-2 small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    checks = (api.rows_needed, api.joined_outputs, api.check_gradients)
    none = (lambda runs: 1, lambda runs, m: None, lambda *a, **k: False)
    model, inputs, options = pipeline_fidelity.MODELS["gpt2-small"](32)
    print(f"{platform.node() or 'machine'}: {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}\n")
    seconds: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for mode in ("inference", "training"):
            for on in (True, False):
                api.rows_needed, api.joined_outputs, api.check_gradients = checks if on else none
                extra = (dict(mode="training", microbatches=4, loss_fn=lambda out, _: out.logits.float().pow(2).mean())
                         if mode == "training" else {})
                x = inputs if mode == "inference" else tuple(t[:8] for t in inputs)
                model.train(mode == "training")
                start = time.perf_counter()
                torchplace.place(model, ["cpu:0", "cpu:1"], x, progress=False, time_limit=10, allow_single_device=False,
                                 **options, **extra)
                seconds.setdefault((mode, on), []).append(time.perf_counter() - start)
    api.rows_needed, api.joined_outputs, api.check_gradients = checks
    print("| GPT-2 small | with the checks | without | cost |\n|---|---|---|---|")
    for mode, what in (("inference", "inference, batch 16"), ("training", "training, batch 8, m = 4")):
        a, b = statistics.median(seconds[(mode, True)]), statistics.median(seconds[(mode, False)])
        print(f"| {what} | {a:.1f} s | {b:.1f} s | +{a - b:.1f} s ({100 * (a / b - 1):.0f}%) |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
