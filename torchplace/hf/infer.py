"""``infer_device_map``: a ``device_map`` for accelerate / ``from_pretrained`` solved, not filled.

accelerate's ``infer_auto_device_map`` fills devices with parameter bytes in registration order.
Here the model's blocks (:mod:`torchplace.hf.blocks`) with their compute, transfer and memory
costs go to a torchplace :class:`~torchplace.problem.Problem` and a solver picks the map:

- objective ``"latency"``: a dispatched model runs its blocks one after the other, so the time of
  one forward pass (the makespan of :func:`torchplace.costmodel.simulate`) is the time per batch
  (``phase="prefill"``), or, with ``phase="decode"``, the time per generated token: one token of
  every sequence of the batch, each attention block also reading its whole KV cache
  (:func:`_kv_reads`), which is what makes decoding memory-bound;
- memory per device: weights + working memory of the batch + the KV cache of ``batch_size``
  sequences of ``sequence_length`` tokens on the device holding each attention layer (added to the
  blocks' working memory, so :func:`torchplace.costmodel.memory` counts it);
- tied weights colocated; ``no_split_module_classes`` never split (they are whole blocks);
- ``"cpu"`` / ``"disk"`` as offload devices with the time the offload costs
  (:mod:`torchplace.hf.budget`).

Every plan is validated by the solver; the map is checked by accelerate's own
``check_device_map`` in the tests.
"""
from __future__ import annotations

import difflib
import inspect
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchplace import solvers
from torchplace.checks import brief, non_negative_int, positive_float, positive_int
from torchplace.devices import Cluster
from torchplace.errors import InfeasibleError, InvalidPlanError, UsageError, warn_caller
from torchplace.graph import OpGraph
from torchplace.hf.blocks import HF_DEVICE_SPECS, block_graph
from torchplace.hf.budget import (
    DISK_BANDWIDTH,
    OFFLOAD_KINDS,
    accelerate_name,
    hf_cluster,
    offload_times,
)
from torchplace.hf.budget import main_device as budget_main
from torchplace.hf.kvcache import kv_cache_bytes
from torchplace.hf.maps import (
    budgets,
    buffers_only,
    computing_on_the_cpu,
    dispatched_memory,
    host_memory,
    main_device,
    offload_charge,
    solver_cluster,
    to_device_map,
    with_reserve,
    within_budgets,
)
from torchplace.plan import Plan, stages_from_order
from torchplace.problem import Problem
from torchplace.profiling.estimate import DeviceSpec
from torchplace.solvers.bounds import combinatorial_lower_bound
from torchplace.profiling.links import measure_host_links

__all__ = ["PHASES", "DeviceMapPlan", "build_problem", "infer_device_map", "plan_device_map", "solve_device_map"]

PHASES = ("prefill", "decode")
"""What a map's time is: one forward pass of the batch, or one generated token of every sequence."""

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class DeviceMapPlan:
    """A solved device map with what it costs.

    Attributes:
        device_map: accelerate's form: module path -> GPU id, ``"cpu"`` or ``"disk"``.
        plan: the torchplace :class:`Plan` over the model's blocks (predicted seconds per forward
            pass, proven lower bound, solver).
        problem: the problem it was solved for (graph of blocks and cluster).
        memory: bytes each device needs (weights + KV cache + the activation peak on devices that
            compute), by accelerate name; with ``"disk"`` alone also ``"cpu"``, the RAM of the CPU
            that computes (:func:`~torchplace.hf.maps.host_memory`).
        kv_cache: KV cache bytes each device holds, by accelerate name (``"cpu"`` with ``"disk"`` alone).
        requested: the problem of the caller's ``max_memory``, on which to price other maps
            (accelerate's) with :func:`~torchplace.hf.maps.evaluate_device_map`: ``problem`` itself,
            unless no map fit the GPUs and the CPU computes every block (``problem`` then names no
            GPU; ``None`` given: ``problem``).
    """

    device_map: dict[str, int | str]
    plan: Plan
    problem: Problem
    memory: dict[int | str, int]
    kv_cache: dict[int | str, int] = field(default_factory=dict)
    requested: Problem | None = None

    def __post_init__(self) -> None:
        if self.requested is None:
            object.__setattr__(self, "requested", self.problem)

    def __str__(self) -> str:
        caps = {accelerate_name(n): b for n, b in self.problem.graph.meta["hf"]["budgets"].items()}
        what = "per generated token" if self.problem.graph.meta["hf"].get("phase") == "decode" else "per forward pass"
        lines = [f"predicted {self.plan.objective * 1e3:.3f} ms {what} "
                 f"(lower bound {self.plan.lower_bound * 1e3:.3f} ms, solver {self.plan.solver})",
                 f"{'device':>8} {'memory':>12} {'KV cache':>12} {'budget':>12}"]
        for dev, used in self.memory.items():
            cap = caps.get(dev)
            lines.append(f"{dev!s:>8} {_gib(used):>12} {_gib(self.kv_cache.get(dev, 0)):>12} "
                         f"{_gib(cap) if cap is not None else 'unlimited':>12}")
        left_out = self.problem.graph.meta["hf"].get("left_out")
        if left_out:
            lines.append(f"no map fits GPU(s) {', '.join(map(str, left_out))}: the CPU computes every block")
        return "\n".join(lines)


