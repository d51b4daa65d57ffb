"""Piper on a real model: GPT-2 small (12 layers, 768 wide, 12 heads) profiled for training on this
machine's CPU, planned with data x tensor x pipeline parallelism and recomputation.

    python benchmarks/piper_gpt2.py [--layers 12] [--batch 8] [--seq 128] [--graph results/gpt2_train.json]
    python benchmarks/piper_gpt2.py --estimate cuda     # the model on the meta device, roofline times

Profiles one micro-batch of ``batch`` x ``seq`` tokens (forward and backward of every operator, as
``plan_model(..., mode="training", parallelism="piper")`` does), keeps the profiled training graph
(``--graph``: reused when it exists, so the table can be redone without profiling) and prints, for
each device count K, batch bound N and memory per device, Piper's time per micro-batch, per sample,
and its stages (layers, d, t, layers recomputing). Links: B = 25 GB/s between stages and for the
data-parallel all-reduce, 300 GB/s for tensor-parallel all-reduces (the paper's A100 setting, Sec. 5).
``--estimate KIND`` plans the model built on the meta device instead, with estimated times of a
device of that kind (:mod:`torchplace.profiling.estimate`), nothing profiled.
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
from torchplace.profiling import trace  # noqa: E402

GIB = 2**30
CONFIGS = [(k, n, gib) for k in (8, 16) for n in (8, 16) for gib in (16, 2, 1)]  # (K, N, GiB per device)


def _model(layers: int, meta: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, use_cache=False))


def _kwargs(model, args):
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    return {"input_ids": ids, "labels": ids}


def _profiled(model, args, devices):
    """The training graph ``plan_model(..., parallelism="piper")`` profiles (or estimates), and the
    traced model."""
    placement = prepare(model, devices, example_kwargs=_kwargs(model, args), mode="training",
                        parallelism="piper", microbatches=8, warmup=1, repeats=3, progress=False)
    return OpGraph.from_json(placement.cache["graph"]), placement.traced


def _traced(model, args):
    """The model traced for training as prepare() traces it (for the tensors between layers)."""
    model.train()
    with torch.no_grad():
        return trace(model, (), _kwargs(model, args), training=True)


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
    ap.add_argument("--estimate", default=None, metavar="KIND", help="plan on the meta device with estimated times")
    args = ap.parse_args(argv)
    kind = args.estimate or "cpu"
    model = _model(args.layers, meta=args.estimate is not None)
    if args.estimate is not None:
        graph, traced = _profiled(model, args, [Device(f"d{i}", "cuda", kind, 80 * GIB) for i in range(2)])
    elif args.graph.exists():
        graph, traced = OpGraph.load(args.graph), _traced(model, args)
        print(f"profiled graph from {args.graph}")
    else:
        start = time.perf_counter()
        graph, traced = _profiled(model, args, [f"cpu:{i}" for i in range(2)])
        graph.save(args.graph)
        print(f"profiled in {time.perf_counter() - start:.0f} s ({len(graph)} nodes), saved to {args.graph}")
    source = f"times estimated for {kind!r}" if args.estimate else "CPU times (2 cores)"
    print(f"GPT-2, {args.layers} layers, micro-batch {args.batch} x {args.seq} tokens, {source}; "
          "B = 25 GB/s, tensor-parallel 300 GB/s")
    print(f"{'K':>3} {'N':>3} {'GiB':>4} {'s/micro-batch':>13} {'ms/sample':>9} {'solve s':>7}  stages")
    for k, n, gib in CONFIGS:
        cluster = Cluster(tuple(Device(f"gpu{i}", "cpu", kind, gib * GIB) for i in range(k)))
        start = time.perf_counter()
        try:
            problem, plan = piper_plan(graph, cluster, model, microbatches=n, solver="auto", recompute=True, time_limit=600,
                                 allreduce_bandwidth=25e9, tensor_bandwidth=300e9, traced=traced)
        except InfeasibleError:
            print(f"{k:>3} {n:>3} {gib:>4} {'OOM':>13}")
            continue
        took = time.perf_counter() - start
        if k == CONFIGS[0][0] and n == CONFIGS[0][1] and gib == CONFIGS[0][2]:
            one = sum(r.tmpcs[1][0].time for _, r in problem.graph.records())
            print(f"(one device, all layers t = 1 without recomputation: {one:.4f} s per micro-batch)")
        print(f"{k:>3} {n:>3} {gib:>4} {plan.objective:>13.4f} {1e3 * plan.objective / args.batch:>9.2f} "
              f"{took:>7.2f}  {_stages(plan)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
