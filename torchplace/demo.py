"""The end-to-end demo: place two real models that nobody here wrote, run them, check, and time them.

1. GPT-2 from transformers, built from a config with random weights (offline), split at
   ``GPT2Block`` granularity;
2. a residual CNN (the ResNet basic block: conv-bn-relu-conv-bn + skip), split per operator.

Each is placed on two logical CPU devices (and on ``cuda:0`` + ``cpu`` when a GPU is present); the
demo prints the plan, checks the outputs against the original model, and times the pipelined
model beside the unsplit one in the same run.
"""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["main"]


@dataclass(frozen=True)
class Case:
    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    options: dict[str, Any]


def _gpt2(quick: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    layers, width = (4, 128) if quick else (8, 256)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=2048, n_positions=128, use_cache=False,
                        bos_token_id=2047, eos_token_id=2047)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (16, 64))
    return Case(f"GPT-2 ({layers} layers, d={width}, random weights)", model, (ids,),
                {"granularity": "module", "leaf_modules": [GPT2Block]})


def _resnet(quick: bool) -> Case:
    from torchplace.models import ResidualCNN

    torch.manual_seed(0)
    channels = (16, 32, 32) if quick else (32, 64, 64, 128)
    model = ResidualCNN(channels).eval()
    return Case(f"residual CNN (channels {channels})", model, (torch.randn(16, 3, 32, 32),), {})


def _same(a: Any, b: Any) -> tuple[bool, float]:
    """(bitwise equal, max abs difference) over the tensor leaves of two outputs."""
    xs = [t.cpu() for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    ys = [t.cpu() for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    if len(xs) != len(ys):
        return False, float("inf")
    diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(xs, ys)), default=0.0)
    return all(torch.equal(x, y) for x, y in zip(xs, ys)), diff


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def samples_per_second(fn: Callable[[], Any], batch: int, seconds: float, warmup: int = 1) -> float:
    """Samples per second of ``fn`` over at least ``seconds`` and three calls, after ``warmup``
    calls; pending GPU work is waited for at both ends (also used by benchmarks/gpu.py)."""
    for _ in range(warmup):
        fn()
    runs, elapsed = _timed_block(fn, seconds, 3)
    return batch * runs / elapsed


def interleaved_samples_per_second(fns: Mapping[str, Callable[[], Any]], batch: int, seconds: float,
                                   warmup: int = 1, rounds: int = 4) -> dict[str, float]:
    """:func:`samples_per_second` of each of ``fns``, measured side by side: ``rounds`` rounds,
    each running every function for ``seconds / rounds`` (at least one call), the order rotated
    from round to round, so that a machine whose speed changes over the run (a shared host) slows
    them alike rather than whichever ran last."""
    names = list(fns)
    if not names:
        return {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
    runs, elapsed = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            n, t = _timed_block(fns[name], seconds / rounds, 1)
            runs[name] += n
            elapsed[name] += t
    return {name: batch * runs[name] / elapsed[name] for name in names}


def _timed_block(fn: Callable[[], Any], seconds: float, min_calls: int) -> tuple[int, float]:
    """(calls, seconds) of calling ``fn`` for at least ``seconds`` and ``min_calls`` calls, pending
    GPU work waited for at both ends."""
    _sync()
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or runs < min_calls:
        fn()
        runs += 1
    _sync()
    return runs, time.perf_counter() - t0


def _device_sets() -> list[list[str]]:
    sets = [["cpu:0", "cpu:1"]]
    if torch.cuda.is_available():
        sets.append(["cuda:0", "cpu"])
    return sets


def _check_outputs(placed: Any, case: Case, on_gpu: bool) -> bool:
    """Print how ``placed``'s outputs compare with the model's; True when they match (bitwise on
    the CPU, to 1e-3 on a GPU) the model run on the same micro-batches."""
    from torchplace.runtime.microbatch import gather, scatter

    m = placed.microbatches
    with torch.no_grad():
        out = placed(*case.inputs)
        per_chunk = gather([case.model(*args, **kw) for args, kw in scatter(case.inputs, {}, m)])
        whole = case.model(*case.inputs)
        bitwise, diff_chunks = _same(out, per_chunk)
        _, diff = _same(out, whole)
    if on_gpu:  # CUDA kernels round differently from the CPU's: say how far, not whether bitwise
        print(f"  outputs: max |difference| to the model on the CPU: {diff:.3g} (same {m} micro-batches: "
              f"{diff_chunks:.3g})")
        return diff_chunks <= 1e-3
    print(f"  outputs: bitwise equal to the model on the same {m} micro-batch(es): {bitwise}; "
          f"max |difference| to the model on the whole batch: {diff:.3g}")
    return bitwise


def _run_case(case: Case, devices: Sequence[str], microbatches: int, seconds: float) -> bool:
    import torchplace

    print(f"\n=== {case.name} on {devices} ===")
    # placing moves the model's own parameters onto the devices: place a copy, keep the original
    placed = torchplace.place(copy.deepcopy(case.model), devices, case.inputs, microbatches=microbatches,
                              **case.options)
    print(placed.plan)
    print("device_map:", placed.device_map())
    on_gpu = any(d.startswith("cuda") for d in devices)
    runs = {"placed": placed}
    if len({s.device for s in placed.plan.stages}) == 1:  # torchplace chose one device: run the split too
        runs["split (allow_single_device=False)"] = torchplace.place(
            copy.deepcopy(case.model), devices, case.inputs, microbatches=microbatches, progress=False,
            allow_single_device=False, **case.options)
    ok = True
    for name, run in runs.items():
        print(f"{name}: {' -> '.join(s.device for s in run.plan.stages)}, m={run.microbatches}")
        ok &= _check_outputs(run, case, on_gpu)
    # the traced graph unsplit on one device separates what tracing changes from what placing gains
    first = torch.device("cpu" if devices[0].startswith("cpu") else devices[0])
    single = torchplace.place(copy.deepcopy(case.model), devices[:1], case.inputs, microbatches=1,
                              progress=False, **case.options)
    original = copy.deepcopy(case.model).to(first)
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(first), case.inputs)
    with torch.no_grad():
        batch = pytree.tree_leaves(case.inputs)[0].shape[0]
        calls = {"original": lambda: original(*inputs), "traced": lambda: single(*case.inputs),
                 **{name: (lambda r=run: r(*case.inputs)) for name, run in runs.items()}}
        measured = interleaved_samples_per_second(calls, batch, seconds)
    base, one = measured.pop("original"), measured.pop("traced")
    rows = " | ".join(f"{name} {v:.1f} ({v / base:.2f}x)" for name, v in measured.items())
    print(f"throughput (samples/s, side by side): original model on {devices[0]} {base:.1f} | traced, one device "
          f"{one:.1f} | {rows}")
    return ok


def main(quick: bool = False) -> int:
    """Run the demo; returns 0 when every placed model matched the original."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"cuda: {torch.cuda.is_available()}")
    ok = True
    for build in (_gpt2, _resnet):
        case = build(quick)
        for devices in _device_sets():
            ok &= _run_case(case, devices, microbatches=4, seconds=1.0 if quick else 3.0)
    print("\nall outputs matched" if ok else "\nSOME OUTPUTS DIFFERED")
    return 0 if ok else 1