def _gib(n: int | float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``"1.50 GiB"``)."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _dtype(dtype: Any) -> torch.dtype | None:
    """The floating dtype ``dtype`` names (``from_pretrained`` loads weights in a floating dtype)."""
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    raise UsageError(f"dtype must be a floating torch.dtype (the weights' dtype, as from_pretrained(dtype=) takes it) "
                     f"or one of {sorted(_DTYPES)}, got {brief(dtype)}; for a quantized model give its compute dtype")


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _example(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None, batch_size: int,
             sequence_length: int) -> dict[str, Any]:
    """Keyword inputs of one forward pass: the caller's, else random ``input_ids`` of the stated
    batch and length with an all-ones ``attention_mask`` (a speech encoder's
    :func:`_audio_features` instead), plus ``decoder_input_ids`` of that length for
    encoder-decoder models; with ``use_cache`` off where the model takes it (the KV cache is sized
    separately) and, for a model that generates, ``logits_to_keep=1`` as ``generate()`` passes it
    (logits of the last token only)."""
    kwargs = dict(example_kwargs or {})
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        raise UsageError(f"example_kwargs names {unknown[0]!r}, which {type(model).__name__}.forward does not take; "
                         f"it takes {list(params)}")
    if example_inputs is not None and example_inputs != ():
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        names = [n for n in params if n not in kwargs]
        kwargs.update(dict(zip(names, args)))
    if not kwargs:
        config = getattr(model, "config", None)
        encdec = bool(getattr(config, "is_encoder_decoder", False))
        features = _audio_features(model, batch_size)
        if "input_ids" not in params and features is None:
            raise UsageError(f"{type(model).__name__}.forward takes no input_ids, so no example inputs can be made "
                             "for it: pass example_inputs= or example_kwargs= (one forward call, e.g. "
                             "{'pixel_values': ...} for a vision model)")
        vocab = int(getattr(config, "vocab_size", 0) or 2)
        ids = _random(torch.randint, 0, vocab, (batch_size, sequence_length), device=_device_of(model))
        if features is not None:
            kwargs["input_features"] = features
        else:
            kwargs["input_ids"] = ids
            if "attention_mask" in params:
                kwargs["attention_mask"] = torch.ones_like(ids)
        if encdec and "decoder_input_ids" in params:
            kwargs["decoder_input_ids"] = ids
    if "use_cache" in params:
        kwargs.setdefault("use_cache", False)
    can = getattr(model, "can_generate", None)
    if "logits_to_keep" in params and callable(can) and can():
        kwargs.setdefault("logits_to_keep", 1)  # as generate() runs its prefill: the last token's logits
    return kwargs


def _audio_features(model: nn.Module, batch_size: int) -> torch.Tensor | None:
    """Random ``input_features`` of a Whisper-style speech encoder (``main_input_name``
    ``"input_features"``, a config with ``num_mel_bins`` and ``max_source_positions``):
    ``batch x num_mel_bins x frames``, the frames the encoder's convolutions take down to its
    ``max_source_positions`` positions (Whisper: 3000 frames of 10 ms, 1500 positions); None for
    any other model."""
    config = getattr(model, "config", None)
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if getattr(model, "main_input_name", None) != "input_features" or not isinstance(mels, int) \
            or not isinstance(positions, int):
        return None
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else model
    stride = math.prod(m.stride[0] for m in encoder.children() if isinstance(m, nn.Conv1d))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    features = _random(torch.randn, batch_size, mels, positions * stride, device=_device_of(model))
    return features.to(dtype=dtype)


def _random(make: Any, *args: Any, device: torch.device) -> torch.Tensor:
    """``make(*args)`` (``torch.randint`` / ``torch.randn``) on ``device``, seeded: drawn on the CPU
    and moved, except on the meta device, where it is made there (a model planned from shapes alone
    allocates no example input: a large ``batch_size`` took that much RAM, or failed to).

    Raises:
        UsageError: the tensor cannot be allocated (or its size overflows torch's int64): lower
            ``batch_size`` or ``sequence_length``, or pass example inputs.
    """
    try:
        if device.type == "meta":
            return make(*args, device=device)
        return make(*args, generator=torch.Generator().manual_seed(0)).to(device)
    except (RuntimeError, MemoryError, OverflowError, TypeError) as e:  # the allocator's error; an int64 overflow
        shape = next((a for a in args if isinstance(a, tuple)), args[-3:])
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"example inputs of shape {tuple(shape)} (batch_size first) cannot be made on {device} "
                         f"({type(e).__name__}: {first}): lower batch_size or sequence_length, or pass "
                         "example_inputs / example_kwargs") from None


