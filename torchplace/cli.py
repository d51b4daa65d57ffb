"""The ``torchplace`` command (also ``python -m torchplace``).

    torchplace solve WORKLOAD [--method M] [--noncontiguous] [--objective latency]
                     [--time-limit S] [--bounds mip] [--json]   solve a workload file
                     [--accelerators K] [--cpus L]             ... with k accelerators and l CPUs
    torchplace solve PIPER.json --method piper [--devices K] [--memory-gb M] [--microbatches N]
                     [--baseline no-dp|no-tp|no-ar] [--knapsack exact]  Piper (data x tensor x pipeline)
    torchplace methods                                        list the solvers
    torchplace plan MODEL [--devices cpu:0 cpu:1]             place a built-in example model
    torchplace plan MODEL --mode training --parallelism piper [--devices ...] [--microbatches N]
                                                              Piper's plan of an example model
    torchplace plan --hf CONFIG.json --max-memory 0=10GiB cpu=30GiB [--batch B] [--sequence-length S] [--phase decode]
                    [--dtype float16] [--cluster FILE] [--json]  accelerate device_map of a HF config
    torchplace show PLAN.json                                 print a saved plan
    torchrun --nproc-per-node N -m torchplace run PLAN.json --model MODEL [--mode training]
                                                              run a plan, one process per device
                                                              (torch.distributed.pipelining)
    torchplace report PLAN.json -o plan.html [--workload W]   one self-contained HTML report
    torchplace demo                                           the end-to-end demo

A user's mistake (a bad option value, a missing or malformed file, a directory where a file
belongs, an unknown device) ends with one line on stderr, ``torchplace: error: ...``, and exit
status 2, never a traceback. Options are checked by argparse type functions before anything
runs; ``-o`` is written atomically (:func:`torchplace.files.write_json`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from torchplace.checks import positive_float, positive_int
from torchplace.errors import PlacementWarning, TorchplaceError, UsageError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``torchplace: error: ... (see '... --help')``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"torchplace: error: {_one_line(message)} (see '{self.prog} --help')\n")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _checked(check: Callable[..., Any], value: Any, unit: str = "") -> Any:
    """``check(value)`` (a :mod:`torchplace.checks` function) with its error as argparse's."""
    try:
        return check(value, "", unit=unit)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """Type of ``--time-limit``: a positive, finite number of seconds (not ``nan``, ``-1``, ``0``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    return float(_checked(positive_float, value, "of seconds"))


def _amount(text: str) -> float:
    """Type of ``--memory-gb`` and ``--bandwidth-gbs``: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    return float(_checked(positive_float, value))


_FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: an SGD learning rate above it cannot multiply a float32 gradient."""


def _learning_rate(text: str) -> float:
    """Type of ``run --lr``: a positive number a float32 holds (``--lr 1e300`` ended every rank
    with SGD's "value cannot be converted to type float without overflow" traceback)."""
    value = _amount(text)
    if value > _FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a learning rate of at most {_FLOAT32_MAX:.4g} (the largest "
                                         f"float32), got {text!r}")
    return value


def _count_or_auto(text: str) -> int | str:
    """Type of ``plan --microbatches``: ``auto`` or a positive whole number."""
    return "auto" if text == "auto" else _count(text)


def _count(text: str) -> int:
    """Type of ``--batch``, ``--microbatches``, ``--ideal-limit``: a positive whole number (``4.0`` is 4)."""
    try:
        value: float | int = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    return int(_checked(positive_int, value))


def _count_or_zero(text: str) -> int:
    """Type of ``--accelerators`` / ``--cpus``: a whole number >= 0."""
    try:
        return 0 if float(text) == 0 else _count(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None


def _input_file(text: str) -> str:
    """Type of a file to read: it exists and is not a directory."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file")
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


def _output_file(text: str) -> str:
    """Type of ``-o``: not a directory, in a directory that exists and can be written (the
    directory of the file a symbolic link names), or a writable file that is no regular file
    (``/dev/stdout``), which :func:`torchplace.files.write_text` writes in place."""
    if not text or os.path.isdir(text):
        example = os.path.join(text, "plan.json")
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name, e.g. {example!r}")
    if os.path.exists(text) and not os.path.isfile(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
        return text
    parent = os.path.dirname(os.path.realpath(text)) if os.path.islink(text) else os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} is not writable")
    return text


_PIPER_OPTIONS = ("devices", "memory_gb", "microbatches", "bandwidth_gbs")


def _is_piper(path: str) -> bool:
    """Whether ``path`` is a Piper workload (a JSON object with ``mbsInBatch``)."""
    from torchplace.files import read_json

    if path.lower().endswith(".csv"):
        return False
    data = read_json(path, "workload")
    return isinstance(data, dict) and "mbsInBatch" in data


def _read_piper(args: argparse.Namespace):  # -> Problem
    from torchplace.workloads import read_piper

    gib = 2**30
    for flag, value in (("--memory-gb", args.memory_gb), ("--bandwidth-gbs", args.bandwidth_gbs)):
        if value is not None and not math.isfinite(value * gib):  # was "Parallel.memory_bytes must be ... got inf"
            raise UsageError(f"{flag} {value:g}: too large to count in bytes; give at most {1.7e308 / gib:.3g}")
    return read_piper(args.workload, devices=args.devices,
                      memory_bytes=None if args.memory_gb is None else args.memory_gb * gib,
                      microbatches=args.microbatches,
                      bandwidth=None if args.bandwidth_gbs is None else args.bandwidth_gbs * gib)


def _read_workload(path: str, objective: str | None, noncontiguous: bool, accelerators: int | None = None,
                   cpus: int | None = None):  # -> Problem
    """A dnn-partitioning JSON (throughput by default; ``accelerators`` / ``cpus`` override its
    counts) or a MOIRAI CSV (latency; its devices are given per task, so no override)."""
    import dataclasses

    from torchplace.workloads import read_dnn_partitioning, read_moirai_csv

    if path.lower().endswith(".csv"):
        if accelerators is not None or cpus is not None:
            raise UsageError("--accelerators / --cpus apply to dnn-partitioning JSON workloads; a MOIRAI CSV "
                             "gives a time per task and device, so its devices are fixed")
        problem = read_moirai_csv(path)
    else:
        problem = read_dnn_partitioning(path, accelerators=accelerators, cpus=cpus)
    changes: dict[str, object] = {}
    if objective is not None:
        changes["objective"] = objective
    if noncontiguous or (objective or problem.objective) == "latency":
        changes["contiguous"] = False
    return dataclasses.replace(problem, **changes) if changes else problem


def _solve(args: argparse.Namespace) -> int:
    from torchplace import solvers

    if _is_piper(args.workload):
        if args.accelerators is not None or args.cpus is not None:
            raise UsageError("--accelerators/--cpus apply to dnn-partitioning workloads; a Piper workload takes --devices")
        equi = args.method == "piper-equi"
        ignored = [f"{flag} ({why})" for flag, given, why in (
            ("--objective latency", args.objective == "latency", "Piper minimises the time per sample"),
            ("--noncontiguous", args.noncontiguous, "Piper's stages are contiguous, Sec. 3.2"),
            ("--bounds mip", args.bounds == "mip", "Piper's bound is the work over the devices"),
            ("--knapsack", equi and args.knapsack is not None, "equi picks TMPCs without a knapsack"),
            ("--ideal-limit", equi and args.ideal_limit is not None, "equi enumerates no downsets")) if given]
        if ignored:
            raise UsageError(f"on a Piper workload {', '.join(ignored)} would be ignored: leave it out")
        problem = _read_piper(args)
        baseline = {"no-dp": {"data_parallel": False}, "no-tp": {"tensor_parallel": False},
                    "no-ar": {"recompute": False}}.get(args.baseline, {})
        if args.method != "piper-equi":
            baseline = {**baseline, "knapsack": args.knapsack, "ideal_limit": args.ideal_limit}
        opts: dict[str, Any] = baseline
    else:
        given = [f"--{o.replace('_', '-')}" for o in (*_PIPER_OPTIONS, "baseline", "knapsack") if getattr(args, o)]
        if given:
            raise UsageError(f"{', '.join(given)} {_apply(given)} to Piper workloads only (a JSON with 'mbsInBatch')")
        problem = _read_workload(args.workload, args.objective, args.noncontiguous, args.accelerators, args.cpus)
        ignored = [flag for flag, given in (("--ideal-limit", args.ideal_limit is not None), ("--bounds mip", args.bounds == "mip"))
                   if given and problem.objective == "latency"]
        if ignored:
            raise UsageError(f"on a latency workload {', '.join(ignored)} would be ignored (they shape the throughput DP "
                             "and Archer's MIP bounds): leave it out")
        if args.bounds != "combinatorial" and args.method != "auto":
            raise UsageError(f"--bounds {args.bounds} applies with --method auto only (method {args.method!r} proves "
                             "its own bound): leave it out")
        opts = {"ideal_limit": args.ideal_limit, "bounds": args.bounds if args.method == "auto" else None}
    plan = solvers.solve(problem, method=args.method, time_limit=args.time_limit, **opts)
    for name in ("accelerators", "cpus"):  # for `report --workload` to rebuild the same problem
        if getattr(args, name, None) is not None:
            plan.meta[name] = getattr(args, name)
    if args.output:
        plan.save(args.output)
    if args.json:
        out = plan.to_json()
        print(json.dumps({k: out[k] for k in ("objective", "lower_bound", "gap", "status", "solver", "seconds",
                                               "assignment", "stages")}, indent=1))
    else:
        print(plan)
    return 0


def _methods(args: argparse.Namespace) -> int:
    from torchplace.solvers import METHODS

    width = max(map(len, METHODS))
    print(f"{'auto'.ljust(width)}  both        picks by objective and size; reports the best proven bound")
    for name, spec in METHODS.items():
        print(f"{name.ljust(width)}  {spec.objective.ljust(10)}  {spec.summary}")
    return 0


def _max_memory(text: str) -> tuple[Any, str]:
    """Type of ``--max-memory`` items: ``KEY=AMOUNT``, KEY a GPU id, ``cpu`` or ``disk``."""
    key, sep, amount = text.partition("=")
    if not sep or not key or not amount:
        raise argparse.ArgumentTypeError(f"expected DEVICE=AMOUNT like 0=10GiB or cpu=30GiB, got {text!r}")
    return (int(key) if key.isdigit() else key), amount


def _plan_hf(args: argparse.Namespace) -> int:
    """``plan --hf CONFIG.json``: a device map for the model the config describes, planned on the
    meta device (no weights) with estimated costs, and the memory each device needs."""
    from torchplace.hf.config import meta_model
    from torchplace.hf.infer import plan_device_map

    if args.model is not None:
        raise UsageError("give either a built-in MODEL or --hf CONFIG.json, not both")
    keys = [key for key, _ in args.max_memory or []]
    twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if twice is not None:
        raise UsageError(f"--max-memory names device {twice!r} twice: give each device one amount")
    result = plan_device_map(meta_model(args.hf), dict(args.max_memory) if args.max_memory else None,
                             batch_size=args.batch or 1, sequence_length=args.sequence_length, dtype=args.dtype,
                             cluster=args.cluster, time_limit=args.time_limit or 10.0, phase=args.phase,
                             kv_cache=args.kv_cache)
    if args.json:
        print(json.dumps({"device_map": result.device_map, "seconds": result.plan.objective,
                          "lower_bound": result.plan.lower_bound,
                          "memory": {str(k): v for k, v in result.memory.items()},
                          "kv_cache": {str(k): v for k, v in result.kv_cache.items()}}, indent=1))
    else:
        print(result)
        print("device_map:", json.dumps(result.device_map, indent=1))
    if args.output:
        result.plan.save(args.output)
    return 0


def _plan_piper(args: argparse.Namespace, model: Any, inputs: Any) -> int:
    """``plan MODEL --mode training --parallelism piper``: Piper's plan over the model's layers
    (operator granularity, so that Megatron's split of attention and MLP blocks is visible)."""
    import torchplace

    if args.keep_split:
        raise UsageError("--keep-split keeps a pipeline on several devices; Piper's plan is not run here: leave it out")
    plan, _ = torchplace.plan_model(model, args.devices, inputs, mode=args.mode, parallelism="piper",
                                    microbatches=args.microbatches, solver=args.method, time_limit=args.time_limit,
                                    objective=args.objective or "throughput", contiguous=not args.noncontiguous)
    print(plan)
    if args.output:
        plan.save(args.output)
    return 0


_PLAN_ONLY = {  # `plan` options of one path (True: --hf; False: a built-in MODEL), as (flag, dest, default)
    True: (("--max-memory", "max_memory", None), ("--sequence-length", "sequence_length", 128),
           ("--phase", "phase", "prefill"), ("--dtype", "dtype", None), ("--cluster", "cluster", None),
           ("--no-kv-cache", "kv_cache", True), ("--json", "json", False)),
    False: (("--devices", "devices", ["cpu:0", "cpu:1"]), ("--microbatches", "microbatches", None),
            ("--keep-split", "keep_split", False), ("--granularity", "granularity", "module"),
            ("--mode", "mode", "inference"), ("--parallelism", "parallelism", "pipeline"), ("--method", "method", "auto"),
            ("--objective", "objective", None), ("--noncontiguous", "noncontiguous", False)),
}
"""Given on the other path, an option would be ignored: it is refused instead (found by fuzzing)."""


def _plan(args: argparse.Namespace) -> int:
    import torchplace
    from torchplace.models import build, leaf_modules_for

    hf = args.hf is not None
    given = [flag for flag, dest, default in _PLAN_ONLY[not hf] if getattr(args, dest) != default]
    if given and (hf or args.model is not None):
        raise UsageError(f"{', '.join(given)} {_apply(given)} {'to a built-in MODEL, not with --hf' if hf else 'with --hf only'}"
                         f"{'' if hf else '; a built-in MODEL is planned on --devices (place(..., max_memory=) caps them)'}")
    if hf:
        return _plan_hf(args)
    if args.model is None:
        raise UsageError("plan needs a built-in MODEL or --hf CONFIG.json")
    model, inputs = build(args.model, batch=args.batch or 8)
    if args.parallelism == "piper":
        return _plan_piper(args, model, inputs)
    placed = torchplace.place(
        model, args.devices, inputs, microbatches=args.microbatches, granularity=args.granularity,
        leaf_modules=leaf_modules_for(args.model) if args.granularity == "module" else (),
        objective=args.objective or "throughput", contiguous=not args.noncontiguous, solver=args.method,
        time_limit=args.time_limit, allow_single_device=False if args.keep_split else None, mode=args.mode,
        **({"recompute": False} if args.mode == "training" else {}),
    )
    print(placed.plan)
    print("device_map:", json.dumps(placed.device_map(), indent=1))
    if args.output:
        placed.plan.save(args.output)
    return 0


def _run(args: argparse.Namespace) -> int:
    """One process of ``torchrun ... -m torchplace run PLAN.json --model M``: run the plan's stages of
    this rank with torch.distributed.pipelining; the last rank prints the outputs' check and the
    throughput (inference) or the losses (training)."""
    import time

    import torch

    import torchplace.distributed as tpd
    from torchplace.models import build, leaf_modules_for
    from torchplace.plan import Plan

    torch.manual_seed(0)  # the same dropout masks everywhere, and the same model on every rank
    torch.backends.mha.set_fastpath_enabled(False)  # the unsplit model on the path its trace has (not a fused one)
    model, inputs = build(args.model, batch=args.batch)
    saved = Plan.load(args.plan)
    m = args.microbatches or saved.microbatches
    mode = args.mode or saved.meta.get("mode", "inference")
    options = dict(plan=args.plan, mode=mode, microbatches=m, granularity=args.granularity,
                   leaf_modules=leaf_modules_for(args.model) if args.granularity == "module" else (),
                   schedule=args.schedule, timeout=args.timeout, progress=False)
    if mode == "inference":
        with torch.no_grad():  # the unsplit model on the same micro-batches, before the rank frees others' weights
            expected = [model(*(t.tensor_split(m)[i] for t in inputs)) for i in range(m)]
        placed = tpd.place(model, inputs, **options)
        start = time.perf_counter()
        for _ in range(args.steps):
            out = placed.run(*inputs)
        seconds = time.perf_counter() - start
        if placed.is_last:
            same = _equals_joined(out, expected)
            print(f"rank {placed.rank}: outputs equal to the unsplit model: {same}; "
                  f"{args.steps * len(inputs[0]) / seconds:.1f} samples/s over {args.steps} batches")
    else:
        with torch.no_grad():
            target = torch.zeros_like(_first_tensor(model(*inputs)))  # a smoke-test loss: outputs towards zero
        model.train()
        placed = tpd.place(model, inputs, **options)
        params = placed.parameters()
        opt = torch.optim.SGD(params, lr=args.lr) if params else None
        for step in range(args.steps):
            losses = placed.step(*inputs, target=target, loss_fn=_mean_square)
            if opt is not None:
                opt.step()
                opt.zero_grad()
            if placed.is_last:
                print(f"rank {placed.rank}: step {step}: loss {sum(float(v) for v in losses) / len(losses):.6f}")
    placed.close(destroy=True)
    return 0


def _equals_joined(output: Any, parts: list[Any]) -> bool:
    """Whether every tensor of ``output`` (a tensor, a tuple, a dict or a model-output object) is
    bitwise the same tensor of ``parts`` (the outputs of the micro-batches) joined along dim 0."""
    import torch
    from torch.utils._pytree import tree_leaves

    got, split = tree_leaves(output), [tree_leaves(p) for p in parts]
    return all(len(s) == len(got) for s in split) and all(
        torch.equal(g, torch.cat([s[k] for s in split])) for k, g in enumerate(got))


def _first_tensor(output: Any) -> Any:
    from torch.utils._pytree import tree_leaves

    import torch

    return next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))


def _mean_square(output: Any, target: Any) -> Any:
    """``mean((output - target) ** 2)`` on the output's first tensor (logits of a ModelOutput)."""
    return ((_first_tensor(output) - target) ** 2).mean()


def _show(args: argparse.Namespace) -> int:
    from torchplace.plan import Plan

    print(Plan.load(args.plan))
    return 0


def _report(args: argparse.Namespace) -> int:
    import math

    from torchplace import costmodel
    from torchplace.plan import Plan
    from torchplace.report.html import write_report

    plan = Plan.load(args.plan)
    problem = None
    given = [flag for flag, on in (("--objective", args.objective is not None), ("--noncontiguous", args.noncontiguous),
                                   ("--accelerators", args.accelerators is not None), ("--cpus", args.cpus is not None))
             if on]
    if given and not args.workload:
        raise UsageError(f"{', '.join(given)} describe the problem of --workload: give the workload file too, or leave "
                         "them out")
    if args.workload:
        if _is_piper(args.workload):
            raise UsageError(f"{args.workload} is a Piper workload: `report --workload` draws dnn-partitioning and MOIRAI "
                             "workloads; report the Piper plan without --workload")
        noncontiguous = args.noncontiguous or plan.meta.get("contiguous") is False
        recorded = {name: plan.meta.get(name) for name in ("accelerators", "cpus")}  # as `solve` recorded them
        counts = {name: getattr(args, name) if getattr(args, name) is not None else
                  (value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None)
                  for name, value in recorded.items()}
        problem = _read_workload(args.workload, args.objective, noncontiguous=noncontiguous, **counts)
        _check_plan_of(plan, problem, args.plan, args.workload)  # a plan of another graph would draw nonsense
        value = costmodel.evaluate(problem, plan)
        if not math.isclose(value, plan.objective, rel_tol=1e-6, abs_tol=1e-12):
            raise UsageError(f"{args.plan}: its objective {plan.objective:.6g} is not its {problem.objective} on "
                             f"{args.workload} ({value:.6g}): give the --objective, --accelerators and --cpus it was "
                             "solved with")
    write_report(args.output, plan, problem, title=args.title or f"torchplace plan: {os.path.basename(args.plan)}",
                 microbatches=args.microbatches)
    print(f"wrote {args.output}")
    return 0


def _check_plan_of(plan: Any, problem: Any, plan_path: str, workload: str) -> None:
    """Refuse, as a :class:`UsageError` saying which, a plan solved for another workload (other
    nodes) or for other devices of it (``plan.validate`` names the broken constraint)."""
    from torchplace.errors import InvalidPlanError

    nodes, placed = set(problem.graph), {v for s in plan.stages for v in s.nodes}
    if nodes != placed:
        raise UsageError(f"{plan_path} places {len(placed)} nodes and {workload} has {len(nodes)} "
                         f"({len(nodes - placed)} not in the plan, {len(placed - nodes)} of the plan's not in the "
                         "workload): the plan was solved for another workload; give the workload file it was solved for")
    try:
        plan.validate(problem)
    except InvalidPlanError as error:
        raise UsageError(f"{plan_path} is not a valid plan of {workload} as read now ({error}): give the --objective, "
                         "--accelerators, --cpus and --noncontiguous it was solved with") from error


def _demo(args: argparse.Namespace) -> int:
    from torchplace.demo import main as demo_main

    return demo_main(quick=args.quick)


def _add_solver_options(s: argparse.ArgumentParser, methods: list[str]) -> None:
    s.add_argument("--method", default="auto", choices=["auto", *methods],
                   help="solver (see `torchplace methods`); default: auto")
    s.add_argument("--objective", choices=["throughput", "latency"], default=None,
                   help="throughput (pipelined time per sample) or latency (one sample)")
    s.add_argument("--noncontiguous", action="store_true", help="let a device hold several pieces (Tarnawski 5.2)")
    s.add_argument("--time-limit", type=_seconds, default=None, metavar="S", help="seconds for MILPs and searches")


def _parser() -> argparse.ArgumentParser:
    from torchplace.model_names import NAMES
    from torchplace.solvers import METHODS

    ap = _Parser(prog="torchplace", description="Optimal placement of PyTorch models across devices.")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("solve", help="solve a workload: dnn-partitioning JSON or MOIRAI CSV")
    s.add_argument("workload", type=_input_file)
    _add_solver_options(s, list(METHODS))
    s.add_argument("--bounds", choices=["combinatorial", "mip"], default="combinatorial",
                   help="with --method auto: also compute Archer's MIP lower bounds")
    s.add_argument("--json", action="store_true", help="print objective, lower_bound, gap, status, assignment, seconds")
    s.add_argument("--ideal-limit", type=_count, default=None, metavar="N", help="most ideals the DP may enumerate")
    s.add_argument("--accelerators", type=_count_or_zero, default=None, metavar="K",
                   help="accelerators (k) instead of the workload file's maxFPGAs")
    s.add_argument("--cpus", type=_count_or_zero, default=None, metavar="L", help="CPUs (l) instead of the file's maxCPUs")
    s.add_argument("-o", "--output", type=_output_file, help="also save the plan as JSON here (written atomically)")
    s.add_argument("--devices", type=_count, default=None, metavar="K", help="Piper: number of devices (maxDevices)")
    s.add_argument("--memory-gb", type=_amount, default=None, metavar="G", help="Piper: GiB per device")
    s.add_argument("--microbatches", type=_count, default=None, metavar="N", help="Piper: micro-batches per batch")
    s.add_argument("--bandwidth-gbs", type=_amount, default=None, metavar="B", help="Piper: GiB/s between devices")
    s.add_argument("--baseline", choices=["no-dp", "no-tp", "no-ar"], default=None,
                   help="Piper: forgo data parallelism, tensor parallelism or recomputation (Sec. 5)")
    s.add_argument("--knapsack", choices=["heuristic", "exact"], default=None,
                   help="Piper: the paper's TMPC heuristic (default) or HiGHS exactly (slow)")
    s.set_defaults(func=_solve)
    p = sub.add_parser("plan", help="place a built-in example model and print the plan")
    p.add_argument("model", choices=list(NAMES), nargs="?")
    p.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"])
    p.add_argument("--batch", type=_count, default=None, help="batch size (default 8; with --hf 1)")
    p.add_argument("--hf", type=_input_file, metavar="CONFIG.json",
                   help="plan an accelerate device_map for the Hugging Face model of this config (built on the "
                        "meta device: no weights, estimated costs)")
    p.add_argument("--max-memory", nargs="+", type=_max_memory, metavar="DEVICE=AMOUNT",
                   help="with --hf: accelerate's max_memory, e.g. 0=10GiB 1=10GiB cpu=30GiB [disk=1TiB]")
    p.add_argument("--sequence-length", type=_count, default=128, help="with --hf: tokens per sequence (KV cache)")
    p.add_argument("--phase", choices=["prefill", "decode"], default="prefill",
                   help="with --hf: minimise the forward pass of the batch, or the time per generated token")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="with --hf: dtype of the dispatched weights")
    p.add_argument("--cluster", type=_input_file, default=None, help="with --hf: cluster file giving GPU kinds")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="with --hf: leave no room for a KV cache (a model that keeps none, e.g. Mamba)")
    p.add_argument("--json", action="store_true", help="with --hf: print the map, time and memory as JSON")
    p.add_argument("--microbatches", type=_count_or_auto, default=None, metavar="N|auto",
                   help="micro-batches per call (default 4; not with --objective latency), or 'auto': the m with "
                        "the fastest predicted call")
    p.add_argument("--keep-split", action="store_true",
                   help="keep the split even where the whole model on one device is predicted faster, or the "
                        "split faster by less than 10%%")
    p.add_argument("--granularity", choices=["operator", "module"], default="module")
    p.add_argument("--mode", choices=["inference", "training"], default="inference",
                   help="training: a plan for training steps (no recomputation, so `torchplace run` can run it)")
    p.add_argument("--parallelism", choices=["pipeline", "piper"], default="pipeline",
                   help="piper (with --mode training): data x tensor x pipeline parallelism and recomputation "
                        "(Piper), the example batch one micro-batch, --microbatches Piper's N; prints the plan")
    _add_solver_options(p, list(METHODS))
    p.add_argument("-o", "--output", type=_output_file, help="also save the plan as JSON here (written atomically)")
    p.set_defaults(func=_plan)
    m = sub.add_parser("methods", help="list the solvers and what each optimises")
    m.set_defaults(func=_methods)
    u = sub.add_parser("run", help="run a plan with torch.distributed.pipelining, one process per device (start it "
                       "with torchrun --nproc-per-node N -m torchplace run ...)")
    u.add_argument("plan", type=_input_file)
    u.add_argument("--model", choices=list(NAMES), required=True, help="the built-in model the plan was made for")
    u.add_argument("--mode", choices=["inference", "training"], default=None,
                   help="default: the plan's (a training plan trains)")
    u.add_argument("--batch", type=_count, default=8)
    u.add_argument("--microbatches", type=_count, default=None,
                   help="micro-batches per batch (default: the plan's, else 4)")
    u.add_argument("--granularity", choices=["operator", "module"], default="module",
                   help="as when the plan was made (torchplace plan's default: module)")
    u.add_argument("--schedule", choices=["gpipe", "1f1b", "looped-bfs", "interleaved-1f1b", "zero-bubble"],
                   default=None, help="the engine's schedule (default: the plan's)")
    u.add_argument("--steps", type=_count, default=5, help="batches (inference) or optimizer steps (training)")
    u.add_argument("--lr", type=_learning_rate, default=0.01, help="training: SGD learning rate")
    u.add_argument("--timeout", type=_seconds, default=60.0, help="seconds any rank waits for a peer")
    u.set_defaults(func=_run)
    w = sub.add_parser("show", help="print a saved plan")
    w.add_argument("plan", type=_input_file)
    w.set_defaults(func=_show)
    r = sub.add_parser("report", help="write one self-contained HTML report of a saved plan")
    r.add_argument("plan", type=_input_file)
    r.add_argument("-o", "--output", type=_output_file, required=True, help="the HTML file to write")
    r.add_argument("--workload", type=_input_file, help="the workload file the plan was solved for (adds the graph, "
                   "memory by kind and the simulated schedule)")
    r.add_argument("--objective", choices=["throughput", "latency"], default=None, help="the workload's objective")
    r.add_argument("--noncontiguous", action="store_true", help="the plan was solved with --noncontiguous")
    r.add_argument("--accelerators", type=_count_or_zero, default=None, metavar="K",
                   help="the --accelerators the plan was solved with")
    r.add_argument("--cpus", type=_count_or_zero, default=None, metavar="L", help="the --cpus the plan was solved with")
    r.add_argument("--microbatches", type=_count, default=None, help="micro-batches of the drawn pipeline (default: the plan's, else 4)")
    r.add_argument("--title", default=None)
    r.set_defaults(func=_report)
    d = sub.add_parser("demo", help="place GPT-2 and a residual CNN, check outputs, compare throughput")
    d.add_argument("--quick", action="store_true", help="smaller models and fewer timing runs")
    d.set_defaults(func=_demo)
    return ap


