"""Cost-model fidelity: predicted vs measured stage time of placed models (``placed.measure``).

Run:  HF_HUB_OFFLINE=1 python benchmarks/fidelity.py [--runs 5] [--models mlp resnet gpt2 ...]
      [--profiling fast|exhaustive] [--devices cuda:0,cpu --cap 0.3 0.6]

For each built-in example model, each device set (2 and 3 logical CPUs, or the ``--devices`` sets:
comma-separated, e.g. ``cuda:0,cpu``; with ``--cap`` the first device of a set holds at most that
share of the model's parameter bytes, once per share, so that a fast GPU must split) and each objective
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


def _place(name: str, devices: list[str], objective: str, profiling: str = "fast", cap: float | None = None):
    model, inputs = build(name, batch=8)
    options = {"granularity": "module", "leaf_modules": leaf_modules_for(name)} if name in ("gpt2", "bert") else {}
    if cap is not None:
        options["max_memory"] = {devices[0]: int(cap * sum(p.numel() * p.element_size() for p in model.parameters()))}
    # the split itself is measured: place() would run these small models on one device
    placed = torchplace.place(model, devices, inputs, objective=objective, microbatches=4, time_limit=5,
                              progress=False, allow_single_device=False, profiling=profiling, **options)
    return placed, inputs


def _sets(args: argparse.Namespace) -> list[tuple[list[str], float | None]]:
    """(devices, cap of the first device as a share of the parameter bytes) per placement."""
    if not args.devices:
        return [(list(d), None) for d in DEVICE_SETS]
    return [(d.split(","), cap) for d in args.devices for cap in (args.cap or [None])]


def _label(devices: list[str], cap: float | None) -> str:
    if all(d.startswith("cpu") for d in devices):
        return f"{len(devices)} CPUs"
    return " + ".join(devices) + ("" if cap is None else f" ({devices[0]} <= {cap:g} params)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["mlp", "resnet", "inception", "transformer", "gpt2", "bert"])
    ap.add_argument("--profiling", choices=["fast", "exhaustive"], default="fast", help="place()'s profiling")
    ap.add_argument("--devices", nargs="+", help="device sets, comma-separated (default: 2 and 3 logical CPUs)")
    ap.add_argument("--cap", nargs="+", type=float, help="the first device's memory: shares of the parameter bytes")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{platform.node() or 'machine'}: {os.cpu_count()} cores, torch {torch.__version__}, {date.today()}\n")
    print("| model | devices | objective | stages | Pearson | median abs err | objective pred / meas (s) | wall pred / meas (s) |")
    print("|---|---|---|---|---|---|---|---|")
    xs: list[float] = []
    ys: list[float] = []
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for name in args.models:
        for devices, cap in _sets(args):
            for objective in ("throughput", "latency"):
                placed, inputs = _place(name, devices, objective, args.profiling, cap)
                m = placed.measure(inputs, runs=args.runs, warmup=2)
                xs += [s.predicted for s in m.stages]
                ys += [s.measured for s in m.stages]
                for s in m.stages:
                    by_kind.setdefault(s.device.split(":")[0], []).append((s.predicted, s.measured))
                where = " ".join(f"{s.device}x{len(s.nodes)}" for s in placed.plan.stages)
                print(f"| {name} | {_label(devices, cap)}: {where} | {objective} | {len(m.stages)} | {m.pearson:.3f} | "
                      f"{100 * m.median_error:.1f}% | {m.predicted_objective:.3g} / {m.measured_objective:.3g} | "
                      f"{m.predicted_wall:.3g} / {m.measured_wall:.3g} |", flush=True)
    errors = [abs(y - x) / x for x, y in zip(xs, ys) if x > 0]
    print(f"\nall {len(xs)} stages: Pearson {pearson(xs, ys):.3f}, median |error| {100 * statistics.median(errors):.1f}%")
    if len(by_kind) > 1:
        for kind, pairs in sorted(by_kind.items()):
            e = [abs(y - x) / x for x, y in pairs if x > 0]
            print(f"{kind} stages ({len(pairs)}): Pearson {pearson(*zip(*pairs)):.3f}, "
                  f"median |error| {100 * statistics.median(e):.1f}%")


if __name__ == "__main__":
    main()