def _no_split(model: nn.Module, classes: Iterable[type | str] | None) -> list[str]:
    """Class names of the modules never split: ``classes`` (each a module class or its name, and
    each a class of some module of ``model``), else the model's ``_no_split_modules``."""
    if classes is None:
        return list(getattr(model, "_no_split_modules", None) or [])
    if isinstance(classes, (str, type)):
        classes = [classes]
    items = list(classes) if isinstance(classes, Iterable) else [classes]
    bad = [c for c in items if not isinstance(c, (str, type))]
    if bad:
        raise UsageError(f"no_split_module_classes takes module classes or their names, got {brief(bad[0])}")
    names = [c if isinstance(c, str) else c.__name__ for c in items]
    present = sorted({type(m).__name__ for m in model.modules()})
    for name in names:
        if name not in present:
            near = difflib.get_close_matches(name, present, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise UsageError(f"no_split_module_classes names {name!r}, but {type(model).__name__} has no module of "
                             f"that class: {hint}its classes are {present}")
    return names


def _check_positions(model: nn.Module, sequence_length: int) -> None:
    """Raise if ``sequence_length`` is beyond the positions the model's config gives
    (``n_positions`` / ``max_position_embeddings``, a speech decoder's ``max_target_positions``):
    the model cannot run, or generate, that far."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("n_positions", "max_position_embeddings", "max_target_positions"):
        limit = getattr(text, attr, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if sequence_length > limit:
                raise UsageError(f"sequence_length {sequence_length} is beyond the {limit} positions of "
                                 f"{type(model).__name__} (config.{attr}): lower sequence_length to at most {limit}")
            return


def _specs(specs: Mapping[str, DeviceSpec] | None) -> dict[str, DeviceSpec]:
    """``specs`` (default, when None or empty: :data:`HF_DEVICE_SPECS`) as a dict, each value checked."""
    if specs is not None and not (isinstance(specs, Mapping) and all(isinstance(v, DeviceSpec) for v in specs.values())):
        raise UsageError("specs must map device kinds to DeviceSpec(peak_flops=, mem_bandwidth=, overhead=) "
                         f"(torchplace.profiling.estimate), got {brief(specs)}")
    return dict(specs or HF_DEVICE_SPECS)


def _load_cluster(cluster: Cluster | str | Path | None) -> Cluster | None:
    if cluster is None or isinstance(cluster, Cluster):
        return cluster
    from torchplace.clusterfile import load_cluster

    return load_cluster(cluster)


def build_problem(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    no_split_module_classes: Iterable[type | str] | None = None,
    batch_size: int = 1,
    sequence_length: int = 128,
    dtype: torch.dtype | str | None = None,
    cluster: Cluster | str | Path | None = None,
    kv_cache: bool = True,
    specs: Mapping[str, DeviceSpec] | None = None,
    disk_bandwidth: float = DISK_BANDWIDTH,
    repeats: int = 3,
    phase: str = "prefill",
) -> Problem:
    """The latency :class:`Problem` of ``model``'s blocks on the ``max_memory`` devices (see
    :func:`plan_device_map` for the arguments)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be an nn.Module, got {brief(model)}")
    if phase not in PHASES:
        raise UsageError(f"phase must be one of {list(PHASES)} (time of the forward pass of the batch, or of one "
                         f"generated token), got {brief(phase)}")
    if phase == "decode" and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UsageError("phase='decode' times a decoder-only model's generated token; for an encoder-decoder "
                         "model (whose encoder does not run per token) use phase='prefill'")
    if not isinstance(kv_cache, bool):
        raise UsageError(f"kv_cache must be True or False (False: leave no room for a KV cache), got {brief(kv_cache)}")
    batch_size = positive_int(batch_size, "batch_size")
    sequence_length = positive_int(sequence_length, "sequence_length")
    disk_bandwidth = positive_float(disk_bandwidth, "disk_bandwidth", unit="of bytes/s")
    repeats = non_negative_int(repeats, "repeats")
    _check_positions(model, sequence_length)
    torch_dtype = _dtype(dtype)
    hw = hf_cluster(max_memory, _load_cluster(cluster))
    kinds = sorted({d.kind for d in hw.devices if not d.kind.endswith("-offload")} | {"cpu"})
    specs = _specs(specs)
    no_split = _no_split(model, no_split_module_classes)
    modes = {m: m.training for m in model.modules()}
    model.eval()  # probed as it will run: inference (dropout off)
    try:
        kwargs = _example(model, example_inputs, example_kwargs, batch_size,
                          1 if phase == "decode" else sequence_length)
        graph = block_graph(model, kwargs, kinds=kinds, no_split=no_split, dtype=torch_dtype, repeats=repeats,
                            specs=specs)
        prefill_peak = 0
        if phase == "decode":  # generate() runs the prompt first: its activations need room too
            prompt = _example(model, None, None, batch_size, sequence_length)
            prefill = block_graph(model, prompt, kinds=kinds, no_split=no_split, dtype=torch_dtype, repeats=0,
                                  specs=specs)
            prefill_peak = max((r.temp_bytes for _, r in prefill.records()), default=0)
    finally:
        for m, was in modes.items():
            m.training = was
    graph = _follow_inputs(model, graph)
    graph.meta["hf"]["buffers_only"] = buffers_only(model, graph)
    graph = _memory_terms(model, graph, batch_size, sequence_length, torch_dtype, kv_cache, prefill_peak, kwargs)
    graph.meta["hf"]["phase"] = phase
    if phase == "decode":
        graph = _kv_reads(graph, specs)
    graph.meta["hf"]["disk_bandwidth"] = disk_bandwidth
    hw = solver_cluster(hw, graph)
    graph = offload_times(graph, hw, disk_bandwidth, None if cluster is not None else _host_bandwidth(model, hw))
    return Problem(graph, hw, objective="latency", contiguous=False)


