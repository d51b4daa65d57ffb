"""Cost-model fidelity: predicted vs measured stage time of placed models (``placed.measure``).

Run:  HF_HUB_OFFLINE=1 python benchmarks/fidelity.py [--runs 5] [--models mlp resnet gpt2 ...]
      [--profiling fast|exhaustive]

For each built-in example model, each device set (2 and 3 logical CPUs) and each objective
(throughput with 4 micro-batches; latency), the model is placed, run ``--runs`` times after a
warm-up, and every stage's measured seconds per call (its spans summed over micro-batches,
:mod:`torchplace.runtime.spans`) is set beside the cost model's prediction
(:func:`torchplace.costmodel.stage_costs`). Prints one markdown row per placement, then the
Pearson correlation and median relative error over all stages of all placements.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
from datetime import date

import torch

import torchplace
from torchplace.models import build, leaf_modules_for
from torchplace.report.fidelity import pearson

DEVICE_SETS = (["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"])


def _place(name: str, devices: list[str], objective: str, profiling: str = "fast"):
    model, inputs = build(name, batch=8)
    options = {"granularity": "module", "leaf_modules": leaf_modules_for(name)} if name in ("gpt2", "bert") else {}
    # the split itself is measured: place() would run these small models on one device
    placed = torchplace.place(model, devices, inputs, objective=objective, microbatches=4, time_limit=5,
                              progress=False, allow_single_device=False, profiling=profiling, **options)
    return placed, inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["mlp", "resnet", "inception", "transformer", "gpt2", "bert"])
    ap.add_argument("--profiling", choices=["fast", "exhaustive"], default="fast", help="place()'s profiling")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{platform.node() or 'machine'}: {os.cpu_count()} cores, torch {torch.__version__}, {date.today()}\n")
    print("| model | devices | objective | stages | Pearson | median abs err | objective pred / meas (s) | wall pred / meas (s) |")
    print("|---|---|---|---|---|---|---|---|")
    xs: list[float] = []
    ys: list[float] = []
    for name in args.models:
        for devices in DEVICE_SETS:
            for objective in ("throughput", "latency"):
                placed, inputs = _place(name, devices, objective, args.profiling)
                m = placed.measure(inputs, runs=args.runs, warmup=2)
                xs += [s.predicted for s in m.stages]
                ys += [s.measured for s in m.stages]
                print(f"| {name} | {len(devices)} CPUs | {objective} | {len(m.stages)} | {m.pearson:.3f} | "
                      f"{100 * m.median_error:.1f}% | {m.predicted_objective:.3g} / {m.measured_objective:.3g} | "
                      f"{m.predicted_wall:.3g} / {m.measured_wall:.3g} |", flush=True)
    errors = [abs(y - x) / x for x, y in zip(xs, ys) if x > 0]
    print(f"\nall {len(xs)} stages: Pearson {pearson(xs, ys):.3f}, median |error| {100 * statistics.median(errors):.1f}%")


if __name__ == "__main__":
    main()
