"""Run a torchplace plan with ``torch.distributed.pipelining``: one process per device, launched by torchrun.

    # train.py, launched as: torchrun --nproc-per-node 2 train.py
    placed = torchplace.distributed.place(model, (x,), microbatches=4)     # plan solved on rank 0
    y = placed.run(x)                        # the model's output on the last rank (None elsewhere)
    opt = torch.optim.AdamW(placed.parameters())                          # this rank's parameters
    losses = placed.step(x, target=t, loss_fn=f); opt.step(); opt.zero_grad()

Rank ``r`` runs the stages of the plan's ``r``-th device (``devices[r]``, or the plan's devices in
order of first appearance): on ``cuda:LOCAL_RANK`` with NCCL where CUDA is present and the devices
are GPUs, else on the CPU with gloo. A plan whose stages have ``data_parallel=d`` and
``tensor_parallel=t`` (the same on every stage) runs on ``P * d * t`` processes for its ``P``
devices: rank ``(k * d + j) * t + i`` runs device ``k``'s stages in pipeline copy ``j``, as
tensor-parallel rank ``i`` (:mod:`torchplace.runtime.dist_replicas`,
:mod:`torchplace.runtime.dist_tensor`). The plan is solved once, on rank 0, and handed to the other
ranks through the rendezvous store, or loaded from a plan file on every rank (``plan=``). Each
rank keeps only its own stages' tensors (the rest go to the meta device) and may load its slice of
a checkpoint (``state_dict=``). The bridge itself is :mod:`torchplace.runtime.distributed`; faults
are :mod:`torchplace.runtime.dist_faults`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchplace.checks import brief, positive_float, positive_int
from torchplace.devices import Cluster, Device
from torchplace.errors import (DistributedError, InfeasibleError, InvalidPlanError, PlacementWarning, UnsupportedError,
                               UsageError, warn_caller)
from torchplace.plan import DEFAULT_MICROBATCHES, Plan
from torchplace.problem import Problem
from torchplace.profiling.cache import KEY as CACHE_KEY
from torchplace.fxutil import dtype_guards
from torchplace.runtime.devices import check_autocast, check_eager_call
from torchplace.runtime.structure import Structure

__all__ = ["DistributedPlaced", "launch_env", "place"]

_PLAN_KEY = "torchplace/plan"
_POLL_S = 0.5  # seconds between the other ranks' looks for a fault while rank 0 solves
_CALLS = 0  # place() calls in this process
MAX_TIMEOUT = 1e9
"""The longest ``timeout`` in seconds: torch.distributed adds it to a steady clock in int64
nanoseconds, so about 9e9 s overflows (``--timeout 1e10`` timed out at once; 1e300 was an
``OverflowError`` traceback: found by fuzzing)."""


def launch_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` of this process, from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``) or an initialised default process group.

    Raises:
        DistributedError: when neither says (the script was not started by torchrun).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise DistributedError("RANK and WORLD_SIZE are not set: start the script with torchrun, e.g. "
                               "'torchrun --nproc-per-node 2 script.py', or initialise torch.distributed first") from None


def place(
    model: nn.Module,
    example_inputs: Any = (),
    *,
    devices: Sequence[str | Device] | Cluster | None = None,
    plan: Plan | str | Path | None = None,
    mode: str = "inference",
    microbatches: int | None = None,
    schedule: str | None = None,
    timeout: float = 60.0,
    plan_timeout: float = 1800.0,
    backend: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | str | Path | None = None,
    **options: Any,
) -> DistributedPlaced:
    """Place ``model`` over the processes of a torchrun launch and build this rank's pipeline stages.

    Every rank calls it with the same model (same weights: seed it, or pass ``state_dict``) and
    example inputs. Launch checks come before any communication: the number of processes must be
    the number of devices (of ``devices``, or of the plan file), and a plan file must place this
    model's graph.

    Data x tensor x pipeline: a ``plan`` whose stages have ``data_parallel=d`` and
    ``tensor_parallel=t`` (a plan file, or ``Plan`` built by hand with ``Stage(device, nodes,
    data_parallel=2)``; the same degrees on every stage) runs on the sum over its devices of
    ``d * t`` processes (``torchrun --nproc-per-node 4`` for 2 devices with ``d=2``). Rank
    ``(k * d + j) * t + i`` runs the stages of the plan's ``k``-th device in copy ``j`` of the
    pipeline, as tensor-parallel rank ``i``. Every rank passes the whole batch; copy ``j`` takes
    its ``j``-th of ``d`` equal parts (``microbatches / d`` micro-batches), and after each
    ``step`` the gradients are averaged over the copies, so the parameters move as one pipeline's
    on the whole batch (the gradient of the mean micro-batch loss). With ``t > 1`` each stage's
    ``nn.Linear`` pairs (Linear, elementwise operators, Linear) are split Megatron-style by
    ``torch.distributed.tensor.parallel`` (``ColwiseParallel`` then ``RowwiseParallel``): the
    plan must be traced with ``leaf_modules=[torch.nn.Linear]`` (pass the same here), the split
    parameters become ``DTensor`` slices (``p.full_tensor()`` joins them), and outputs are
    allclose to the model's, no longer bitwise. ``run`` and ``step`` return the whole batch's
    outputs and losses on every copy's last rank.

    Args:
        model: the model (every rank traces it; each then keeps only its stages' tensors).
        example_inputs: positional inputs of a representative call; batch on dim 0.
        devices: one device per rank, in rank order (default: ``cuda:0`` ... where CUDA is present,
            else ``cpu:0`` ... ``cpu:{N-1}``), or a :class:`Cluster` (e.g. from a cluster file, whose
            links price the transfers between hosts).
        plan: a :class:`Plan` or plan file to run instead of solving (checked on every rank).
        mode: ``"inference"`` or ``"training"`` (solved for the training pipeline, as
            :func:`torchplace.place` does).
        microbatches: micro-batches per batch (the engine's ``n_microbatches``; default the given
            plan's, else 4); with ``d`` copies, a multiple of ``d``, and each copy runs
            ``microbatches / d``.
        schedule: one of :data:`torchplace.runtime.distributed.SCHEDULES`, whose activations in
            flight the plan counts (:data:`~torchplace.runtime.distributed.PRICED_AS`); default: the
            given plan's training schedule, else ``"1f1b"``, looped where a rank holds several
            stages; or ``"gpipe"`` where the engine does not run that one for this layout and
            micro-batch count (1F1B needs one per engine stage at least, the interleaved form a
            multiple of ``max(1, m // ranks)``): then the plan's memory is counted again for GPipe,
            with a :class:`~torchplace.errors.PlacementWarning` naming what grew, and
            :class:`~torchplace.errors.InfeasibleError` where a device cannot hold it. A schedule
            given here that the engine refuses is refused while placing.
        timeout: seconds of the process group's timeout: the longest any rank waits for a peer.
        plan_timeout: seconds the other ranks wait for rank 0 to solve.
        backend: ``"gloo"`` or ``"nccl"`` (default: NCCL on GPUs, gloo on the CPU; NCCL on the
            CPU is refused).
        state_dict: a checkpoint of the model (mapping, or a ``torch.save`` file read with
            ``mmap=True``): each rank copies in only the tensors of its own stages. Required for a
            model built on the meta device (``with torch.device("meta"): model = Net()``), which
            each rank then materialises only for its own stages (see :func:`_materialize_lazily`).
        **options: further options of :func:`torchplace.api.prepare` (``solver``, ``time_limit``,
            ``granularity``, ``leaf_modules``, ``contiguous``, ``optimizer``, ...).

    Returns:
        This rank's :class:`DistributedPlaced`.

    Raises:
        DistributedError: not launched by torchrun, or the number of processes differs from the
            number of devices (times ``d * t``; the message names the ``--nproc-per-node`` to
            use); a failure on any rank while planning.
        InvalidPlanError: ``plan`` does not place this model, or gives one device's stages
            different degrees.
        UsageError, UnsupportedError: as :func:`torchplace.place`, and for plans the engine cannot
            run (recomputation, a model that writes its inputs in place, degrees that differ
            between devices, ``microbatches`` not a multiple of ``d``, a stage with ``t > 1`` but
            no Linear pair to split, ``state_dict`` with ``t > 1``, a ``schedule`` the engine
            refuses for this layout and micro-batch count); a ``timeout`` or ``plan_timeout`` that
            is not a positive number of seconds, a ``timeout`` above :data:`MAX_TIMEOUT`;
            ``backend="nccl"`` on the CPU.
        InfeasibleError: as :func:`torchplace.place`; and where the engine runs GPipe instead of
            the planned schedule (see ``schedule``) and a device cannot hold its activations.

    Example::

        # plan.json's stages have data_parallel=2 on cpu:0, cpu:1: torchrun --nproc-per-node 4 train.py
        placed = place(model, (x,), plan="plan.json", mode="training", microbatches=4)
        losses = placed.step(x, target=y, loss_fn=f)  # copy 0 (ranks 0, 2) trains on x[:B/2], copy 1 (1, 3) on x[B/2:]
    """
    import torch.distributed as dist

    from torchplace import api
    from torchplace.runtime.distributed import PRICED_AS, SCHEDULES, release_abandoned

    given = api._load_plan(plan) if plan is not None else None
    if given is not None:  # before asking for torchrun: a Piper plan runs under no launch
        api.check_runnable(given, plan)  # type: ignore[arg-type]
    rank, world, local_rank = launch_env()
    if mode not in ("inference", "training"):
        raise UsageError(f"mode must be 'inference' or 'training', got {mode!r}")
    timeout = positive_float(timeout, "timeout", unit="of seconds")
    if timeout > MAX_TIMEOUT:
        raise UsageError(f"timeout: at most {MAX_TIMEOUT:g} seconds (about 31 years; torch.distributed counts its "
                         f"deadline in int64 nanoseconds), got {timeout:g}")
    plan_timeout = positive_float(plan_timeout, "plan_timeout", unit="of seconds")
    if schedule is not None and schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {list(SCHEDULES)} (or None: the plan's), got {brief(schedule)}")
    if options.get("allow_single_device") not in (None, False) and world > 1:
        raise UsageError(f"allow_single_device={brief(options['allow_single_device'])}: {world} processes were launched, "
                         "one per device, and a one-device plan would leave all but one with nothing to run; leave it "
                         "out (the split is kept), or run the model in one process with torchplace.place()")
    _materialize_lazily(model, state_dict)
    if microbatches is None:
        microbatches = DEFAULT_MICROBATCHES if given is None else given.microbatches
    microbatches = positive_int(microbatches, "microbatches")
    degrees = _degrees(given) if given is not None else (1, 1)
    copies = degrees[0]
    rank_devices = _rank_devices(devices, given, world, degrees)
    if degrees[1] > 1 and state_dict is not None:
        raise UnsupportedError("state_dict= with tensor_parallel > 1: the ranks of a stage shard its weights after "
                               "placing; load the checkpoint into the model before place() instead")
    if microbatches % copies:
        raise UsageError(f"{microbatches} micro-batches do not split among the plan's {copies} data-parallel copies: "
                         f"pass microbatches= a multiple of {copies} (each copy runs microbatches / {copies})")
    device, backend = _torch_device(rank_devices, local_rank, backend)
    common = dict(options, mode=mode, microbatches=microbatches)
    common.setdefault("allow_single_device", False)  # one process per device was launched: keep the split
    common["sends_tensors_only"] = True  # the engine sends tensors only: no stage boundary inside chunk -> items
    if given is not None:  # a given plan is checked as it is: contiguity constrains solvers, not the runtime
        common.setdefault("contiguous", False)
    if mode == "training":
        common.setdefault("recompute", False)  # the bridge does not recompute; the cost model must not count on it
        # the plan counts the activations in flight of the schedule that runs: the one given here, else the plan's
        planned = PRICED_AS[schedule] if schedule is not None else given.meta.get("schedule") if given else None
        if planned is not None:
            common["schedule"] = planned
    placement = None
    if given is not None:  # check the plan on every rank before any communication
        placement = api.prepare(model, devices if devices is not None else rank_devices, example_inputs,
                                plan=given, **_quick(common))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    release_abandoned()  # an earlier placement's failed call: free the peers it left blocked on this rank
    from torchplace.runtime.dist_faults import FAULT, Faults

    global _CALLS
    _CALLS += 1  # every rank places the same models in the same order: one plan and fault key per call
    faults = Faults(dist.distributed_c10d._get_default_store(), rank, world, key=f"{FAULT}/{_CALLS}")
    try:
        if state_dict is None:  # with one, each rank loads its own stages' tensors from it
            _check_same_weights(model, device)
        if placement is None:
            placement = _solve_once(model, devices if devices is not None else rank_devices, example_inputs, common,
                                    faults, plan_timeout, f"{_PLAN_KEY}/{_CALLS}")
            _all_placed(faults, f"{_PLAN_KEY}/{_CALLS}/placed", timeout)
        return DistributedPlaced(placement, [_name(d) for d in rank_devices], rank, world, device, faults,
                                 schedule, state_dict, degrees=degrees, timeout=timeout)
    except Exception as error:
        faults._publish(f"rank {rank} failed while placing: {type(error).__name__}: {error}")
        faults.close()
        raise


def _priced_for_fallback(problem: Problem, plan: Plan, refused: str) -> tuple[Problem, Plan]:
    """The problem and plan as the engine runs them when it refused the planned schedule
    (``refused`` says why) and runs GPipe instead: the plan's memory re-counted with every
    micro-batch's activations in flight, and a :class:`PlacementWarning` naming what grew.

    Raises:
        InfeasibleError: a device cannot hold what GPipe keeps in flight.
    """
    from torchplace import costmodel
    from torchplace.units import format_bytes

    planned = problem.pipeline
    if planned is None or planned.schedule == "gpipe":
        return problem, plan
    ran = dataclasses.replace(problem, pipeline=dataclasses.replace(planned, schedule="gpipe"))
    before, after = costmodel.device_memory(problem, plan.stages), costmodel.device_memory(ran, plan.stages)
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
    over = [d for d, need in after.items() if caps.get(d) is not None and need > caps[d]]
    if over:
        raise InfeasibleError(
            f"{refused}; GPipe, which would run instead, keeps every micro-batch's activations in flight where the plan "
            f"counted {planned.schedule!r}'s fewer, and does not fit: "
            + ", ".join(f"{d} needs {format_bytes(after[d])} where it has {format_bytes(caps[d])}" for d in over)
            + "; pass microbatches= at least the number of engine stages (1F1B then runs), or give the devices more "
              "memory")
    grew = ", ".join(f"{d} {format_bytes(before[d])} -> {format_bytes(after[d])}"
                     for d in after if after[d] != before[d])
    warn_caller(f"{refused}; running 'gpipe' instead"
                + (f", which keeps every micro-batch's activations in flight: memory {grew} (placed.plan counts it; it "
                   "fits)" if grew else " (it keeps no more activations in flight than the plan counted)")
                + "; pass schedule= or another micro-batch count to choose", PlacementWarning)
    return ran, Plan.build(ran, plan.stages, solver=plan.solver, seconds=plan.seconds, lower_bound=plan.lower_bound,
                           status=plan.status, meta={**plan.meta, "schedule": "gpipe"})


_FREED: weakref.WeakSet = weakref.WeakSet()
"""Models whose other ranks' tensors a placement in this process moved to the meta device."""


def _materialize_lazily(model: nn.Module, state_dict: Any) -> None:
    """Give a model built on the meta device CPU memory that is never written before this rank
    loads its own slice of ``state_dict`` into it.

    ``to_empty`` allocates without initialising: the large blocks are fresh anonymous mappings,
    which take no physical memory until written (reading them, as tracing and timing do, maps the
    kernel's shared zero page). After the split each rank copies in only its own stages' tensors
    and drops the others to the meta device, so its resident memory is its own slice plus the
    working memory of planning. Tracing and timing see zeros (small tensors may hold garbage):
    fine for timing dense operators, wrong for a model whose control flow reads its weights.

    Raises:
        UsageError: a model on the meta device without ``state_dict``.
    """
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    if model in _FREED and state_dict is None:
        raise UsageError("this model was placed before in this process, and that placement freed the tensors of the "
                         "other ranks' stages (they are on the meta device now): place a copy made before the first "
                         "placement (copy.deepcopy(model)), or pass state_dict= to load them again")
    if state_dict is None:
        raise UsageError("the model is on the meta device: pass state_dict= (a checkpoint, mapping or torch.save file), "
                         "from which each rank loads its own stages' tensors")
    unsaved = [f"{name}.{b}" if name else b for name, m in model.named_modules()
               for b in m._non_persistent_buffers_set if m._buffers.get(b) is not None and m._buffers[b].is_meta]
    if unsaved:
        raise UsageError(f"buffer {unsaved[0]!r} of the model on the meta device is not saved in a state_dict "
                         "(persistent=False, as a rotary embedding's inv_freq), so no checkpoint can give it a value: "
                         "build the model on the CPU, or compute that buffer before placing")
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}  # a tensor several modules hold (tied weights)
    for m in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is not None:
                    slots.setdefault(id(t), []).append((m, kind, name))
    model.to_empty(device="cpu")  # gives each module's slot a tensor of its own
    for held in slots.values():
        first = getattr(held[0][0], held[0][1])[held[0][2]]
        for m, kind, name in held[1:]:
            getattr(m, kind)[name] = first


def _check_same_weights(model: nn.Module, device: torch.device) -> None:
    """Refuse a model whose parameters or saved buffers differ between the ranks. Each rank runs
    its own stages with its own copy of the model, so ranks that built it apart (not seeded alike)
    would run a pipeline of parts of different models, matching none of them. One all-reduce of a
    checksum per tensor: its bits summed as integers, the same on any device and thread count.

    Raises:
        UsageError: naming the first tensor that differs, on every rank.
    """
    import torch.distributed as dist

    named = [(n, t) for n, t in model.state_dict(keep_vars=True).items()
             if isinstance(t, torch.Tensor) and not t.is_meta]
    if not named:
        return
    sums = torch.stack([_bit_sum(t) for _, t in named])
    both = torch.cat([sums, -sums]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the largest and (negated) the smallest over the ranks
    high, low = both[:len(named)].tolist(), both[len(named):].tolist()
    differ = [n for (n, _), a, b in zip(named, high, low) if a != -b]
    if differ:
        raise UsageError(
            f"the ranks' models differ in {len(differ)} of {len(named)} tensors, the first {differ[0]!r}: each rank "
            "runs its stages with its own copy of the model, so the pipeline would mix parts of different models. "
            "Build the same model on every rank (torch.manual_seed(0) before building it, or load the same weights), "
            "or pass state_dict= (each rank then loads its own stages' tensors from it)")


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum (int64, on the CPU) of ``t``'s bits read as 32-bit integers (bytes where its size is
    no multiple of 4): equal tensors give equal sums, in any order of summation."""
    bits = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if bits.numel() % 4 == 0:
        bits = bits.view(torch.int32)
    return bits.sum(dtype=torch.int64).cpu()


def _quick(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options for re-evaluating a given plan: one quick timing run, no progress bar."""
    return {**options, "warmup": 0, "repeats": 1, "progress": False}


def _name(device: str | Device) -> str:
    return device.name if isinstance(device, Device) else str(device)


def _degrees(plan: Plan) -> tuple[int, int]:
    """The data- and tensor-parallel degrees ``(d, t)`` of ``plan``, the same on every stage: ``d``
    copies of its pipeline, each stage on ``t`` tensor-parallel ranks.

    Raises:
        UnsupportedError: degrees that differ between devices (``d`` copies of one pipeline need
            the same degrees everywhere).
        InvalidPlanError: stages of one device with different degrees.
    """
    degree: dict[str, tuple[int, int]] = {}
    for i, s in enumerate(plan.stages):
        mine = (s.data_parallel, s.tensor_parallel)
        if degree.setdefault(s.device, mine) != mine:
            raise InvalidPlanError(f"stage {i} runs on {s.device} with (data_parallel, tensor_parallel)={mine}, but an "
                                   f"earlier stage of {s.device} has {degree[s.device]}: give every stage of a device "
                                   "the same degrees")
    if len(set(degree.values())) > 1:
        most = max(degree.values())
        raise UnsupportedError(f"the plan's (data_parallel, tensor_parallel) degrees differ between devices ({degree}): the "
                               "torch.distributed runtime runs d copies of one pipeline with t ranks per stage, so every "
                               f"stage needs the same degrees; use data_parallel={most[0]}, tensor_parallel={most[1]} "
                               "on every stage (or 1, one pipeline)")
    return next(iter(degree.values()), (1, 1))


def _rank_devices(devices: Sequence[str | Device] | Cluster | None, plan: Plan | None,
                  world: int, degrees: tuple[int, int] = (1, 1)) -> list[str | Device]:
    """The device of each position of one pipeline (``world / (d * t)`` of them); the launch
    checks (before any communication)."""
    if plan is not None and degrees != (1, 1):
        found = list(dict.fromkeys(s.device for s in plan.stages))
        need = sum(s.data_parallel * s.tensor_parallel for s in {s.device: s for s in plan.stages}.values())
        if need != world:
            raise DistributedError(f"the plan runs {degrees[0]} data-parallel copies of a pipeline on {len(found)} "
                                   f"device(s) ({', '.join(found)}), {degrees[1]} tensor-parallel rank(s) per stage: it "
                                   f"needs {need} processes (the sum of data_parallel x tensor_parallel over its devices) "
                                   f"but {world} were launched: start torchrun with --nproc-per-node {need}")
        if devices is None:
            return list(found)
        listed = list(devices.devices) if isinstance(devices, Cluster) else list(devices)
        if sorted(_name(d) for d in listed) != sorted(found):
            raise DistributedError(f"devices {[_name(d) for d in listed]} are not the plan's devices {found}: with "
                                   "data- or tensor-parallel degrees, devices= names one pipeline's devices, those of "
                                   "the plan")
        return listed
    if plan is not None and devices is None:
        found = list(dict.fromkeys(s.device for s in plan.stages))
        if len(found) != world:
            raise DistributedError(f"the plan runs on {len(found)} device(s) ({', '.join(found)}) but {world} "
                                   f"process(es) were launched: start torchrun with --nproc-per-node {len(found)}")
        return list(found)
    if devices is None:
        kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else "cpu"
        return [f"{kind}:{i}" for i in range(world)]
    listed = list(devices.devices) if isinstance(devices, Cluster) else list(devices)
    if len(listed) != world:
        raise DistributedError(f"{len(listed)} device(s) given but {world} process(es) launched: one process runs "
                               f"one device; start torchrun with --nproc-per-node {len(listed)}")
    if plan is not None:
        unknown = sorted({s.device for s in plan.stages} - {_name(d) for d in listed})
        if unknown:
            raise DistributedError(f"the plan places stages on {unknown}, which are not among the devices "
                                   f"{[_name(d) for d in listed]}: pass the plan's devices")
    return listed


def _torch_device(rank_devices: Sequence[str | Device], local_rank: int, backend: str | None) -> tuple[torch.device, str]:
    """This rank's torch device and the process group's backend (checked before any communication).

    Raises:
        UsageError: ``backend`` is not a string, or is ``"nccl"`` where the ranks run on the CPU.
    """
    if backend is not None and not isinstance(backend, str):
        raise UsageError(f"backend must be a torch.distributed backend name ('gloo', 'nccl') or None, got {brief(backend)}")
    gpus = all(_name(d).startswith("cuda") for d in rank_devices)
    if gpus and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), backend or "nccl"
    if backend is not None and backend.lower() == "nccl":
        why = "CUDA is not available here" if gpus else f"the devices are {[_name(d) for d in rank_devices]}"
        raise UsageError(f"backend 'nccl' runs on GPUs only, but this rank runs on the CPU ({why}): use backend='gloo' "
                         "(the default on the CPU), or place on cuda devices")
    return torch.device("cpu"), backend or "gloo"


def _solve_once(model: nn.Module, devices: Any, example_inputs: Any, options: Mapping[str, Any], faults: Any,
                plan_timeout: float, key: str) -> Any:
    """Rank 0 solves and publishes the plan in the store; the others read it and check it. They
    look for the plan and for a fault every :data:`_POLL_S` seconds, so a rank 0 whose
    solve failed (and which published that) ends their wait at once, not after ``plan_timeout``."""
    from torchplace import api
    from torchplace.planfile import plan_from_json

    store = faults.store
    if faults.rank == 0:
        placement = api.prepare(model, devices, example_inputs, **options)
        store.set(key, json.dumps(placement.plan.to_json()))
        return placement

    def published() -> bool:  # store.check, not store.wait with a short timeout: that logs a warning at every timeout
        try:
            return store.check([key])
        except Exception as error:
            raise DistributedError(f"the rendezvous store failed while rank {faults.rank} waited for rank 0's plan "
                                   f"({type(error).__name__}: {error}): rank 0 has stopped") from error

    _wait_for(published, faults, plan_timeout,
              lambda: f"rank 0 published no plan within {plan_timeout:g} s; raise plan_timeout for long solves")
    plan = plan_from_json(json.loads(store.get(key).decode()), "the plan of rank 0")
    return api.prepare(model, devices, example_inputs, plan=plan, **_quick(options))


def _all_placed(faults: Any, key: str, timeout: float) -> None:
    """Wait until every rank has checked rank 0's plan on its own model. A rank that refused it (its
    model traces to another graph, another mode) published why, and the others raise that at once,
    looking every :data:`_POLL_S` seconds, instead of waiting in the creation of the process groups
    for ``timeout`` and failing with the store's timeout, which named no cause.

    Raises:
        DistributedError: naming the rank that failed, or how many did not finish within ``timeout``.
    """
    store = faults.store
    store.add(key, 1)
    _wait_for(lambda: store.add(key, 0) >= faults.world, faults, timeout,
              lambda: f"{faults.world - store.add(key, 0)} rank(s) did not check rank 0's plan within {timeout:g} s "
                      "(the process group's timeout); raise timeout= for models that take longer to trace")


def _wait_for(ready: Callable[[], bool], faults: Any, timeout: float, late: Callable[[], str]) -> None:
    """Look every :data:`_POLL_S` seconds whether ``ready()``, and whether a rank published a fault
    (then raise it at once) until ``timeout`` seconds have passed.

    Raises:
        DistributedError: the fault a rank published, or ``late()`` after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while not ready():
        if faults.fault():
            raise DistributedError(f"{faults.fault()}; rank {faults.rank} stopped")
        if time.monotonic() >= deadline:
            raise DistributedError(late())
        time.sleep(_POLL_S)


def _written_buffers(model: nn.Module | None, names: Sequence[str], modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The buffers among ``names`` (the state the traced graph writes) that ``modules`` (this
    rank's engine stages) hold, in the order of ``names``: the same on every data-parallel copy."""
    if model is None:
        return []
    mine = {id(b): b for m in modules for b in m.buffers()}
    held = dict(model.named_buffers(remove_duplicate=False))
    return list({id(held[n]): held[n] for n in names if n in held and id(held[n]) in mine}.values())


class DistributedPlaced:
    """One rank's part of a placed model, run by ``torch.distributed.pipelining``.

    Attributes:
        plan, problem: the plan and the problem it was evaluated on.
        rank, world: this process's rank and the number of processes.
        replica: which data-parallel copy of the pipeline this rank runs (0 with ``d = 1``).
        device: this rank's torch device.
        pipeline: the :class:`~torchplace.runtime.distributed.DistributedPipeline`.
        is_last: whether this rank runs the last stage (it gets the outputs and the losses).
    """

    _dtype_guards: Sequence[str] = ()  # an exported graph's dtype checks: its calls are refused under autocast
    _joined: Any = None  # why a run's micro-batches cannot be joined into the model's outputs, if they cannot

    def __init__(self, placement: Any, rank_devices: Sequence[str], rank: int, world: int, device: torch.device,
                 faults: Any, schedule: str | None, state_dict: Mapping[str, torch.Tensor] | str | Path | None,
                 degrees: tuple[int, int] = (1, 1), timeout: float = 60.0) -> None:
        from torchplace.placed_module import _forward_stages
        from torchplace.runtime import GraphIO, split_stages
        from torchplace.runtime.dist_numbers import example_of
        from torchplace.runtime.dist_replicas import grid_groups
        from torchplace.runtime.distributed import DistributedPipeline
        from torchplace.runtime.params import _slots

        traced, problem, plan = placement.traced, placement.problem, placement.plan
        if any(s.recompute for s in plan.stages):
            raise UnsupportedError("the plan recomputes activations on "
                                   f"{sorted({s.device for s in plan.stages if s.recompute})}, which the "
                                   "torch.distributed bridge does not do yet: place with recompute=False")
        joined = placement.joined
        if placement.microbatches > 1 and isinstance(joined, tuple) and not all(joined):
            raise UnsupportedError("the model returns an output that reads no input's batch (a constant or a "
                                   "parameter), which the torch.distributed engine would join over micro-batches "
                                   "into several copies: return it from outside the model, or use microbatches=1")
        run = _forward_stages(problem, plan)
        stage_of = {f: i for i, s in enumerate(run) for v in s.nodes for f in problem.graph.record(v).fx_nodes}
        stages = split_stages(traced.gm, stage_of, len(run), traced.effects)
        index = {d: r for r, d in enumerate(rank_devices)}
        default = problem.pipeline.schedule if problem.pipeline is not None else "1f1b"
        self.plan, self.problem, self.rank, self.world, self.device = plan, problem, rank, world, device
        self.faults = faults
        copies, tensor = degrees
        # rank (k * d + j) * t + i: position k, copy j (torchplace.runtime.dist_replicas). Groups of
        # this placement's own, even for one pipeline: a failed run leaves its pending sends and
        # receives posted on its group, where they would pair with a later placement's messages
        group, replicas, tensor_group = grid_groups(len(rank_devices), copies, tensor, rank,
                                                    datetime.timedelta(seconds=timeout))
        self.replica = replicas.index if replicas is not None else 0
        self.pipeline = DistributedPipeline(
            stages, [index[s.device] for s in run], GraphIO(traced.gm, traced.output_spec), [n.name for n in traced.gm.graph.nodes],
            rank=rank // (copies * tensor), world=len(rank_devices), device=device,
            microbatches=placement.microbatches // copies, schedule=schedule or default, faults=faults, group=group,
            replicas=replicas, tensor_group=tensor_group,
            examples={n.name: example_of(n) for n in traced.gm.graph.nodes}, nones=placement.sizes.nones)
        if problem.mode == "training":  # refused now, not at the first step (no user schedule: GPipe will do)
            refused = self.pipeline.check_schedule(fallback="gpipe" if schedule is None else None)
            if refused is not None:
                self.problem, self.plan = _priced_for_fallback(problem, plan, refused)
        self.plan.meta[CACHE_KEY] = placement.cache  # so a restart from the saved plan skips profiling
        self.pipeline.check_call = self._check_call
        self.is_last = self.pipeline.is_last
        self.pipeline.written = _written_buffers(traced.model, traced.effects.written_state, self.pipeline.modules)
        self._sizes, self._microbatches = placement.sizes, placement.microbatches
        self._joined = placement.joined
        self._model = traced.model
        self._dtype_guards = dtype_guards(traced.gm) if traced.method == "export" else ()
        for _, owner, kind, slot, t in _slots(traced.model):  # the model's own modules free them too
            if id(t) in self.pipeline.freed:
                getattr(owner, kind)[slot] = self.pipeline.freed[id(t)]
        if self.pipeline.freed:
            _FREED.add(traced.model)
        if state_dict is not None:
            self._load(traced.model, state_dict)
        self._record_model(traced.model)

    def _record_model(self, model: nn.Module | None) -> None:
        """Record what :meth:`_check_model` compares: the model's structure and modes as placed."""
        self._model = model
        self._structure = Structure.of(model.named_modules(remove_duplicate=False)) if model is not None else None
        self._modes = tuple(m.training for m in model.modules()) if model is not None else ()

    def _check_model(self) -> None:
        """Refuse a call after the model changed since placing: a module, parameter or buffer
        replaced, a hook added or removed, a plain attribute changed
        (:class:`~torchplace.runtime.structure.Structure`), or a module's training mode switched
        (the stages run the graph traced in the modes of placing). Every rank holds the whole
        model (other ranks' tensors on the meta device) and runs the same script, so every rank
        refuses alike, before any communication.

        Raises:
            UnsupportedError: naming what changed and what to do.
        """
        if self._structure is None or self._model is None:
            return
        self._structure.check()
        modes = tuple(m.training for m in self._model.modules())
        if modes == self._modes:
            return
        if self.problem.mode != "training":
            raise UnsupportedError(
                "a module of the placed model is in training mode (model.train() was called after placing?): this "
                "placement runs the graph traced in eval mode; call model.eval(), or place the model for training "
                "(tpd.place(model.train(), ..., mode='training'))")
        if not any(modes):
            raise UnsupportedError(
                "the model is in eval mode (model.eval() was called after placing?), but this placement runs the "
                "graph traced in training mode (batch statistics, dropout), and the torch.distributed runtime has "
                "no eval-mode graph: call model.train() again, or place the model in eval mode for eval-mode "
                "outputs (tpd.place(model.eval(), ..., mode='inference'))")
        odd = [repr(name) if name else "the model" for (name, module), flag in
               zip(self._model.named_modules(), self._modes) if module.training != flag]
        raise UnsupportedError(
            f"modules {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} are not in the training modes the model was "
            "placed with (its stages run the graph traced in those modes): set them back (module.train() / "
            "module.eval()), or place the model again in the modes you want")

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for this batch on the last rank; ``None`` on the others (see
        :meth:`DistributedPipeline.run <torchplace.runtime.distributed.DistributedPipeline.run>`).

        Every rank checks the call (:meth:`_check_call`) before any runs it: where one rank's
        checks refuse it, that rank raises their error and every other rank a
        :class:`DistributedError` naming it, and the placement stays usable.

        Raises:
            UnsupportedError, UsageError: this rank's checks refuse the call.
            DistributedError: another rank refused it, or a rank failed while running it.
        """
        return self.pipeline.run(*args, **kwargs)

    __call__ = run

    def step(self, *args: Any, target: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor],
             **kwargs: Any) -> list[torch.Tensor]:
        """One training step of the batch; the losses of its micro-batches on the last rank. Checked
        on every rank before any runs it, as :meth:`run` is.

        Raises:
            UnsupportedError, UsageError: this rank's checks refuse the call (:meth:`_check_call`).
            DistributedError: another rank refused it, or a rank failed while running it.
        """
        return self.pipeline.step(*args, target=target, loss_fn=loss_fn, **kwargs)

    def _check_call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], training: bool) -> None:
        """The checks of a call (``training``: a ``step``) that need the placement, before any rank runs it.

        Raises:
            UnsupportedError: a step of a model placed for inference (its eval-mode graph would
                train); the model changed since placing (:meth:`_check_model`); a parameter several
                engine stages read (a tied weight) has a gradient hook, which would run on each
                stage's part of its gradient; a call under a function transform or autocast the
                graph cannot follow.
            UsageError, MicrobatchError: inputs the traced graph does not hold for; a ``run`` of a
                training placement split into micro-batches whose outputs cannot be joined into the
                model's (a reduction over the batch), as :func:`torchplace.place`'s call refuses it.
        """
        from torchplace.placed_module import _check_gradient_hooks

        if training:
            if self.problem.mode != "training":
                raise UnsupportedError("this model was placed for inference, whose graph is the eval-mode one: place "
                                       "it with mode='training' to train it")
            named = self._model.named_parameters() if self._model is not None else ()
            _check_gradient_hooks(self.pipeline.read_by_several, named,
                                  fix="remove the hook, and apply what it did to p.grad after step() (the gradient "
                                      "of all uses, summed over the ranks)")
        check_eager_call()
        self._check_model()
        check_autocast(self._dtype_guards)
        self._sizes.check(args, kwargs, self._microbatches)
        self._sizes.check_fixed(args, kwargs)  # as the graph's guards would, before any communication
        if not training and isinstance(self._joined, Exception) and self._microbatches > 1:
            raise self._joined  # the engine would join them with torch.cat: m copies of a batch mean, say

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (the model's own objects): build this rank's optimizer on them."""
        return self.pipeline.parameters()

    def close(self, destroy: bool = False) -> None:
        """Stop the heartbeat thread; after a failed call, also destroy this placement's own process
        groups, which frees a peer still blocked on this rank at once
        (:meth:`~torchplace.runtime.distributed.DistributedPipeline.release`); with ``destroy`` (at
        the end of the script), also destroy the default process group after a barrier. Keep that
        to place another model in the same launch: initialising it again under torchrun is not
        supported."""
        import torch.distributed as dist

        self.faults.close()
        if self.pipeline.broken is not None:  # a failed call: free the peers it left blocked on this rank
            self.pipeline.release()
        if destroy and dist.is_initialized():
            dist.barrier()  # no rank leaves while a peer still sends to it
            dist.destroy_process_group()

    def _load(self, model: nn.Module | None, state_dict: Mapping[str, torch.Tensor] | str | Path) -> None:
        """Copy this rank's tensors from a checkpoint of the model (keys of ``model.state_dict()``)."""
        if model is None:
            raise UsageError("state_dict needs the model the plan was traced from")
        source = torch.load(state_dict, mmap=True, weights_only=True) if isinstance(state_dict, (str, Path)) else state_dict
        mine = {id(t) for m in self.pipeline.modules for t in [*m.parameters(), *m.buffers()]}
        saved = set(model.state_dict(keep_vars=True))  # not the buffers registered with persistent=False
        names: dict[int, list[str]] = {}  # a tied tensor's names: any one of them will do (save_pretrained keeps one)
        tensors: dict[int, torch.Tensor] = {}
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if id(t) in mine and n in saved:
                names.setdefault(id(t), []).append(n)
                tensors[id(t)] = t
        missing = [held[0] for held in names.values() if not any(n in source for n in held)]
        if missing:
            raise UsageError(f"state_dict has no {missing[0]!r} (and {len(missing) - 1} more of this rank's tensors): "
                             "pass a checkpoint of this model (model.state_dict())")
        named = [(next(n for n in held if n in source), tensors[key]) for key, held in names.items()]
        for n, t in named:
            if tuple(source[n].shape) != tuple(t.shape):
                raise UsageError(f"state_dict[{n!r}] has shape {tuple(source[n].shape)}, but the model's {n!r} has "
                                 f"{tuple(t.shape)}: pass a checkpoint of this model (model.state_dict())")
        with torch.no_grad():
            for n, t in named:
                t.copy_(source[n])