def _host_bandwidth(model: nn.Module, hw: Cluster) -> float | None:
    """Bytes/s of accelerate's offload (each forward copies a CPU-mapped block's weights from
    pageable memory to the main GPU), measured when that GPU is attached and the model has real
    weights; else None (the cluster's default link)."""
    name = budget_main(hw)
    main = hw.devices[0] if name is None else hw.device(name)
    offload = any(d.kind == "cpu-offload" for d in hw.devices)
    if not offload or _device_of(model).type == "meta" or not main.torch_device.startswith("cuda") \
            or not torch.cuda.is_available() or torch.device(main.torch_device).index >= torch.cuda.device_count():
        return None
    return measure_host_links(main.torch_device)[("cpu", main.torch_device)].bandwidth


def _follow_inputs(model: nn.Module, graph: OpGraph) -> OpGraph:
    """``graph`` with every block that holds no parameter or buffer colocated with the block before
    it: accelerate gives such a module no hook, so it runs where its input is."""
    holders = {n.rpartition(".")[0] for n, _ in [*model.named_parameters(remove_duplicate=False),
                                                 *model.named_buffers(remove_duplicate=False)]}
    prev = None
    for v in graph.topological_order():
        r = graph.record(v)
        empty = r.op != "block:<direct>" and not any(h == r.module or h.startswith(f"{r.module}.") for h in holders)
        if empty and prev is not None and r.module:
            label = graph.record(prev).colocation or f"follows:{prev}"
            graph.replace_record(prev, replace(graph.record(prev), colocation=label))
            graph.replace_record(v, replace(r, colocation=label))
        prev = v
    return graph


def _memory_terms(model: nn.Module, graph: OpGraph, batch: int, seq: int, dtype: torch.dtype | None,
                  kv_cache: bool, least_peak: int = 0, example: Mapping[str, Any] | None = None) -> OpGraph:
    """``graph`` with each block's memory beyond its weights split into what stays and what passes.

    The KV cache of a block stays for the whole generation: it becomes the block's ``temp_bytes``,
    so :func:`torchplace.costmodel.memory` adds it on the device holding the block
    (``meta["hf"]["kv_cache"]``). Working memory (a block's inputs, outputs and largest
    intermediate) lives only while the block runs, and blocks run one after the other: a device
    needs room for the largest block's, not for the sum. That peak, ``meta["hf"]["activations"]``,
    is kept free on every device that computes (:func:`~torchplace.hf.maps.solver_cluster`); at
    least ``least_peak`` (the prompt's, when the graph is one decoding step). ``example`` is the forward pass's keyword
    inputs (:func:`~torchplace.hf.kvcache.kv_cache_bytes`)."""
    paths = graph.meta["hf"]["modules"]
    itemsize = (dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)).itemsize
    whole = [p for v, p in paths.items() if graph.record(v).op != "block:<direct>"]
    cache = kv_cache_bytes(model, whole, batch, seq, itemsize, example) if kv_cache else {}
    graph.meta["hf"]["kv_cache"] = {v: cache[p] for v, p in paths.items() if cache.get(p)}
    graph.meta["hf"]["activations"] = max([least_peak, *(r.temp_bytes for _, r in graph.records())])
    for v, path in paths.items():
        graph.replace_record(v, replace(graph.record(v), temp_bytes=cache.get(path, 0)))
    return graph


