"""Training placed models: predicted vs measured step time, activation memory per schedule, recomputation.

Run:  HF_HUB_OFFLINE=1 python benchmarks/training.py [--steps 5] [--devices cpu:0 cpu:1]

For GPT-2 (transformers, random weights, 4 blocks) and a residual CNN with BatchNorm, placed with
``mode="training"`` on the devices, one row per (model, schedule, micro-batches, recomputation):

* **step time**: the cost model's steady-state load per batch (the plan's objective), the same with
  the schedule's fill and drain (``(m + S - 1) / m`` of it for ``S`` pipeline stages, ``m``
  micro-batches, each micro-batch ``1/m`` of the batch's time) beside the measured median step,
  and the placed step's samples/s beside the unplaced model's on the same micro-batches;
* **activation memory**: per device, the bytes of activations the cost model says the schedule
  keeps in flight (``in_flight x ceil(saved / m)``, or a recomputing device's inputs plus one
  micro-batch) beside the peak measured by counting, per worker, the storages autograd actually
  keeps for backward (:class:`torchplace.runtime.training.SavedBytes`);
* **recomputation**: the same split with every device recomputing: memory down, time up.

Prints a markdown table; the last results are in RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import time
from datetime import date

import torch
from torch import nn

import torchplace
from torchplace import costmodel
from torchplace.models import ResidualCNN
from torchplace.plan import Plan, Stage


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=64, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2047, eos_token_id=2047)
    ids = torch.randint(0, 2048, (16, 64), generator=torch.Generator().manual_seed(1))

    def loss(out, target):
        return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    return GPT2LMHeadModel(config), (ids,), ids, loss, {"granularity": "module", "leaf_modules": ["GPT2Block"]}


def _cnn():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    return ResidualCNN(channels=(16, 32, 32)), (x,), y, nn.functional.cross_entropy, {}


MODELS = {"gpt2": _gpt2, "cnn": _cnn}


def _activations(problem, plan) -> dict[str, int]:
    """Predicted activation bytes in flight per device (the cost model's activation term)."""
    g, m = problem.graph, problem.pipeline.microbatches
    holds = costmodel.in_flight(problem, plan.stages)
    recomputing = {s.device for s in plan.stages if s.recompute}
    out = {}
    for d, nodes in _by_device(plan).items():
        saved = -(-sum(g.record(v).saved_bytes for v in nodes) // m)
        if d in recomputing:
            out[d] = holds[d] * -(-costmodel.stage_input_bytes(problem, nodes) // m) + saved
        else:
            out[d] = holds[d] * saved
    return out


def _by_device(plan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in plan.stages:
        out.setdefault(s.device, []).extend(s.nodes)
    return out


def _time_steps(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name, model_fn, devices, schedule, m, recompute, steps, base_plan=None):
    torch.manual_seed(0)
    model, inputs, target, loss_fn, options = model_fn()
    model.train()
    reference = copy.deepcopy(model)
    placed = torchplace.place(model, devices, inputs, mode="training", microbatches=m, schedule=schedule,
                              allow_single_device=False,
                              progress=False, plan=base_plan, **options)
    plan, problem = placed.plan, placed.problem
    stages = len({s.device for s in plan.stages})
    steady = plan.objective
    with_bubble = steady * (m + stages - 1) / m
    trainer = placed._trainer
    trainer.track_saved()

    def step():
        placed.step(*inputs, target=target, loss_fn=loss_fn)
        model.zero_grad()

    measured = _time_steps(step, steps)

    def unplaced():
        for part, t in zip(zip(*(x.tensor_split(m) for x in inputs)), target.tensor_split(m)):
            (loss_fn(reference(*part), t) / m).backward()
        reference.zero_grad()

    plain = _time_steps(unplaced, steps)
    predicted_mem, peak = _activations(problem, plan), trainer.saved.peak
    batch = len(target)
    mem = " ".join(f"{d}: {predicted_mem.get(d, 0) / 2**20:.2f}/{peak.get(d, 0) / 2**20:.2f}" for d in sorted(predicted_mem))
    print(f"| {name} | {schedule} | {m} | {'yes' if recompute else 'no'} | {steady * 1e3:.1f} | {with_bubble * 1e3:.1f} | "
          f"{measured * 1e3:.1f} | {measured / with_bubble:.2f} | {batch / measured:.1f} | {batch / plain:.1f} | {mem} |",
          flush=True)
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"benchmarks/training.py, {date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"devices {' '.join(args.devices)}, median of {args.steps} steps\n")
    print("| model | schedule | m | recompute | predicted steady ms | predicted with fill/drain ms | measured ms | "
          "measured / predicted | placed samples/s | unplaced samples/s | activations MiB per device, predicted/measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for m in (4, 8):
            plans = {s: _row(name, MODELS[name], args.devices, s, m, False, args.steps) for s in ("gpipe", "1f1b")}
            forced = Plan([Stage(s.device, s.nodes, True) for s in plans["1f1b"].stages], 0.0, 0.0, "recompute-all",
                          0.0, "feasible")
            _row(name, MODELS[name], args.devices, "1f1b", m, True, args.steps, base_plan=forced)
    print("\nActivation memory: predicted = the cost model's in-flight term; measured = the peak of the storages "
          "autograd kept for backward on each worker during the timed steps.")


if __name__ == "__main__":
    main()
