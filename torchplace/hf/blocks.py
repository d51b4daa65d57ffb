"""A Hugging Face model as a chain of blocks: the OpGraph a ``device_map`` is solved on.

accelerate places whole modules, so the graph here has one node per *block*: a module that is
never split (a class of ``no_split_module_classes``, e.g. ``GPT2Block``) or a leaf module, found by
walking the module tree from the root. One forward pass on example inputs (on the model's own
device: the CPU, or ``meta`` for a model built without weights) runs with hooks on the blocks and
records, per block, in call order:

- the FLOPs (:class:`torch.utils.flop_counter.FlopCounterMode`, which counts on meta tensors too),
- the bytes of its output (what crosses a device boundary after it),
- the largest output of anything inside it (its working memory, with its input and output),
- on the CPU, its wall time (median over ``repeats`` passes): a *measured* ``"cpu"`` time.

Blocks become a chain in call order (block ``i`` feeds block ``i + 1``; the bytes of that edge are
block ``i``'s output), which is how a dispatched model runs them: one after the other. Times on
device kinds not measured are the roofline estimate of :mod:`torchplace.profiling.estimate`
(``max(flops / peak, bytes / bandwidth) + overhead``, bytes = weights + input + output, the
peak that of the dtype the block computes in once loaded in ``dtype``: an A100's float16
tensor-core peak for a float16 map, :meth:`~torchplace.profiling.estimate.DeviceSpec.peak`).

Blocks that share a parameter (tied weights: GPT-2's ``lm_head`` and ``wte``) get one colocation
label, so a plan puts them on one device, as accelerate requires.

A model on the meta device runs on fake tensors (no memory). Mixture-of-experts blocks call
grouped expert matmuls (``aten._grouped_mm``), which the flop counter does not know (counted here,
:func:`_grouped_mm_flops`) and whose fake kernel takes bfloat16 only: a model in another dtype is
then run on bfloat16 fake tensors (FLOPs and shapes are the dtype's own; bytes are scaled back to
the model's dtype). If even that fails because the tensors are fake (a kernel with no fake
implementation, data-dependent control flow), every block is costed from its parameters alone:
``2 x params x tokens`` FLOPs and a hidden-size output per token in the dtype it will run in (a
dense upper bound on FLOPs for MoE blocks), and the result says so
(``graph.meta["hf"]["costs"] == "structural"``). An error of the model's own code (inputs it does
not take, a config whose shapes do not agree) is a :class:`~torchplace.errors.UsageError` instead,
never hidden by that fallback.
"""
from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from torchplace.errors import UsageError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.profiling.estimate import DEVICE_SPECS, DeviceSpec
from torchplace.profiling.livebytes import LiveBytes

__all__ = ["HF_DEVICE_SPECS", "Block", "block_graph", "blocks_of", "forward", "kept_in_fp32"]

HF_DEVICE_SPECS: dict[str, DeviceSpec] = dict(DEVICE_SPECS)
"""Roofline specs by device kind: those of :data:`~torchplace.profiling.estimate.DEVICE_SPECS`
(``"cuda"`` A100-like, ``"cuda-t4"``, ``"accel"``, ``"cpu"``, each with its peak per dtype), the
same numbers :func:`torchplace.place` estimates with."""


@dataclass(frozen=True)
class Block:
    """One placeable module: its dotted path, class name and the tensors it holds."""

    path: str
    cls: str
    param_bytes: int
    tensors: tuple[int, ...]  # ids of the parameters and buffers it holds (tied ones included)
    names: tuple[str, ...] = ()  # "<direct>" blocks: the full names of the tensors it holds
    shared_bytes: int = 0  # bytes of the tensors it holds that an earlier block counted (tied weights)


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
    return t.numel() * size


