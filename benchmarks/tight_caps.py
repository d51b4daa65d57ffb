"""Tight memory caps: each model placed under the memory of its own uncapped plan, side by side with
and without the repair of :mod:`torchplace.solvers.repair`.

Run:  HF_HUB_OFFLINE=1 python benchmarks/tight_caps.py [--models mlp resnet gpt2 bert] [--training]

Each model is placed on two logical CPUs (``allow_single_device=False``) with 1 and 4
micro-batches, uncapped; each device is then capped at the memory that plan needs there (the
cost model's liveness memory; an unused device at the smallest of them) and the model placed
again, from the same profile (``profile_cache``), so a plan that fits is known to exist: the
uncapped one. Two capped placements are compared in one run: as ``place()`` solves it now, and
with the repair switched off (its pieces never renamed, no work moved: the reserve rounds and the
restriction only, as before the repair). Each row gives what each found (``refused`` where it
raised ``InfeasibleError``), how (``plan.meta["working_memory"]``), its objective over the uncapped
plan's, and, for the plan found with the repair, the measured peak of each device over its cap
(parameters and buffers plus the bytes its worker's operators held at once,
``workers.peak_live_bytes``; above 1.00 the cap was broken in the run).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree

import torchplace
from torchplace import costmodel
from torchplace.errors import InfeasibleError
from torchplace.solvers.repair import Priced

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_fidelity import example_model, mean_square_loss, measured_peaks  # noqa: E402

DEVICES = ["cpu:0", "cpu:1"]


def _place(name: str, training: bool, m: int, cache: str, caps: dict[str, int] | None) -> Any:
    model, args, kwargs = example_model(name)  # a fresh copy: placing moves the model's own tensors
    options: dict[str, Any] = {}
    if training:
        model.train()
        batch = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)).shape[0]
        options = {"mode": "training", "optimizer": "sgd", "schedule": "1f1b", "loss_fn": mean_square_loss,
                   "example_target": torch.zeros(batch)}
    if caps is not None:
        options["max_memory"] = caps
    placed = torchplace.place(model, DEVICES, args, example_kwargs=kwargs, microbatches=m, progress=False,
                              allow_single_device=False, repeats=1, warmup=0, time_limit=20, profile_cache=cache,
                              **options)
    return placed, (args, kwargs), ((options["example_target"], mean_square_loss) if training else None)


def _capped(name: str, training: bool, m: int, cache: str, caps: dict[str, int], repair: bool) -> Any:
    if repair:
        return _place(name, training, m, cache, caps)
    never = Priced(1, math.inf, [])  # "no renaming fits"
    with mock.patch("torchplace.solvers.liveness.repair", lambda *a, **k: None), \
            mock.patch("torchplace.solvers.liveness.least_overflow", lambda *a, **k: never):
        return _place(name, training, m, cache, caps)


def rows(names: list[str], training: bool) -> list[tuple]:
    out = []
    for name in names:
        for m in (1, 4):
            with tempfile.TemporaryDirectory() as cache:
                free, _, _ = _place(name, training, m, cache, None)
                need = costmodel.device_memory(free.problem, free.plan.stages)
                caps = {d: need.get(d, min(need.values())) for d in DEVICES}
                found = {}
                for repair in (True, False):
                    try:
                        found[repair] = _capped(name, training, m, cache, caps, repair)
                    except InfeasibleError:
                        found[repair] = None
            cells = []
            for repair in (True, False):
                placed = found[repair][0] if found[repair] is not None else None
                cells += ["refused", "-", "-"] if placed is None else [
                    "found", placed.plan.meta.get("working_memory", "-"),
                    f"{placed.plan.objective / free.plan.objective:.3f}"]
            over = "-"
            if found[True] is not None:
                placed, call, train = found[True]
                measured_peaks(placed, call, train)  # warm-up
                peaks = measured_peaks(placed, call, train)
                parts = costmodel.device_memory_parts(placed.problem, placed.plan.stages)
                over = ", ".join(
                    f"{(p['parameters'] + p['shared copies'] + next((v for k, v in peaks.items() if d in k), 0)) / caps[d]:.2f}"
                    for d, p in sorted(parts.items()))
            out.append((name, m, ", ".join(f"{caps[d] / 2**20:.2f}" for d in DEVICES), *cells, over))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "resnet", "inception", "transformer", "gpt2", "bert"])
    ap.add_argument("--training", action="store_true", help="one training step (SGD, 1F1B) instead of a call")
    a = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{date.today()}, {'training' if a.training else 'inference'}")
    header = ("model", "m", "caps MiB", "with repair", "how", "objective / uncapped", "without repair", "how",
              "objective / uncapped", "measured peak / cap")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = rows(a.models, a.training)
    for r in results:
        print("| " + " | ".join(map(str, r)) + " |")
    print(f"found with the repair: {sum(r[3] == 'found' for r in results)} of {len(results)}; "
          f"without: {sum(r[6] == 'found' for r in results)} of {len(results)}")


if __name__ == "__main__":
    main()