def _kv_reads(graph: OpGraph, specs: Mapping[str, DeviceSpec]) -> OpGraph:
    """``graph`` (one decoding step) with each attention block's time raised by reading its KV
    cache once on each kind: ``kv_bytes / mem_bandwidth`` (every new token attends to every cached
    one; the attention FLOPs, ``4 x batch x seq x kv_heads x head_dim`` per layer, are below the
    weights' and left out). Measured CPU times get the same term from the CPU spec: the probe ran
    the step without a cache."""
    for v, nbytes in graph.meta["hf"].get("kv_cache", {}).items():
        r = graph.record(v)
        times = {k: t + nbytes / specs[k].mem_bandwidth if k in specs else t for k, t in r.times.items()}
        graph.replace_record(v, replace(r, times=times))
    return graph


def _check_fits(problem: Problem) -> None:
    """Raise InfeasibleError naming what is needed when the budgets cannot hold the model."""
    g, caps = problem.graph, budgets(problem)
    need = {v: r.param_bytes + r.temp_bytes for v, r in g.records()}
    peak = g.meta["hf"]["activations"]
    kv = g.meta["hf"].get("kv_cache", {})
    largest = max(need, key=need.__getitem__)
    biggest = max(b if b is not None else float("inf") for b in caps.values())
    if need[largest] > biggest:
        r = g.record(largest)
        raise InfeasibleError(
            f"block {r.name!r} needs {_gib(need[largest])} (weights {_gib(r.param_bytes)}, KV cache "
            f"{_gib(kv.get(largest, 0))}) and a device that computes also keeps {_gib(peak)} free for the "
            f"activations of the batch, but the largest budget leaves {_gib(biggest)}: raise max_memory "
            f"(to at least {_gib(need[largest] + peak)}), lower batch_size or sequence_length, or allow 'disk'",
            min_memory_bytes=need[largest] + peak)
    _check_unoffloadable(problem, need, caps)
    total, room = sum(need.values()), sum(b or 0 for b in caps.values())
    if None not in caps.values() and total > room:
        raise InfeasibleError(
            f"the model needs {_gib(total)} (weights and a KV cache of {_gib(sum(kv.values()))}) plus "
            f"{_gib(peak)} of activations on each device that computes, but max_memory leaves {_gib(room)} "
            "in all: raise max_memory, lower batch_size or sequence_length, or add 'disk'",
            min_memory_bytes=total + peak)


def _check_unoffloadable(problem: Problem, need: Mapping[str, int], caps: Mapping[str, int | None]) -> None:
    """Raise InfeasibleError when no device that computes can hold a block of non-persistent
    buffers (:func:`~torchplace.hf.maps.buffers_only`, kept off the offload devices when a device of
    ``max_memory`` computes), rather than the solver's bare "no placement satisfies the constraints"."""
    g = problem.graph
    pinned = g.meta["hf"].get("buffers_only", []) if main_device(problem) is not None else []
    room = [b for d, b in caps.items() if problem.cluster.device(d).kind not in OFFLOAD_KINDS]
    most = max((math.inf if b is None else b for b in room), default=0)
    block = max(pinned, key=need.__getitem__, default=None)
    if block is None or need[block] <= most:
        return
    names = [accelerate_name(d) for d, b in caps.items() if problem.cluster.device(d).kind not in OFFLOAD_KINDS]
    peak = g.meta["hf"]["activations"]
    raise InfeasibleError(
        f"{g.record(block).name!r} holds only buffers the state dict lacks ({_gib(need[block])}), which accelerate "
        f"cannot offload, so it goes on a device that computes ({', '.join(map(str, names))}); but such a device also "
        f"keeps {_gib(peak)} free for the activations of the batch, and the largest budget leaves {_gib(most)}: raise "
        f"max_memory of {names[0]} to at least {_gib(need[block] + peak)}, or lower batch_size or sequence_length",
        min_memory_bytes=need[block] + peak)


def plan_device_map(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    no_split_module_classes: Iterable[type | str] | None = None,
    batch_size: int = 1,
    sequence_length: int = 128,
    dtype: torch.dtype | str | None = None,
    cluster: Cluster | str | Path | None = None,
    kv_cache: bool = True,
    specs: Mapping[str, DeviceSpec] | None = None,
    disk_bandwidth: float = DISK_BANDWIDTH,
    time_limit: float | None = 10.0,
    repeats: int = 3,
    phase: str = "prefill",
) -> DeviceMapPlan:
    """Solve a device map for ``model`` (see :func:`infer_device_map`) and return it with its plan,
    predicted time and memory per device."""
    if time_limit is not None:  # checked before the model is probed
        time_limit = positive_float(time_limit, "time_limit", unit="of seconds")
    problem = build_problem(model, max_memory, example_inputs=example_inputs, example_kwargs=example_kwargs,
                            no_split_module_classes=no_split_module_classes, batch_size=batch_size,
                            sequence_length=sequence_length, dtype=dtype, cluster=cluster, kv_cache=kv_cache,
                            specs=specs, disk_bandwidth=disk_bandwidth, repeats=repeats, phase=phase)
    try:
        return solve_device_map(model, problem, time_limit=time_limit)
    except InfeasibleError as error:
        on_cpu = computing_on_the_cpu(problem)
        if on_cpu is None:
            raise
        try:
            result = solve_device_map(model, on_cpu, time_limit=time_limit)
        except InfeasibleError:
            raise error from None
        gpus = ", ".join(map(str, on_cpu.graph.meta["hf"]["left_out"]))
        warn_caller(f"no device map fits GPU(s) {gpus} ({error}); the map names none, so the CPU computes every "
                    "block, as accelerate's infer_auto_device_map does")
        return replace(result, requested=problem)


