"""Piper on a real model: GPT-2 small (12 layers, 768 wide, 12 heads) profiled for training on this
machine's CPU, planned with data x tensor x pipeline parallelism and recomputation.

    python benchmarks/piper_gpt2.py [--layers 12] [--batch 8] [--seq 128] [--graph results/gpt2_train.json]

Profiles one micro-batch of ``batch`` x ``seq`` tokens (forward and backward of every operator, as
``plan_model(..., mode="training", parallelism="piper")`` does), keeps the profiled training graph
(``--graph``: reused when it exists, so the table can be redone without profiling) and prints, for
each device count K, batch bound N and memory per device, Piper's time per micro-batch, per sample,
and its stages (layers, d, t, layers recomputing). Links: B = 25 GB/s between stages and for the
data-parallel all-reduce, 300 GB/s for tensor-parallel all-reduces (the paper's A100 setting, Sec. 5).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from torchplace.api import prepare  # noqa: E402
from torchplace.devices import Cluster, Device  # noqa: E402
from torchplace.errors import InfeasibleError  # noqa: E402
from torchplace.graph import OpGraph  # noqa: E402
from torchplace.parallelism import piper_plan  # noqa: E402

GIB = 2**30
CONFIGS = [(8, 8, 16), (16, 8, 16), (16, 16, 16), (8, 8, 4), (16, 16, 4)]  # (K, N, GiB per device)


def _model(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, use_cache=False))


def _stages(plan) -> str:
    out = []
    for s in plan.stages:
        blocks = [v.rsplit(".", 1)[-1] if v.startswith("transformer.h.") else v for v in s.nodes]
        rec = sum(x == "activation recomp" for x in s.tmpcs.values())
        out.append(f"[{blocks[0]}..{blocks[-1]} ({len(blocks)}) d={s.data_parallel} t={s.tensor_parallel}"
                   + (f" rc={rec}" if rec else "") + "]")
    return " ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--graph", type=Path, default=ROOT / "benchmarks" / "results" / "gpt2_train.json")
    args = ap.parse_args(argv)
    model = _model(args.layers)
    if args.graph.exists():
        graph = OpGraph.load(args.graph)
        print(f"profiled graph from {args.graph}")
    else:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
        start = time.perf_counter()
        placement = prepare(model, [f"cpu:{i}" for i in range(8)], example_kwargs={"input_ids": ids, "labels": ids},
                            mode="training", parallelism="piper", microbatches=8, warmup=1, repeats=3,
                            progress=False)
        graph = OpGraph.from_json(placement.cache["graph"])
        graph.save(args.graph)
        print(f"profiled in {time.perf_counter() - start:.0f} s ({len(graph)} nodes), saved to {args.graph}")
    print(f"GPT-2, {args.layers} layers, micro-batch {args.batch} x {args.seq} tokens, CPU times; "
          "B = 25 GB/s, tensor-parallel 300 GB/s")
    print(f"{'K':>3} {'N':>3} {'GiB':>4} {'s/micro-batch':>13} {'ms/sample':>9} {'solve s':>7}  stages")
    for k, n, gib in CONFIGS:
        cluster = Cluster(tuple(Device(f"gpu{i}", "cpu", "cpu", gib * GIB) for i in range(k)))
        start = time.perf_counter()
        try:
            _, plan = piper_plan(graph, cluster, model, microbatches=n, solver="auto", recompute=True, time_limit=600,
                                 allreduce_bandwidth=25e9, tensor_bandwidth=300e9)
        except InfeasibleError:
            print(f"{k:>3} {n:>3} {gib:>4} {'OOM':>13}")
            continue
        took = time.perf_counter() - start
        print(f"{k:>3} {n:>3} {gib:>4} {plan.objective:>13.4f} {1e3 * plan.objective / args.batch:>9.2f} "
              f"{took:>7.2f}  {_stages(plan)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
