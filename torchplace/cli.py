"""The ``torchplace`` command (also ``python -m torchplace``).

    torchplace solve WORKLOAD.json [--method dp] [--json]    solve a dnn-partitioning workload
    torchplace plan MODEL [--devices cpu:0 cpu:1]             place a built-in example model
    torchplace show PLAN.json                                 print a saved plan
    torchplace demo                                           the end-to-end demo
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from torchplace.errors import TorchplaceError

__all__ = ["main"]


def _solve(args: argparse.Namespace) -> int:
    from torchplace import solvers
    from torchplace.workloads import read_dnn_partitioning

    problem = read_dnn_partitioning(args.workload)
    opts = {"ideal_limit": args.ideal_limit} if args.ideal_limit else {}
    plan = solvers.solve(problem, method=args.method, **opts)
    if args.output:
        plan.save(args.output)
    if args.json:
        out = plan.to_json()
        print(json.dumps({k: out[k] for k in ("objective", "lower_bound", "gap", "status", "solver", "seconds",
                                               "assignment", "stages")}, indent=1))
    else:
        print(plan)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import torchplace
    from torchplace.models import build, leaf_modules_for

    model, inputs = build(args.model, batch=args.batch)
    placed = torchplace.place(
        model, args.devices, inputs, microbatches=args.microbatches, granularity=args.granularity,
        leaf_modules=leaf_modules_for(args.model) if args.granularity == "module" else (),
    )
    print(placed.plan)
    print("device_map:", json.dumps(placed.device_map(), indent=1))
    if args.output:
        placed.plan.save(args.output)
    return 0


def _show(args: argparse.Namespace) -> int:
    from torchplace.plan import Plan

    print(Plan.load(args.plan))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torchplace.demo import main as demo_main

    return demo_main(quick=args.quick)


def _parser() -> argparse.ArgumentParser:
    from torchplace.solvers import SOLVERS

    ap = argparse.ArgumentParser(prog="torchplace", description="Optimal placement of PyTorch models across devices.")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("solve", help="solve a dnn-partitioning workload JSON")
    s.add_argument("workload")
    s.add_argument("--method", default="auto", choices=["auto", *SOLVERS])
    s.add_argument("--json", action="store_true", help="print objective, lower_bound, gap, status, assignment, seconds")
    s.add_argument("--ideal-limit", type=int, default=None)
    s.add_argument("-o", "--output", help="also save the plan as JSON here")
    s.set_defaults(func=_solve)
    p = sub.add_parser("plan", help="place a built-in example model and print the plan")
    p.add_argument("model", choices=["mlp", "resnet", "transformer", "gpt2"])
    p.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--granularity", choices=["operator", "module"], default="module")
    p.add_argument("-o", "--output", help="also save the plan as JSON here")
    p.set_defaults(func=_plan)
    w = sub.add_parser("show", help="print a saved plan")
    w.add_argument("plan")
    w.set_defaults(func=_show)
    d = sub.add_parser("demo", help="place GPT-2 and a residual CNN, check outputs, compare throughput")
    d.add_argument("--quick", action="store_true", help="smaller models and fewer timing runs")
    d.set_defaults(func=_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (TorchplaceError, ValueError, FileNotFoundError) as e:
        print(f"torchplace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchplace: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