def solve_device_map(model: nn.Module, problem: Problem, *, time_limit: float | None = 10.0) -> DeviceMapPlan:
    """Solve ``problem`` (from :func:`build_problem` for ``model``) and write the map.

    Raises:
        UsageError: ``time_limit`` is not a positive number of seconds (or None).
        InfeasibleError: the budgets cannot hold the model; the message says how much is needed.
    """
    if time_limit is not None:
        time_limit = positive_float(time_limit, "time_limit", unit="of seconds")
    _check_fits(problem)
    plan = _solve_dispatched(problem, time_limit)
    kv = problem.graph.meta["hf"].get("kv_cache", {})
    main = main_device(problem)
    held: dict[int | str, int] = {}
    for s in plan.stages:
        where = main if main is not None and problem.cluster.device(s.device).kind in OFFLOAD_KINDS else s.device
        for v in s.nodes:
            if kv.get(v):  # an offloaded block's cache is made on the main device, where it computes
                held[accelerate_name(where)] = held.get(accelerate_name(where), 0) + kv[v]
    device_map, plan = _write_map(model, problem, plan)
    memory = {**with_reserve(problem, dispatched_memory(problem, plan.stages)),
              **host_memory(problem, plan.stages, main)}
    if main is None and held:  # "disk" alone: accelerate computes on the CPU, where the cache is made
        held = {"cpu": sum(held.values())}
    return DeviceMapPlan(device_map, plan, problem, memory, held)


def _write_map(model: nn.Module, problem: Problem, plan: Plan) -> tuple[dict[str, int | str], Plan]:
    """The map of ``plan`` and the plan it writes: ``plan``, or, when ``plan`` offloads with no block
    on the main device and the model has no module without weights to name it in the map
    (:func:`~torchplace.hf.maps.to_device_map`), ``plan`` with one block (and the blocks colocated
    with it) moved onto the main device: of the moves that keep every device within its budget, the
    fastest.

    Raises:
        InfeasibleError: no block can move onto the main device within its budget.
    """
    try:
        return to_device_map(model, problem, plan), plan
    except InfeasibleError as e:
        failure = e
    main, g = main_device(problem), problem.graph
    held = g.meta["hf"].get("tensors", {})
    where, order = plan.assignment, [v for s in plan.stages for v in s.nodes]
    groups: dict[str, list[str]] = {}
    for v, r in g.records():
        groups.setdefault(r.colocation or v, []).append(v)
    best = None
    for members in groups.values():
        if main is None or not any(held.get(v) for v in members):
            continue
        stages = stages_from_order(problem, order, {**where, **dict.fromkeys(members, main)})
        if not within_budgets(problem, dispatched_memory(problem, stages)):
            continue
        try:
            moved = Plan.build(problem, stages, solver=plan.solver, seconds=plan.seconds,
                               lower_bound=plan.lower_bound, status="feasible",
                               meta={**plan.meta, "main": f"{g.record(members[0]).name} moved onto {main}"})
        except InvalidPlanError:
            continue
        if best is None or moved.objective < best.objective:
            best = moved
    if best is None:
        raise failure
    if best.objective <= best.lower_bound * (1 + 1e-9):
        best.status = "optimal"
    return to_device_map(model, problem, best), best


OFFLOAD_ROUNDS = 2
"""Re-solves with room kept on the devices the last plan overfilled, before the last resorts."""


def _solve_dispatched(problem: Problem, time_limit: float | None) -> Plan:
    """The faster of the solver's plan (:func:`_solved_dispatched`) and the in-order fill
    (:func:`_filled_in_order`) where that fits: a MILP stopped by its time limit may hold a plan
    slower than filling the devices in order, which is what accelerate's ``sequential`` map does
    with the room a careful user leaves for activations and the KV cache.

    Raises:
        InfeasibleError: if neither has a plan that fits.
    """
    try:
        solved = _solved_dispatched(problem, time_limit)
    except InfeasibleError:
        filled = _filled_in_order(problem, combinatorial_lower_bound(problem, time_limit=1.0))
        if filled is None:
            raise
        return filled
    filled = _filled_in_order(problem, solved.lower_bound)
    if filled is None or solved.objective <= filled.objective:
        return solved
    filled.seconds = solved.seconds
    filled.meta["solver's plan"] = solved.objective
    return filled