def _check_output_is_no_input(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` when ``-o`` names a file the command reads (``solve W -o W``
    wrote the plan over the workload; ``report P -o P`` the HTML over the plan: found by fuzzing)."""
    output = getattr(args, "output", None)
    if not output or not os.path.exists(output):
        return
    for flag, dest in (("the workload", "workload"), ("the plan", "plan"), ("the --hf", "hf"), ("the --cluster", "cluster")):
        given = getattr(args, dest, None)
        if isinstance(given, str) and os.path.exists(given) and os.path.samefile(output, given):
            raise UsageError(f"-o {output} is {flag} file this command reads ({given}): writing there would replace "
                             "it; give another file name")


def _fail(message: str) -> int:
    print(f"torchplace: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _apply(options: Sequence[str]) -> str:
    """The verb for a list of command-line options: one "applies", several "apply"."""
    return "applies" if len(options) == 1 else "apply"


def _one_line_warnings(shown: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` printing torchplace's own warnings as one line,
    ``torchplace: warning: ...``, without the Python file and line they were raised at
    (``<frozen runpy>:88:`` under ``python -m``); others go to ``shown``."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if issubclass(category, PlacementWarning):
            print(f"torchplace: warning: {message}", file=sys.stderr if file is None else file)
        else:
            shown(message, category, filename, lineno, file, line)
    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (0 done, 2 a user error, 130 interrupted).

    A user error prints one line on stderr, ``torchplace: error: ...``, and returns 2.
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a usage error already reported on one line (2)
        return e.code if isinstance(e.code, int) else int(e.code is not None) * 2
    try:
        _check_output_is_no_input(args)
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            return int(args.func(args))
    except BrokenPipeError:  # `torchplace solve W --json | head`: the reader left; end quietly
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - flushing at exit must not raise again
        except OSError:
            pass
        return 141
    except (TorchplaceError, ValueError) as e:
        return _fail(str(e))
    except OSError as e:  # a file that vanished or cannot be written after the options were checked
        return _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except KeyboardInterrupt:
        print("torchplace: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
