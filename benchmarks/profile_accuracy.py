"""Fast profiling against exhaustive profiling, node by node, in one process (issue 16 item 4).

Run:  HF_HUB_OFFLINE=1 python benchmarks/profile_accuracy.py [--models gpt2-small demo-cnn ...] [--rounds 3]
                                                              [--threads 1]

``place()`` profiles by signature (``profiling="fast"``) or times every node in each of
``warmup + repeats`` runs of the whole graph (``"exhaustive"``). This benchmark asks what a plan
sees of the difference: each model is traced once, then profiled ``--rounds`` times each way,
alternating (fast, exhaustive, fast, ...), so that both meet the same moments of this shared
machine. The reference time of a node is the median of its times over all those profiles (both
ways: neither is taken as the truth). A *stage* is a run of consecutive nodes in topological
order; the graph is cut where the reference time reaches 1/k, 2/k, ... of the whole, k = 1..4,
as a split would cut it (``stages`` < k where one node holds more than 1/k: GPT-2's head), and
each profile's stage sums are compared with the reference's: the median and largest relative
error over the profiles' stages and the mean signed error (a bias: one way timing low or high).
*Split regret* is what a plan loses by a profile: the best split of the topological order into
at most k runs (the least largest run) under one profile, scored on the reference against the
reference's own best split (the median and the worst over the profiles).
``wall s`` is the median seconds of one profile.

Models: the five transformers of ``benchmarks/place_time.py`` at operator level (batch 4,
sequence 128; GPT-2 small, BERT-base, T5-small, an 8-layer Llama-style decoder, Whisper-tiny) and
the two demo models of ``benchmarks/pipeline_fidelity.py`` at the granularity it places them
(``demo-gpt2``, ``demo-cnn``; batch 16).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import torch

import pipeline_fidelity
import place_time
from torchplace.profiling import profile, trace

PLACE_TIME = ("gpt2-small", "bert-base", "t5-small", "llama-8", "whisper-tiny")
DEMOS = ("demo-gpt2", "demo-cnn")
WAYS = ("fast", "exhaustive")


def _traced(name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The traced model and the inputs it is profiled with."""
    torch.manual_seed(0)
    if name in DEMOS:
        model, args, options = pipeline_fidelity.MODELS[name](32)
        model.eval()
        return trace(model, args, granularity=options.get("granularity", "operator"),
                     leaf_modules=options.get("leaf_modules", ())), args, {}
    model, kwargs = place_time.MODELS[name](False)
    model.eval()
    return trace(model, (), kwargs), (), kwargs


def _stages(order: list[str], ref: dict[str, float], k: int) -> list[list[str]]:
    """``order`` cut into ``k`` runs of about equal reference time (empty runs dropped)."""
    total, out, run, acc = sum(ref.values()), [], [], 0.0
    for v in order:
        run.append(v)
        acc += ref[v]
        if len(out) < k - 1 and acc >= total * (len(out) + 1) / k:
            out.append(run)
            run = []
    out.append(run)
    return [s for s in out if sum(ref[v] for v in s) > 0]


def _best_split(times: list[float], k: int) -> list[int]:
    """Where a split into at most ``k`` runs of consecutive nodes with the least largest run cuts
    ``times`` (indices where runs start after the first): bisection on the largest run, each
    bound tried greedily (a run grows while it fits)."""

    def cuts(limit: float) -> list[int] | None:
        out, acc = [], 0.0
        for i, t in enumerate(times):
            if acc + t > limit and acc > 0:
                out.append(i)
                acc = 0.0
            acc += t
        return out if len(out) < k else None

    lo, hi = max(times), sum(times)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cuts(mid) is not None else (mid, hi)
    return cuts(hi) or []


def _largest_run(times: list[float], starts: list[int]) -> float:
    bounds = [0, *starts, len(times)]
    return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))


def measure(name: str, rounds: int) -> list[dict[str, Any]]:
    """One row per (k, way) for model ``name``."""
    traced, args, kwargs = _traced(name)
    times: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    walls: dict[str, list[float]] = {w: [] for w in WAYS}
    with torch.no_grad():
        for _ in range(rounds):
            for way in WAYS:
                start = time.perf_counter()
                graph = profile(traced, args, kwargs, progress=False, exhaustive=way == "exhaustive")
                walls[way].append(time.perf_counter() - start)
                times[way].append({v: r.times["cpu"] for v, r in graph.records()})
    order = traced.graph.topological_order()
    ref = {v: statistics.median([p[v] for w in WAYS for p in times[w]]) for v in order}
    rows = []
    reference = [ref[v] for v in order]
    for k in (1, 2, 3, 4):
        stages = _stages(order, ref, k)
        best = _largest_run(reference, _best_split(reference, k))
        for way in WAYS:
            errors = [(sum(p[v] for v in s) - sum(ref[v] for v in s)) / sum(ref[v] for v in s)
                      for p in times[way] for s in stages]
            regrets = [_largest_run(reference, _best_split([p[v] for v in order], k)) / best - 1 for p in times[way]]
            rows.append({"model": name, "nodes": len(order), "k": k, "stages": len(stages), "way": way,
                         "wall": statistics.median(walls[way]), "reference": sum(ref.values()),
                         "median": statistics.median(abs(e) for e in errors), "bias": statistics.mean(errors),
                         "max": max(abs(e) for e in errors), "regret": statistics.median(regrets),
                         "worst": max(regrets)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=PLACE_TIME + DEMOS, default=list(PLACE_TIME + DEMOS))
    ap.add_argument("--rounds", type=int, default=3, help="profiles each way, alternating")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (place_time.py profiles at 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, nproc {os.cpu_count()}, {platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} intra-op threads, {args.rounds} rounds, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| model | nodes | k | stages | profiling | wall s | reference ms | median stage error | mean (bias) | max | "
          "split regret, median | worst |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        for r in measure(name, args.rounds):
            rows.append(r)
            print(f"| {r['model']} | {r['nodes']} | {r['k']} | {r['stages']} | {r['way']} | {r['wall']:.2f} | "
                  f"{1e3 * r['reference']:.1f} | {100 * r['median']:.1f}% | {100 * r['bias']:+.1f}% | "
                  f"{100 * r['max']:.1f}% | {100 * r['regret']:+.2f}% | {100 * r['worst']:+.2f}% |", flush=True)
    for way in WAYS:
        mine = [r for r in rows if r["way"] == way and r["k"] > 1]
        median = statistics.median
        print(f"\n{way}: over {len(mine)} (model, k > 1) rows, median of median stage errors "
              f"{100 * median(r['median'] for r in mine):.1f}%, median |bias| "
              f"{100 * median(abs(r['bias']) for r in mine):.1f}%, largest {100 * max(r['max'] for r in mine):.1f}%; "
              f"split regret median {100 * median(r['regret'] for r in mine):+.2f}%, worst "
              f"{100 * max(r['worst'] for r in mine):+.2f}%; median wall {median(r['wall'] for r in mine):.2f} s")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