def _filled_in_order(problem: Problem, lower_bound: float) -> Plan | None:
    """The plan that fills the devices in cluster order (GPUs by id, then the host, then disk) with
    the blocks in call order: each block on the device of the block before it, or the next device,
    whichever first keeps every device within its :func:`~torchplace.hf.maps.budgets` as
    dispatched (:func:`~torchplace.hf.maps.dispatched_memory`), a colocation group (tied weights)
    placed whole with its first block; ``None`` where no such fill fits."""
    g = problem.graph
    order = g.topological_order()
    devices = [d.name for d in problem.cluster.devices]
    groups: dict[str, list[str]] = {}
    for v in order:
        groups.setdefault(g.record(v).colocation or v, []).append(v)
    where: dict[str, str] = {}
    placed: list[str] = []
    i = 0
    for v in order:
        if v in where:  # placed with the first block of its group
            continue
        members = groups[g.record(v).colocation or v]
        placed += members
        while i < len(devices):
            where.update(dict.fromkeys(members, devices[i]))
            if within_budgets(problem, dispatched_memory(problem, stages_from_order(problem, placed, where))):
                break
            i += 1
        else:
            return None
    try:
        plan = Plan.build(problem, stages_from_order(problem, order, where), solver="in-order fill", seconds=0.0,
                          lower_bound=lower_bound, status="feasible")
    except InvalidPlanError:
        return None
    if plan.objective <= plan.lower_bound * (1 + 1e-9):
        plan.status = "optimal"
    return plan


def _solved_dispatched(problem: Problem, time_limit: float | None) -> Plan:
    """The solver's plan, checked against :func:`~torchplace.hf.maps.dispatched_memory` and the
    true :func:`~torchplace.hf.maps.budgets`.

    The cost model charges a block's KV cache where the block is mapped, but an offloaded block
    computes on the main device (:func:`~torchplace.hf.maps.offload_charge`), so its cache and its
    streamed weights are on the main device and only its weights on the offload device; the solver
    cannot see that (it adds memory per device). As :mod:`torchplace.solvers.liveness` does: the
    first plan's problem charges the main device less than the truth, and gives each offload device
    room for the whole KV cache (:func:`~torchplace.hf.maps.solver_cluster`), so its bound holds;
    when that plan overfills a device, the problem is solved again with that device's budget lowered by what the last plan
    overfilled it with (a restriction); if that does not settle it, the better of two last resorts:
    no offloading at all, and the main device's budget lowered by the most any map can put there
    (every block's KV cache and the largest block's weights) with the offload devices at their own
    budgets, after which every plan fits. A plan of a restriction keeps the first plan's bound.

    Raises:
        InfeasibleError: if neither last resort has a plan that fits.
    """
    start = time.perf_counter()
    first = plan = solvers.solve(problem, method="auto", time_limit=time_limit)

    def fits(p: Plan) -> bool:
        return within_budgets(problem, dispatched_memory(problem, p.stages))

    def restricted(caps: Mapping[str, int], why: str) -> Plan | None:
        """The plan for budgets ``caps`` (torchplace names), or ``None`` if the solver finds none."""
        devices = tuple(replace(d, memory_bytes=max(min(d.memory_bytes, caps[d.name]), 0))
                        if d.name in caps and d.memory_bytes is not None else d for d in problem.cluster.devices)
        left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.1)
        try:
            solved = solvers.solve(replace(problem, cluster=replace(problem.cluster, devices=devices)),
                                   method="auto", time_limit=left)
        except InfeasibleError:
            return None
        out = Plan.build(problem, solved.stages, solver=solved.solver, seconds=time.perf_counter() - start,
                         lower_bound=first.lower_bound, status="feasible", meta={**solved.meta, "offload": why})
        if out.objective <= out.lower_bound * (1 + 1e-9):
            out.status = "optimal"
        return out

    if fits(plan):
        return plan
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices if d.memory_bytes is not None}
    true = budgets(problem)
    reserves: dict[str, int] = {}
    for _ in range(OFFLOAD_ROUNDS):  # room kept on the devices the last plan overfilled
        main, extra = offload_charge(problem, plan.stages)
        memory = dispatched_memory(problem, plan.stages)
        over = {d: b - t for d, b in memory.items() if (t := true.get(d)) is not None and b > t}
        if not over:
            break
        for d, excess in over.items():  # the main device: what the plan offloaded there; else the excess
            reserves[d] = max(reserves.get(d, 0) + 1, extra) if d == main else reserves.get(d, 0) + excess
        found = restricted({d: caps[d] - b for d, b in reserves.items()}, f"room kept: {reserves}")
        if found is None:
            break
        if fits(found):
            return found
        plan = found
    # last: no offload at all, or room on the main device for the most any map offloads there
    g, kv = problem.graph, problem.graph.meta["hf"].get("kv_cache", {})
    most = sum(kv.values()) + max((r.param_bytes for _, r in g.records()), default=0)
    main = main_device(problem)
    offload = [d.name for d in problem.cluster.devices if d.kind in OFFLOAD_KINDS]
    tight = {d: b for d in offload if (b := true[d]) is not None}
    if main is not None and main in caps:
        tight[main] = caps[main] - most
    found_plans = [p for p in (restricted(dict.fromkeys(offload, 0), "none") if offload else None,
                               restricted(tight, f"room kept: {_gib(most)} on {main}"))
                   if p is not None and fits(p)]
    if not found_plans:
        where = "the device that computes the offloaded blocks"
        if main is not None and true.get(main) is not None:
            peak = problem.graph.meta["hf"]["activations"]
            where = (f"{main}, which computes the offloaded blocks ({_gib(true[main])} of its max_memory left "
                     f"beside the activations' {_gib(peak)})")
        raise InfeasibleError(f"every map that fits the weights overfills {where} with their KV cache and streamed "
                              f"weights (up to {_gib(most)}), and none fits without offloading: raise max_memory or "
                              "lower batch_size or sequence_length")
    return min(found_plans, key=lambda p: p.objective)


