"""One plan, two runtimes: torchplace's threaded executor and torch.distributed.pipelining (2 processes).

Run:  HF_HUB_OFFLINE=1 python benchmarks/distributed.py [--seconds 3] [--batch 64] [--microbatches 4]

For an MLP (width 512, 8 layers) placed on ``cpu:0`` and ``cpu:1``, once for inference and once
for training (SGD steps, 1F1B), the plan is solved once and saved; then

* **threads**: ``torchplace.place(..., plan=PLAN)`` runs it in this process, one worker thread per
  device, each with one intra-op thread;
* **engine**: two processes (``RANK`` 0 and 1, gloo over 127.0.0.1, ``OMP_NUM_THREADS=1``), each
  ``torchplace.distributed.place(..., plan=PLAN)``, time the same calls after a barrier;
* **predicted**: ``batch / plan.objective`` (the objective is the cost model's steady-state load per
  batch of the example inputs; no fill or drain).

Prints a markdown table (samples/s) beside the machine; the last results are in RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

import torchplace
from torchplace.demo import samples_per_second

ROOT = Path(__file__).resolve().parents[1]


def build(batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(batch, 512), torch.randn(batch, 512)


def threaded(plan: str, mode: str, args: argparse.Namespace) -> float:
    """Samples/s of the plan on worker threads in this process."""
    model, x, y = build(args.batch)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), plan=plan, mode=mode, microbatches=args.microbatches,
                              progress=False, warmup=0, repeats=1, **_training(mode))
    if mode == "inference":
        with torch.no_grad():
            return samples_per_second(lambda: placed(x), args.batch, args.seconds)
    opt = torch.optim.SGD(placed.parameters(), lr=1e-3)

    def step() -> None:
        placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()

    return samples_per_second(step, args.batch, args.seconds)


def _training(mode: str) -> dict:
    return {"recompute": False, "schedule": "1f1b"} if mode == "training" else {}


def engine(plan: str, mode: str, args: argparse.Namespace) -> float:
    """Samples/s of the plan run by torch.distributed.pipelining in two processes (rank 1's clock)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp())
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank-worker", plan, mode, str(out), "--seconds", str(args.seconds),
         "--batch", str(args.batch), "--microbatches", str(args.microbatches)],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
        for r in range(2)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"an engine rank exited with status {p.returncode}")
    return float(json.loads((out / "result.json").read_text())["samples_per_second"])


def rank_worker(plan: str, mode: str, out: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import torchplace.distributed as tpd

    torch.set_num_threads(1)
    model, x, y = build(args.batch)
    placed = tpd.place(model, (x,), plan=plan, mode=mode, microbatches=args.microbatches, progress=False,
                       warmup=0, repeats=1, **_training(mode))
    if mode == "inference":
        call = lambda: placed.run(x)  # noqa: E731
    else:
        opt = torch.optim.SGD(placed.parameters(), lr=1e-3)

        def call() -> None:
            placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
            opt.step()
            opt.zero_grad()

    call()  # warm-up: the engine infers shapes on its first step
    runs = _agreed_runs(call, args.seconds)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(runs):
        call()
    dist.barrier()
    seconds = time.perf_counter() - start
    if placed.rank == 1:
        Path(out, "result.json").write_text(json.dumps({"samples_per_second": args.batch * runs / seconds}))
    placed.close()


def _agreed_runs(call, seconds: float) -> int:
    """How many calls fill ``seconds`` (timed on rank 0's two calls), the same on every rank."""
    import torch.distributed as dist

    start = time.perf_counter()
    call()
    call()
    n = torch.tensor([max(3, int(seconds / max((time.perf_counter() - start) / 2, 1e-6)))])
    dist.broadcast(n, src=0)
    return int(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rank-worker", nargs=3, metavar=("PLAN", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(*args.rank_worker, args)
        return
    torch.set_num_threads(1)  # each device one intra-op thread, as each engine process has
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("inference", "training"):
            model, x, _ = build(args.batch)
            placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode=mode, microbatches=args.microbatches,
                                      progress=False, allow_single_device=False, **_training(mode))
            plan = str(Path(tmp, f"{mode}.json"))
            placed.plan.save(plan)
            stages = " -> ".join(s.device for s in placed.plan.stages)
            rows.append((mode, stages, args.batch / placed.plan.objective, threaded(plan, mode, args), engine(plan, mode, args)))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"{date.today()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, no GPU; MLP 8 x 512, batch "
          f"{args.batch}, {args.microbatches} micro-batches, 1 intra-op thread per device\n")
    print("| mode | stages | predicted samples/s | threads samples/s | engine (2 processes) samples/s |")
    print("|---|---|---:|---:|---:|")
    for mode, stages, predicted, t, e in rows:
        print(f"| {mode} | {stages} | {predicted:.0f} | {t:.0f} | {e:.0f} |")


if __name__ == "__main__":
    main()