def kept_in_fp32(model: nn.Module, dtype: torch.dtype | None) -> set[int]:
    """Ids of the tensors ``from_pretrained(..., dtype=dtype)`` loads in float32 whatever ``dtype`` says.

    As transformers 5's ``PreTrainedModel._get_dtype_plan`` and ``core_model_loading`` decide it:
    under ``float16`` the patterns of ``_keep_in_fp32_modules``, under ``float16`` or ``bfloat16``
    those of ``_keep_in_fp32_modules_strict`` (T5's ``wo``), each a regex (``*`` as ``.*``) searched
    in every state-dict key; a tied tensor is float32 if any of its names matches. Empty for
    ``dtype`` ``None`` (weights counted as they are) or a model without those attributes."""
    patterns: list[str] = []
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not patterns:
        return set()
    keep = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    loaded = set(model.state_dict())
    return {id(t) for n, t in named if n in loaded and t.is_floating_point() and keep.search(n)}


def blocks_of(model: nn.Module, no_split: Sequence[str], dtype: torch.dtype | None = None) -> list[Block]:
    """The blocks of ``model`` in registration order (see the module docstring).

    A module is a block if its class name is in ``no_split``, or it has no children, or it is a
    child without parameters or buffers of its own below it (nothing to place). A module that is
    expanded may still hold tensors directly (``nn.Parameter`` attributes): those become a block
    of their own at the module's path with ``cls`` ``"<direct>"``. Bytes are those of the tensors
    in ``dtype`` (``None``: as they are), float32 for those :func:`kept_in_fp32`.
    """
    out: list[Block] = []
    counted: set[int] = set()  # a tied tensor's bytes count once, on the first block holding it
    fp32 = kept_in_fp32(model, dtype)

    def size(t: torch.Tensor) -> int:
        return _tensor_bytes(t, torch.float32 if id(t) in fp32 else dtype)

    def nbytes(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
        """(bytes of the tensors no earlier block counted, bytes of those one did)."""
        unique = _unique(tensors)
        seen = [id(t) in counted for t in unique]
        counted.update(id(t) for t in unique)
        return (sum(size(t) for t, s in zip(unique, seen) if not s),
                sum(size(t) for t, s in zip(unique, seen) if s))

    def visit(path: str, m: nn.Module) -> None:
        children = list(m.named_children())
        if type(m).__name__ in no_split or not children:
            tensors = [*m.parameters(), *m.buffers()]
            own, shared = nbytes(tensors)
            out.append(Block(path, type(m).__name__, own, tuple(id(t) for t in tensors), shared_bytes=shared))
            return
        direct = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        if direct:
            prefix = f"{path}." if path else ""
            own, shared = nbytes([t for _, t in direct])
            out.append(Block(path, "<direct>", own, tuple(id(t) for _, t in direct),
                             tuple(prefix + n for n, _ in direct), shared))
        for name, child in children:
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return out


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


@dataclass
class _Record:
    flops: int = 0
    out_bytes: int = 0
    in_bytes: int = 0
    peak_bytes: int = 0
    live_bytes: int = 0
    seconds: list[float] | None = None


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _Probe:
    """Hooks on every block (and their descendants) for one forward pass."""

    def __init__(self, model: nn.Module, blocks: Sequence[Block], live: LiveBytes | None = None) -> None:
        self.model, self.live = model, live
        self.marks: dict[str, int] = {}
        self.paths = [b.path for b in blocks]
        self.records = {p: _Record() for p in self.paths}
        self.order: list[str] = []
        self.handles: list[Any] = []
        self.started: dict[str, float] = {}

    def __enter__(self) -> _Probe:
        mods = dict(self.model.named_modules())
        for path in self.paths:
            m = mods[path]
            self.handles.append(m.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(path)))
            for name, sub in m.named_modules():
                if name:
                    self.handles.append(sub.register_forward_hook(self._inner(path)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, path: str) -> Any:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            if path not in self.order:
                self.order.append(path)
            r = self.records[path]
            r.in_bytes = max(r.in_bytes, _bytes((args, kwargs)))
            if self.live is not None:
                self.marks[path] = self.live.mark()
            self.started[path] = time.perf_counter()
        return hook

    def _post(self, path: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            r = self.records[path]
            if r.seconds is not None:
                r.seconds.append(time.perf_counter() - self.started[path])
            r.out_bytes = max(r.out_bytes, _bytes(out))
            if self.live is not None and path in self.marks:
                r.live_bytes = max(r.live_bytes, self.live.peak - self.marks.pop(path))
        return hook

    def _inner(self, path: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            r = self.records[path]
            r.peak_bytes = max(r.peak_bytes, _bytes(out))
        return hook


@contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Keep FakeTensorMode from logging a traceback for a kernel it cannot run: the caller falls
    back to structural costs and says so."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def forward(model: nn.Module, kwargs: Mapping[str, Any], *contexts: Any, fake_dtype: torch.dtype | None = None) -> Any:
    """One forward pass of ``model`` on keyword inputs ``kwargs``, without gradients, inside the
    context managers ``contexts`` (entered in order). A model on the meta device runs on fake
    tensors (:class:`FakeTensorMode`, swapped in with :func:`torch.func.functional_call`): shapes,
    FLOPs and bytes without memory, and transformers skips its data-dependent checks on them as it
    does while tracing; ``fake_dtype``: its floating tensors are made in that dtype instead of
    their own."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        with ExitStack() as stack:
            for c in (torch.no_grad(), *contexts):
                stack.enter_context(c)
            return model(**kwargs)

    def dtype_of(t: torch.Tensor) -> torch.dtype:
        return fake_dtype if fake_dtype is not None and t.is_floating_point() else t.dtype

    with ExitStack() as stack:
        for c in (_quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), *contexts):
            stack.enter_context(c)
        state = {n: torch.empty_strided(t.shape, t.stride(), dtype=dtype_of(t), device="cpu")
                 for n, t in [*model.named_parameters(), *model.named_buffers()]}
        fake = pytree.tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
                               if isinstance(v, torch.Tensor) else v, dict(kwargs))
        return functional_call(model, state, (), fake, strict=False)


_FAKE_ERRORS = (RuntimeError, NotImplementedError)
"""What a forward pass on fake tensors raises besides :data:`_INPUT_ERRORS`: a kernel that cannot
run on fake tensors (:data:`_FAKE_ONLY`), a fake kernel that takes another dtype (grouped expert
matmuls: bfloat16 only), or an error of the model itself (shapes its config makes inconsistent)."""
_FAKE_ONLY = (UnsupportedOperatorException, DataDependentOutputException, DynamicOutputShapeException,
              UnsupportedFakeTensorException, NotImplementedError)
"""What only fake tensors raise: an operator with no fake or meta kernel, or one whose output
depends on the data (``nonzero``, ``.item()``), which real weights would run."""
_NO_FAKE_KERNEL = re.compile(r"no fake impl|fake kernel|meta kernel|'Meta' backend", re.IGNORECASE)
"""A custom operator without a fake implementation raises a plain ``RuntimeError`` saying so."""


def _fake_only(e: BaseException) -> bool:
    """Whether ``e`` comes from running on fake tensors rather than from the model (see :data:`_FAKE_ONLY`)."""
    return isinstance(e, _FAKE_ONLY) or (isinstance(e, RuntimeError) and bool(_NO_FAKE_KERNEL.search(str(e))))
_INPUT_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError)
"""What a model's Python code raises for inputs it does not take (a missing ``input_ids``, a
keyword the model does not know, an index beyond its positions)."""


def _bad_inputs(model: nn.Module, e: BaseException) -> UsageError:
    return UsageError(f"{type(model).__name__} failed on its example inputs ({type(e).__name__}: {e}): pass "
                      "example_inputs / example_kwargs of one forward call the model takes, or, if it fails on "
                      "every input, fix the model or its config")


def _probe_or_none(model: nn.Module, blocks: Sequence[Block], kwargs: Mapping[str, Any],
                   repeats: int) -> tuple[_Probe | None, float]:
    """:func:`_probe`, and the factor its bytes take to the model's own dtype. A meta model whose
    forward pass fails on fake tensors (:data:`_FAKE_ERRORS`) is probed again on bfloat16 fake
    tensors (grouped expert matmuls' fake kernel takes nothing else); if the last try failed only
    because the tensors are fake (:func:`_fake_only`: a kernel with no fake implementation,
    data-dependent control flow) there is no probe (:func:`_structural` costs it from its
    parameters).

    Raises:
        UsageError: the forward pass fails on a real model, or on a meta model with an error of
            the model's own code (:data:`_INPUT_ERRORS`, or any other error not :func:`_fake_only`,
            e.g. head counts that do not divide): the inputs or the config are not ones it takes,
            and a structural guess would hide it.
    """
    meta = any(p.is_meta for p in model.parameters())
    try:
        return _probe(model, blocks, kwargs, repeats), 1.0
    except _INPUT_ERRORS as e:
        raise _bad_inputs(model, e) from e
    except _FAKE_ERRORS as e:
        if not meta:
            raise _bad_inputs(model, e) from e
        failed: BaseException = e
    if _own_dtype(model) not in (None, torch.bfloat16):  # another dtype may let a fake kernel run
        try:
            back = 1.0 / _act_scale(model, torch.bfloat16)  # bfloat16 bytes back to the model's dtype
            return _probe(model, blocks, kwargs, repeats, fake_dtype=torch.bfloat16), back
        except _INPUT_ERRORS as e:
            raise _bad_inputs(model, e) from e
        except _FAKE_ERRORS as e:
            failed = e
    if _fake_only(failed):
        return None, 1.0
    raise _bad_inputs(model, failed) from failed


def _grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, out_shape: Sequence[int],
                      **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: each row of ``a`` times its group's matrix of ``b``.

    ``a`` (T, K) with ``b`` (G, K, N) gives (T, N): ``2 T K N``; ``a`` (G, M, K) with ``b``
    (G, K, N) gives (G, M, N): ``2 G M K N``; ``a`` (M, K) with ``b`` (K, N), groups splitting
    ``K`` (a weight gradient), gives (G, M, N) and costs ``2 M K N`` in all."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _probe(model: nn.Module, blocks: Sequence[Block], kwargs: Mapping[str, Any], repeats: int,
           fake_dtype: torch.dtype | None = None) -> _Probe:
    """One counted pass (FLOPs per block, bytes, call order; on fake tensors for a model on the meta
    device, see :func:`forward`), then ``repeats`` timed passes on the CPU."""
    live = LiveBytes()
    probe = _Probe(model, blocks, live)
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # attention as the math kernel runs it (its score matrices materialised): the most memory any
    # backend takes (an H100 ran GPT-2's fp32 attention so, 108 MiB per block where CPU's flash
    # kernel's outputs and the submodules' said 36)
    forward(model, kwargs, sdpa_kernel(SDPBackend.MATH), probe, counter, live, fake_dtype=fake_dtype)
    probe.live = None  # the timed passes below run as the model runs
    flops = counter.get_flop_counts()
    root = type(model).__name__
    for path, r in probe.records.items():
        key = f"{root}.{path}" if path else root
        r.flops = int(sum(flops.get(key, {}).values()))
    if repeats > 0 and not on_meta:
        for r in probe.records.values():
            r.seconds = []
        with torch.no_grad(), probe:
            for _ in range(repeats):
                model(**kwargs)
    return probe


def block_graph(
    model: nn.Module,
    example_kwargs: Mapping[str, Any],
    *,
    kinds: Sequence[str],
    no_split: Sequence[str],
    dtype: torch.dtype | None = None,
    repeats: int = 3,
    specs: Mapping[str, DeviceSpec] | None = None,
) -> OpGraph:
    """The chain OpGraph of ``model``'s blocks (module docstring) with times on every kind.

    Args:
        model: a Hugging Face (or any) model, on the CPU or the meta device.
        example_kwargs: one forward call's keyword inputs, on the model's device.
        kinds: device kinds to give times for; ``"cpu"`` is measured when the weights are real.
        no_split: class names of modules never split.
        dtype: the dtype the weights will have when dispatched (bytes per parameter); ``None``:
            as they are.
        repeats: timed passes for measured CPU times (0: estimate them too).
        specs: roofline specs by kind (default :data:`HF_DEVICE_SPECS`).

    Returns:
        The graph; ``graph.meta["hf"]`` holds each node's module path (``"modules"``), the
        state-dict names of the tensors it holds (``"tensors"``, what a ``device_map`` must cover),
        the bytes of the tied tensors it holds that an earlier block counted (``"shared"``) and how
        it was costed (``"costs"``).

    Raises:
        UsageError: for a kind with no spec to estimate with (the message lists the known kinds).
    """
    specs = dict(HF_DEVICE_SPECS if specs is None else specs)
    blocks = blocks_of(model, no_split, dtype)
    probe, probed_scale = _probe_or_none(model, blocks, example_kwargs, repeats)
    scale = probed_scale * (1.0 if dtype is None else _act_scale(model, dtype))
    records, costs = _block_records(model, blocks, probe, example_kwargs, scale, dtype)
    missing = [k for k in kinds if k not in specs and not (k == "cpu" and probe and _timed(probe))]
    if missing:
        raise UsageError(f"no device spec for kind {missing[0]!r} to estimate times with; known kinds: "
                         f"{sorted(specs)} (name one of them in the cluster file, or pass "
                         "specs={kind: DeviceSpec(...)})")
    g = OpGraph(meta={"hf": {"costs": costs, "modules": {}, "tensors": {}, "shared": {}}})
    saved = _saved_names(model, [b for b, _ in records])
    compute = _compute_dtype(model, dtype)
    prev = None
    for i, (b, r) in enumerate(records):
        times = {k: specs[k].seconds(r.flops, b.param_bytes + r.in_bytes + r.out_bytes, compute(b)) for k in kinds
                 if k in specs}
        if "cpu" in kinds and r.seconds:
            times["cpu"] = statistics.median(r.seconds)
        node = f"b{i}"
        work = r.in_bytes + max(r.out_bytes + r.peak_bytes, r.live_bytes)  # live: the most made at once
        g.add_node(node, NodeRecord(name=b.path or type(model).__name__, op=f"block:{b.cls}", module=b.path,
                                    param_bytes=b.param_bytes, output_bytes=r.out_bytes, temp_bytes=work,
                                    times=times))
        g.meta["hf"]["modules"][node] = b.path
        g.meta["hf"]["tensors"][node] = saved[b.path, b.cls == "<direct>"]
        if b.shared_bytes:
            g.meta["hf"]["shared"][node] = b.shared_bytes
        if prev is not None:
            g.add_edge(prev, node)
        prev = node
    return _tie(g, [b for b, _ in records])


def _saved_names(model: nn.Module, blocks: Sequence[Block]) -> dict[tuple[str, bool], tuple[str, ...]]:
    """The state-dict names each block holds, by (path, is a ``"<direct>"`` block): a whole block
    holds every name below its path, a ``"<direct>"`` block its own tensors' names."""
    direct = {n: b.path for b in blocks if b.cls == "<direct>" for n in b.names}
    whole = {b.path for b in blocks if b.cls != "<direct>"}
    out: dict[tuple[str, bool], list[str]] = {(b.path, b.cls == "<direct>"): [] for b in blocks}
    for name in model.state_dict():
        if name in direct:
            out[direct[name], True].append(name)
            continue
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            if ".".join(parts[:i]) in whole:
                out[".".join(parts[:i]), False].append(name)
                break
    return {k: tuple(v) for k, v in out.items()}


def _timed(probe: _Probe) -> bool:
    return any(r.seconds for r in probe.records.values())


def _compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> Callable[[Block], torch.dtype | None]:
    """The dtype a block computes in once loaded in ``dtype`` (None: the model's own), as a function
    of the block: float32 for a block whose floating tensors :func:`kept_in_fp32` keeps all in
    float32 (T5's ``wo`` under float16), else ``dtype``; the roofline takes that dtype's peak."""
    target = dtype or _own_dtype(model)
    fp32 = kept_in_fp32(model, dtype)
    floating = {id(t) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}

    def of(b: Block) -> torch.dtype | None:
        mine = [t for t in b.tensors if t in floating]
        return torch.float32 if fp32 and mine and all(t in fp32 for t in mine) else target

    return of


def _own_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (None without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _act_scale(model: nn.Module, dtype: torch.dtype) -> float:
    """Activation bytes scale when the model will run in ``dtype`` instead of its own dtype."""
    return dtype.itemsize / (_own_dtype(model) or dtype).itemsize


def _block_records(model: nn.Module, blocks: Sequence[Block], probe: _Probe | None, kwargs: Mapping[str, Any],
                   scale: float, dtype: torch.dtype | None) -> tuple[list[tuple[Block, _Record]], str]:
    """Blocks in call order (blocks never called go last, in registration order) with their costs:
    the probe's bytes times ``scale``, or without a probe :func:`_structural` ones in ``dtype``."""
    if probe is None:
        return _structural(model, blocks, kwargs, dtype), "structural"
    order = {p: i for i, p in enumerate(probe.order)}
    ranked = sorted(blocks, key=lambda b: order.get(b.path, len(order)))
    out = []
    for b in ranked:
        r = probe.records[b.path]
        out.append((b, _Record(r.flops, int(r.out_bytes * scale), int(r.in_bytes * scale), int(r.peak_bytes * scale),
                               int(r.live_bytes * scale), r.seconds)))
    return out, "measured" if _timed(probe) else "estimated"


def _structural(model: nn.Module, blocks: Sequence[Block], kwargs: Mapping[str, Any],
                dtype: torch.dtype | None) -> list[tuple[Block, _Record]]:
    """Costs from parameters alone: ``2 x params x tokens`` FLOPs (``params``: the elements of
    every parameter the block holds, tied ones too: a tied ``lm_head`` computes with them), a
    hidden-size output per token in ``dtype`` (``None``: the model's own)."""
    ids = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    tokens = ids.numel() if ids is not None else 1
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 1024)
    item = (dtype or _own_dtype(model) or torch.float32).itemsize
    numel = {id(p): p.numel() for p in model.parameters()}
    out = []
    for b in blocks:
        params = sum(numel.get(t, 0) for t in set(b.tensors))
        act = tokens * hidden * item
        out.append((b, _Record(2 * params * tokens, act, act, 4 * act)))
    return out


def _tie(g: OpGraph, blocks: Sequence[Block]) -> OpGraph:
    """Give blocks that share a tensor one colocation label (union of overlapping tensor sets)."""
    owner: dict[int, int] = {}
    parent = list(range(len(blocks)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, b in enumerate(blocks):
        for t in b.tensors:
            if t in owner:
                parent[find(i)] = find(owner[t])
            else:
                owner[t] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(blocks)):
        groups.setdefault(find(i), []).append(i)
    from dataclasses import replace

    for members in groups.values():
        if len(members) > 1:
            label = "tied:" + "+".join(blocks[i].path for i in members)
            for i in members:
                g.replace_record(f"b{i}", replace(g.record(f"b{i}"), colocation=label))
    return g