def infer_device_map(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    no_split_module_classes: Iterable[type | str] | None = None,
    batch_size: int = 1,
    sequence_length: int = 128,
    dtype: torch.dtype | str | None = None,
    cluster: Cluster | str | Path | None = None,
    **options: Any,
) -> dict[str, int | str]:
    """A ``device_map`` for ``from_pretrained(device_map=...)`` / ``accelerate.dispatch_model``
    that minimises the time of a forward pass of the stated batch (or, with ``phase="decode"``,
    of one generated token) and fits its KV cache.

    Example:
        >>> cfg = AutoConfig.for_model("gpt2", n_layer=12)                        # doctest: +SKIP
        >>> with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)
        >>> device_map = torchplace.infer_device_map(model, {0: "6GiB", 1: "12GiB", "cpu": "64GiB"},
        ...                                          batch_size=8, sequence_length=1024)
        >>> model = AutoModelForCausalLM.from_pretrained("gpt2", device_map=device_map)

    Args:
        model: a Hugging Face model (any ``nn.Module`` whose blocks accelerate can place), with
            weights on the CPU (CPU times are measured) or built on the meta device (every time is
            estimated; nothing is allocated, so a model larger than this machine can be planned).
        max_memory: accelerate's form, ``{0: "10GiB", 1: "10GiB", "cpu": "30GiB"}``; ``"disk"`` is
            used only when named. ``None``: the visible GPUs and the CPU. When no map fits the
            GPUs, the map names none, and the CPU computes every block (as accelerate's
            ``infer_auto_device_map`` gives ``{"": "cpu"}`` for a GPU too small for anything).
        example_inputs, example_kwargs: one forward call (on the model's device); default: random
            ``input_ids`` of ``(batch_size, sequence_length)`` (of ``(batch_size, 1)`` with
            ``phase="decode"``).
        no_split_module_classes: classes (or names) never split; default: the model's
            ``_no_split_modules``, as ``from_pretrained`` does.
        batch_size, sequence_length: the batch whose KV cache (and, by default, activations) the
            map leaves room for.
        dtype: dtype of the dispatched weights (``torch.float16``, ``"bfloat16"``); default: the
            model's.
        cluster: a :class:`Cluster` or cluster file giving each GPU's kind (``"cuda"``, ``"cuda-t4"``,
            ... :data:`torchplace.hf.blocks.HF_DEVICE_SPECS`) and the host link. Without one, a
            model with real weights whose main GPU is attached has the host link of its offload
            measured (:func:`torchplace.profiling.links.measure_host_links`).
        options: ``phase`` (``"prefill"``: the time of one forward pass of the batch, the default;
            ``"decode"``: the time per generated token, every attention block reading its KV cache
            of ``sequence_length`` tokens, with room kept for the prompt's activations too),
            ``kv_cache`` (False: no KV cache), ``specs``, ``disk_bandwidth``, ``time_limit``,
            ``repeats`` (see :func:`plan_device_map`).

    Returns:
        ``{module path: GPU id | "cpu" | "disk"}``, tied weights on one device.

    Raises:
        UsageError: a bad argument (named, with the fix), or an option :func:`plan_device_map` does
            not take.
        InfeasibleError: the budgets cannot hold the model with its KV cache; the message says how
            much is needed.
    """
    names = sorted(set(inspect.signature(plan_device_map).parameters) - {"model", "max_memory"})
    unknown = sorted(set(options) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        raise UsageError(f"infer_device_map takes no option {unknown[0]!r}: "
                         + (f"did you mean {close[0]!r}?" if close else f"its options are {names}"))
    return plan_device_map(model, max_memory, example_inputs=example_inputs, example_kwargs=example_kwargs,
                           no_split_module_classes=no_split_module_classes, batch_size=batch_size,
                           sequence_length=sequence_length, dtype=dtype, cluster=cluster, **options).device_map
