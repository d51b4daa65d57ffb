"""Trace an ``nn.Module`` into a :class:`torch.fx.GraphModule` and an :class:`OpGraph`.

Three capture methods:

* ``"fx"``: :func:`torch.fx.symbolic_trace` with a tracer whose leaves are the user's
  ``leaf_modules`` (and, at module granularity, every childless or standard ``torch.nn`` module).
  The graph holds ``call_module`` nodes for leaves and Python-level ops elsewhere.
* ``"export"``: ``torch.export.export(model, inputs, strict=False).module()``. The graph holds aten
  ops; module structure survives only in ``node.meta["nn_module_stack"]``, so leaves are formed by
  grouping aten nodes per leaf-module instance.
* ``"auto"`` tries fx, then export.

The :class:`OpGraph` has one node per compute fx node (``call_function``/``call_method``/
``call_module``) or per group of them. Placeholders, ``get_attr`` and ``output`` are runtime
concerns and get no node. **Node ids are fx node names**: the name of the node's first fx node (in
graph order). Each parameter/buffer is counted once (by storage), on the first node in topological
order that reads it, and listed with all its readers in ``graph.meta["state"]``; a tensor no node reads
(BatchNorm's ``num_batches_tracked`` in eval mode) is counted with its module's other tensors.

Caveat: ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` with ``batch_first=True`` take
a fused "fast path" in eval mode under ``no_grad``. Tracing never captures it, so the traced module
matches the model run with grad enabled (or with ``torch.backends.mha.set_fastpath_enabled(False)``)
bitwise, but not the fast path.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import operator
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.errors import TraceError, UsageError
from torchplace.fxutil import (
    Interpreter,
    on_meta_device,
    TensorInfo,
    flat_inputs,
    is_compute,
    is_python_number,
    relax_views,
    symbolic_sizes,
    tensor_bytes,
)
from torchplace.graph import OpGraph
from torchplace.interrupts import held_interrupt
from torchplace.profiling.dynamic import (DynamicDims, check_dynamic_dims, check_exportable, dynamic_inputs,
                                         dynamic_shapes)
from torchplace.profiling.effects import AccessLog, Effects, StateSnapshot, analyse, named_state, union
from torchplace.profiling.livebytes import LiveBytes
from torchplace.profiling.opgraph import build_opgraph

__all__ = ["Traced", "trace"]

_METHODS = ("auto", "fx", "export")
_GRANULARITIES = ("operator", "module")


@dataclass(frozen=True)
class Traced:
    """A traced model.

    Attributes:
        gm: the module the runtime splits and runs. ``gm(*example_inputs)`` returns what the model
            returns, with the same pytree structure (for ``"export"``, e.g. a Hugging Face
            ``ModelOutput``) and bitwise-equal tensors in eval mode.
        graph: the :class:`OpGraph` over ``gm``'s compute nodes (costs except ``times``).
        method: the capture method actually used, ``"fx"`` or ``"export"``.
        effects: the graph's in-place writes and what they force on a placement
            (:mod:`torchplace.profiling.effects`).
        model: the traced model (whose parameters and buffers ``gm`` shares).
        granularity, leaf_types, dynamic_dims: how it was traced (to trace it again alike).
        output_spec: the model's own output structure where the graph's differs from it in
            container types only (fx returns a ``dict`` for a ``ModelOutput`` or an
            ``OrderedDict``); set by ``place()``, which runs both
            (:func:`torchplace.batchdim.output_spec`). ``None``: the graph's is the model's.
    """

    gm: fx.GraphModule
    graph: OpGraph
    method: str
    effects: Effects = field(default_factory=Effects)
    model: nn.Module | None = None
    granularity: str = "operator"
    leaf_types: tuple[type, ...] = ()
    dynamic_dims: DynamicDims = None
    output_spec: Any = None

    def flat_inputs(self, example_inputs: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """Fresh copies of the values of ``gm``'s placeholders, in order (see :func:`flat_inputs`)."""
        return flat_inputs(self.gm, example_inputs, example_kwargs, copy=True)

    def written_inputs(self) -> list[str]:
        """The model inputs (placeholders of ``gm``) the graph writes in place."""
        inputs = {n.name for n in self.gm.graph.find_nodes(op="placeholder")}
        return sorted({name for names in self.effects.written.values() for name in names} & inputs)


# -- capture -----------------------------------------------------------------------------------
class _LeafTracer(fx.Tracer):
    """An fx tracer with user-chosen leaves that remembers the innermost module it failed in."""

    def __init__(self, leaf_types: tuple[type, ...], module_level: bool) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.module_level = module_level
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types):
            return True
        if self.module_level:
            return not any(True for _ in m.children()) or super().is_leaf_module(m, module_qualified_name)
        return False

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = (self.path_of_module(m), type(m).__qualname__)
            raise


def example_nones(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``forward``'s named parameters that the example leaves ``None`` (given so, or by default).

    fx traces every parameter as a proxy, and a proxy is never ``None``: ``if mask is None:`` would
    take the branch of a given mask, silently. Traced with these as ``None``, the graph follows the
    example's branches, as an export does. Other values stay proxies: arithmetic on a number is
    traced for any number, and a branch on one (``if flag:``) fails the trace loudly.
    """
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}  # the example call's own check names the mismatch
    bound.apply_defaults()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {name: None for name, value in bound.arguments.items()
            if signature.parameters[name].kind not in variadic and value is None}


def _keep_none_placeholders(graph: fx.Graph, nones: Mapping[str, Any]) -> None:
    """Undo what ``concrete_args`` does to the signature: fx names each such placeholder
    ``<name>_1`` (a call by keyword would no longer bind) and asserts its value in the graph,
    where a stage on another device would run the assertion. The names are put back and the
    assertions removed: the placed model checks these values before a call
    (:class:`torchplace.batchdim.CallSizes`)."""
    for node in list(graph.find_nodes(op="placeholder")):
        name = str(node.target).removesuffix("_1")
        if name not in nones or str(node.target) != f"{name}_1":
            continue
        chain, frontier = set(), list(node.users)  # the assertion (``_assert_is_none``) and any user of it
        while frontier:
            user = frontier.pop()
            if user not in chain:
                chain.add(user)
                frontier.extend(user.users)
        for user in reversed([n for n in graph.nodes if n in chain]):
            graph.erase_node(user)
        node.target = name


_IN_PLACE = {f"__i{name}__": getattr(operator, f"i{name}") for name in
             ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or",
              "xor")}
"""Python's in-place operators by special method: ``a += b`` calls ``a.__iadd__(b)``."""


@contextlib.contextmanager
def _in_place_operators() -> Iterator[None]:
    """``fx.Proxy`` with in-place operators that record themselves (``operator.iadd``).

    A proxy has none, so Python runs ``a += b`` as ``a = a + b``: the graph lost a write through a
    view (``v = h[:, :4]; v += 1``) or into a model input, and under autocast a bfloat16 tensor that
    ``+=`` keeps in bfloat16 became float32 (found by fuzzing). ``operator.iadd`` on tensors writes
    in place, as eager does (:mod:`torchplace.profiling.effects` then sees the write), and on
    numbers returns the new number.
    """
    saved = {name: fx.Proxy.__dict__.get(name) for name in _IN_PLACE}

    def recording(op: Callable[[Any, Any], Any]) -> Callable[[fx.Proxy, Any], fx.Proxy]:
        return lambda self, other: self.tracer.create_proxy("call_function", op, (self, other), {})

    for name, op in _IN_PLACE.items():
        setattr(fx.Proxy, name, recording(op))
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                delattr(fx.Proxy, name)
            else:
                setattr(fx.Proxy, name, old)


@contextlib.contextmanager
def _noting_autocast() -> Iterator[list[Any]]:
    """A list that gets each ``torch.autocast`` region entered within (fx runs a ``with`` block at
    trace time and records nothing of it: the region's operators would run in full precision)."""
    entered: list[Any] = []
    autocast = torch.amp.autocast_mode.autocast
    enter = autocast.__enter__

    def noting(self: Any) -> Any:
        entered.append(self)
        return enter(self)

    autocast.__enter__ = noting  # type: ignore[method-assign]
    try:
        yield entered
    finally:
        autocast.__enter__ = enter  # type: ignore[method-assign]


def _fx_capture(model: nn.Module, leaf_types: tuple[type, ...], module_level: bool,
                nones: Mapping[str, Any]) -> fx.GraphModule:
    """``symbolic_trace`` with :class:`_LeafTracer` and ``nones`` (:func:`example_nones`) as
    concrete arguments; failures re-raised as :class:`_CaptureFailure`.

    Symbolic tracing runs the model's Python code once, and an in-place update of a parameter or
    buffer (``self.n += 1``) then happens on the real tensor, at trace time, and never again: the
    graph would silently lose it. Such a trace is undone and reported as a failure, so ``"auto"``
    falls back to export, which records the update in the graph.
    """
    tracer = _LeafTracer(leaf_types, module_level)
    snapshot = StateSnapshot(model)
    try:
        with _noting_autocast() as entered, _in_place_operators():
            graph = tracer.trace(model, concrete_args=dict(nones) or None)
        if entered:
            raise RuntimeError("the forward enters torch.autocast, which fx does not record (export does)")
        _keep_none_placeholders(graph, nones)
    except Exception as e:
        snapshot.restore()
        _refuse_registering(model, snapshot.registered)
        path, cls = tracer.failed_in or ("", type(model).__qualname__)
        raise _CaptureFailure("fx", path, cls, e) from e
    if written := snapshot.changed():
        snapshot.restore()
        _refuse_registering(model, snapshot.registered)
        error = RuntimeError(f"tracing wrote {', '.join(repr(n) for n in written)} in place; fx would run that "
                             "update once at trace time, not on every call (export records it)")
        raise _CaptureFailure("fx", "", type(model).__qualname__, error)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _at_least_two(value: Any) -> Any:
    """Tensor leaves with a batch (dim 0) of one, repeated to two along dim 0; others unchanged."""

    def widen(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == 1:
            return torch.cat([leaf, leaf])
        return leaf

    return pytree.tree_map(widen, value)


def _export_capture(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    dims: Any = None) -> fx.GraphModule:
    """``torch.export`` (non-strict, dynamic batch dim and ``dims``, :mod:`.dynamic`) then
    ``.module()``; failures as _CaptureFailure.

    Without a dynamic batch dimension the exported graph bakes the example batch size into its
    reshapes and guards, and fails on every other batch size, micro-batches included. export
    specializes a dimension of size 1, so a batch of one (single-stream latency) is exported as a
    batch of two copies; the graph then runs on one sample as well.
    """
    check_exportable(model, tuple(args), kwargs, dims)
    args, kwargs = _at_least_two(tuple(args)), _at_least_two(dict(kwargs))
    # a view's base and strides become guards (`x._base.size()`, `x.stride()[0] == 8`) that every other
    # tensor fails, the recording run's copies included: export on dense copies
    def dense(t: torch.Tensor) -> torch.Tensor:
        return t if t._base is None and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)

    args, kwargs = pytree.tree_map_only(torch.Tensor, dense, (args, kwargs))
    snapshot = StateSnapshot(model)
    failure: _CaptureFailure | None = None
    try:
        with _without_partial_graph():
            ep = torch.export.export(model, args, kwargs=kwargs or None,
                                     dynamic_shapes=dynamic_shapes(model, args, kwargs, dims), strict=False)
        gm = ep.module()
    except Exception as e:
        failure = _CaptureFailure("export", "", type(model).__qualname__, e)
    finally:  # Ctrl-C too
        snapshot.restore()
    _refuse_registering(model, snapshot.registered)  # export wrote such a buffer into an input instead
    if failure is not None:
        raise failure from failure.error
    return gm


def _refuse_registering(model: nn.Module, registered: Sequence[str]) -> None:
    """Refuse a forward that registered parameters or buffers while it was traced (``registered``,
    as :attr:`StateSnapshot.registered` names them): no graph holds state its forward creates (fx
    would keep a Proxy in the slot; torch.export recorded a new buffer as a write into an input).

    Raises:
        TraceError: naming the first one and what to do instead.
    """
    if registered:
        raise TraceError(
            f"{type(model).__qualname__}'s forward registers {registered[0]!r} (register_buffer, register_parameter "
            "or a new nn.Parameter attribute), which no traced graph can hold: torchplace traces the forward and "
            "runs the graph. Register it once in __init__ (a buffer with persistent=False for a cache) and update it "
            "in place in forward, or compute it as a local tensor; if the forward registers it only on its first "
            "call, call the model once before placing it")


@contextlib.contextmanager
def _without_partial_graph() -> Iterator[None]:
    """Pass on what is written to ``sys.stderr`` inside, but for the partial graph a failed
    ``torch.export`` prints there before it raises (``partial_fx_graph``, once per nested export
    call; hundreds of lines for a transformer): the failure is reported as a :class:`TraceError`
    that names the module and the fix, and tracing tries export more than once while it looks for
    the failing module."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except Exception as error:
        partial = getattr(error, "partial_fx_graph", None)
        sys.stderr.write(buffer.getvalue().replace(f"{partial}\n", "") if partial is not None else buffer.getvalue())
        raise
    sys.stderr.write(buffer.getvalue())


def _import_torch_internals() -> None:
    """Import what ``torch.export`` and an fx ``Interpreter`` import on their first call (2 s and 900
    modules: ``torch._dynamo``, ``torch._inductor``, ``sympy``) with Ctrl-C held until they are in
    (:func:`~torchplace.interrupts.held_interrupt`): an import cut short leaves them half initialised,
    and every later trace in the process fails (``partially initialized module 'torch._dynamo'``)."""
    with held_interrupt():
        import torch._dynamo  # noqa: F401
        import torch._functorch.aot_autograd  # noqa: F401
        import torch._inductor  # noqa: F401
        import torch.export._trace  # noqa: F401


class _CaptureFailure(Exception):
    """One capture method failed, inside module ``path`` of class ``cls``."""

    def __init__(self, method: str, path: str, cls: str, error: Exception) -> None:
        first_line = (str(error).strip().splitlines() or [""])[0]
        super().__init__(f"{method} failed in {path or '<root>'} ({cls}): {type(error).__name__}: {first_line}")
        self.method, self.path, self.cls, self.error = method, path, cls, error


def _returns_a_cache(failures: list[_CaptureFailure]) -> str | None:
    """The class name of a key-value cache object export found in the model's output, if any
    (transformers models return ``past_key_values`` by default: ``use_cache=True``)."""
    for f in failures:
        found = re.search(r"Found <class '([\w.]*Cache)'> in output", str(f.error))
        if f.method == "export" and found:
            return found.group(1).rsplit(".", 1)[-1]
    return None


def _sizes_fixed(failures: list[_CaptureFailure]) -> list[str]:
    """torch.export's reasons where it refused dims asked dynamic because the model's code fixed
    them (``Constraints violated``: "You marked L as dynamic but your code specialized it to be a
    constant (8)"), one per dim; empty for any other failure."""
    for f in failures:
        text = str(f.error)
        if f.method == "export" and "Constraints violated" in text:
            return [line.strip()[2:].split(". If you're using")[0] for line in text.splitlines()
                    if line.strip().startswith("- ")]
    return []


def _undeclared_partners(fixed: Sequence[str], model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                         dims: Any) -> str:
    """Advice for dims asked dynamic that export fixed to the example's size (``fixed``:
    :func:`_sizes_fixed`'s reasons) where another input of that size at that dim is not declared:
    the model most likely needs them equal (an attention mask as long as its input ids), and the
    undeclared one fixes both. The ``dynamic_dims`` with them declared too, or ``""``."""
    if not isinstance(dims, Mapping):
        return ""
    bound = dynamic_inputs(model, args, kwargs)
    wanted = {name: set(d) for name, d in dims.items()}
    for reason in fixed:
        found = re.search(r"L\['(\w+)'\]\.size\(\)\[(\d+)\].*constant \((\d+)\)", reason)
        if not found:
            continue
        name, dim, size = found.group(1), int(found.group(2)), int(found.group(3))
        for other, value in bound.items():
            tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            if other != name and dim not in wanted.get(other, set()) and tensors and all(
                    t.dim() > dim and t.shape[dim] == size for t in tensors):
                wanted.setdefault(other, set()).add(dim)
    if wanted == {name: set(d) for name, d in dims.items()}:
        return ""
    declared = ", ".join(f"{name!r}: {sorted(d)}" for name, d in wanted.items())
    return (f"If they must equal the same dims of inputs not declared dynamic (an attention mask as long as its "
            f"input ids), declare those too: dynamic_dims={{{declared}}}. Otherwise: ")


def _trace_error(model: nn.Module, failures: list[_CaptureFailure], var_keywords: Sequence[str] = (),
                 partners: str = "") -> TraceError:
    """A :class:`TraceError` naming the failing module, the errors, and what to try
    (``var_keywords``: the example's keywords ``forward`` takes through ``**kwargs``; ``partners``:
    :func:`_undeclared_partners`' advice for dims export fixed)."""
    cache = _returns_a_cache(failures)
    if cache is not None:
        return TraceError(
            f"{type(model).__qualname__} returns a {cache} (its key-value cache: use_cache=True), which a placed "
            f"model cannot return; pass example_kwargs={{'use_cache': False}} and call the placed model with "
            f"use_cache=False, or build the model with use_cache=False (from_pretrained(..., use_cache=False); "
            f"setting model.config.use_cache afterwards misses the copies of the config that submodules keep, "
            f"as T5's decoder does)"
        )
    fixed = _sizes_fixed(failures)
    if fixed:
        causes = ("a weight of that size (x + self.pos with pos of the example's length), a branch on the size, or a "
                  "Python number computed from it (math.sqrt(x.shape[1]), x.shape[1] % 2) fixes a size. Leave that "
                  "dim out of dynamic_dims (a placed model then serves the example's size only), compute with the "
                  "size as a tensor or a torch.sym_* function, or try trace_method='fx'")
        return TraceError(
            f"could not trace {type(model).__qualname__} with the dims dynamic_dims asks dynamic: the model's code "
            f"fixes them ({'; '.join(fixed)}). " + (partners + causes if partners else causes[0].upper() + causes[1:])
        )
    first = failures[0]
    where = f"module '{first.path}' ({first.cls})" if first.path else f"{first.cls} itself"
    hints = [f"pass leaf_modules=({first.cls},) to keep that module whole"] if first.path else []
    if var_keywords and any("tree_name" in str(f) for f in failures):
        hints.insert(0, f"torch.export cannot give keywords that forward takes through **kwargs "
                        f"({', '.join(map(repr, var_keywords))}) their dynamic batch: leave them out of "
                        "example_kwargs and set them in the model instead (a Hugging Face model's config, e.g. "
                        "config.output_hidden_states = True), or make them named parameters of forward")
    if all(f.method != "export" for f in failures):
        hints.append("use trace_method='export'")
    hints.append("for Hugging Face models, pass example_kwargs={'use_cache': False}")
    hints.append("data-dependent Python control flow (`if x.sum() > 0:`) must sit inside a leaf module")
    tried = "; ".join(str(f) for f in failures)
    return TraceError(
        f"could not trace {type(model).__qualname__}: it fails in {where}. {tried}. "
        f"Try: {'; '.join(hints)}."
    )


def _capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any],
    method: str,
    leaf_types: tuple[type, ...],
    module_level: bool,
    dims: Any = None,
) -> tuple[fx.GraphModule, str]:
    """Run the requested capture method(s); return the module and the method used."""
    order = ("fx", "export") if method == "auto" else (method,)
    failures: list[_CaptureFailure] = []
    for m in order:
        try:
            if m == "fx":
                nones = example_nones(model, example_inputs, example_kwargs)
                return _fx_capture(model, leaf_types, module_level, nones), "fx"
            return _export_capture(model, example_inputs, example_kwargs, dims), "export"
        except _CaptureFailure as f:
            failures.append(f)
    fixed = _sizes_fixed(failures)
    partners = _undeclared_partners(fixed, model, example_inputs, example_kwargs, dims) if fixed else ""
    raise _trace_error(model, failures, _through_var_keyword(model, example_kwargs), partners) from failures[-1].error


def _forward_parameters(model: nn.Module) -> Mapping[str, inspect.Parameter]:
    """The parameters of ``model.forward``'s signature (none where Python cannot read it)."""
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _takes_var_keyword(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``**kwargs``."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _forward_parameters(model).values())


def _defaults(model: nn.Module) -> dict[str, Any]:
    """The default of each argument of ``model.forward`` that has one, by name."""
    return {name: p.default for name, p in _forward_parameters(model).items()
            if p.default is not inspect.Parameter.empty}


def _through_var_keyword(model: nn.Module, example_kwargs: Mapping[str, Any]) -> list[str]:
    """The example's keywords that ``model.forward`` takes through ``**kwargs``."""
    if not _takes_var_keyword(model):
        return []
    parameters = _forward_parameters(model)
    return [k for k in example_kwargs if k not in parameters]


# -- shapes and in-place writes ------------------------------------------------------------------
class _Recorder(Interpreter):
    """Runs the graph once: a :class:`TensorInfo` in each node's ``meta["torchplace"]`` (which
    nodes make Python numbers too: an fx graph has no ``meta["val"]`` that would say so), and what
    each node reads and writes in an :class:`AccessLog`."""

    def __init__(self, gm: fx.GraphModule, log: AccessLog, shapes: bool = True) -> None:
        super().__init__(gm)
        self.log, self.shapes = log, shapes

    def run_node(self, n: fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            module = self.module.get_submodule(str(n.target)) if n.op == "call_module" else None
            token = self.log.before(n, args, kwargs, module) if is_compute(n) else None
            counted = LiveBytes() if self.shapes and is_compute(n) else contextlib.nullcontext()
            with counted:
                out = getattr(self, n.op)(n.target, args, kwargs)
        if n.op == "placeholder":
            self.log.placeholder(n, out)
        elif n.op == "get_attr":
            self.log.constant(n, out)
        elif token is not None:
            self.log.after(n, token, out)
        if not self.shapes:
            return out
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        fresh, alias = self._fresh(n, tensors)
        n.meta["torchplace"] = TensorInfo(
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
            output_bytes=tensor_bytes(tensors),
            fresh_bytes=fresh,
            alias_of=alias,
            scratch_bytes=max(counted.peak - counted.live, 0) if isinstance(counted, LiveBytes) else 0,
            number=is_python_number(out),
        )
        return out

    def _fresh(self, n: fx.Node, tensors: list[torch.Tensor]) -> tuple[int, str | None]:
        """Bytes of the output tensors whose memory is new (not a view of an input's, nor of an
        earlier output's), and the input node whose memory the first output shares, if any."""
        owner: dict[int, str] = {}
        for a in n.all_input_nodes:
            for t in pytree.tree_leaves(self.env.get(a)):
                if isinstance(t, torch.Tensor) and (key := _storage_id(t)) is not None:
                    owner.setdefault(key, a.name)
        fresh, seen = 0, set(owner)
        for t in tensors:  # new memory is counted by its storage: an expand() of it is no bigger
            key = _storage_id(t)
            if key is None or key not in seen:
                fresh += _storage_bytes(t)
                seen.add(key)
        first = _storage_id(tensors[0]) if tensors else None
        return fresh, owner.get(first) if first is not None else None


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory ``t`` lives in (its own bytes for tensors without a plain storage)."""
    try:
        return int(t.untyped_storage().nbytes()) if t.layout == torch.strided else tensor_bytes(t)
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def _storage_id(t: torch.Tensor) -> int | None:
    """Identity of the memory a tensor's values live in (its storage object; views share it)."""
    if t.layout != torch.strided:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def _meta_failure(model: nn.Module, error: Exception) -> TraceError:
    """The :class:`TraceError` for a traced graph of a meta-device model that fails on meta inputs
    (inputs it rejects: a meta model is never run eagerly to check them); a tensor the forward made
    on another device (a constant, ``torch.arange(n)`` without ``device=``) gets the fix for it."""
    first = (str(error).strip().splitlines() or [""])[0]
    advice = ("a tensor its forward makes without device= (torch.arange(n), torch.tensor(...), torch.ones(...)) is "
              "on the CPU, where the model's weights and inputs are on the meta device: make it on the input's "
              "device (device=x.device), or plan the model with its weights loaded"
              if "device" in first else "this is the model's own error on the example, run on shapes alone: pass "
              "example inputs the model accepts (their shapes and dtypes), or plan the model with its weights loaded")
    return TraceError(f"the traced graph of {type(model).__qualname__} fails on the meta device "
                      f"({type(error).__name__}: {first}): {advice}")


def _record(gm: fx.GraphModule, model: nn.Module, example_inputs: Sequence[Any],
            example_kwargs: Mapping[str, Any]) -> Effects:
    """Shape propagation and the in-place analysis on real runs (no grad) of copies of the
    inputs; the model's parameters and buffers are restored afterwards.

    The analysis runs at the example batch, at a batch of one, and with each other dynamic size
    (``dynamic_dims``) cut to one, and keeps the union: PyTorch decides some aliasing from strides
    (``h.t().contiguous()`` is a copy, but an alias of ``h`` when a dimension has size one), and
    strides with a size of one differ from those of any larger size, while all larger sizes agree."""
    inputs = flat_inputs(gm, example_inputs, example_kwargs, copy=True)
    snapshot = StateSnapshot(model)
    runs = [(inputs, True)]
    single = pytree.tree_map_only(torch.Tensor, lambda t: t[:1] if t.dim() > 0 and t.shape[0] > 1 else t, inputs)
    if any(a is not b for a, b in zip(pytree.tree_leaves(single), pytree.tree_leaves(inputs))):
        runs.append((single, False))
    for cut in _sizes_of_one(gm, inputs):  # a sequence of one token, say
        runs.append((tuple(t.narrow(cut[i], 0, 1).clone() if i in cut else t for i, t in enumerate(inputs)), False))
    effects = []
    try:
        for values, shapes in runs:
            log = AccessLog(named_state(gm))
            try:
                with torch.no_grad():
                    _Recorder(gm, log, shapes).run(*values)
            except Exception as e:
                if shapes and on_meta_device(gm):
                    raise _meta_failure(model, e) from e
                if shapes:
                    raise
                continue  # the model does not run on one sample: no call of it can have one
            finally:
                snapshot.restore()
            effects.append(analyse(gm.graph, log))
    finally:
        snapshot.restore()
    return union(effects)


def _sizes_of_one(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[dict[int, int]]:
    """The calls, besides the batch of one, whose strides the in-place analysis must also see:
    ``{placeholder position: dim}`` cut to size one. An exported graph runs at any size of its
    dynamic dims (each symbol's dims together); an fx graph has no guards and runs at any size of
    any dim (each dim of each input alone; a dim the weights fix fails there and is skipped)."""
    position = {n.name: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    if any("val" in n.meta for n in gm.graph.find_nodes(op="placeholder")):
        return [{position[name]: dim for name, dim in where} for where in symbolic_sizes(gm)[1].values()]
    return [{i: dim} for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)
            for dim in range(1, t.dim()) if t.shape[dim] > 1]


def trace(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    granularity: str = "operator",
    leaf_modules: Iterable[type] = (),
    method: str = "auto",
    training: bool = False,
    dynamic_dims: DynamicDims = None,
) -> Traced:
    """Trace ``model`` into a GraphModule and an :class:`OpGraph` with sizes (no times yet).

    Args:
        model: the module, in the mode it will run in (eval for inference).
        example_inputs: positional arguments of ``model``.
        example_kwargs: keyword arguments of ``model`` (e.g. ``attention_mask``).
        granularity: ``"operator"``: one node per op, except that ``leaf_modules`` instances stay
            whole; ``"module"``: one node per leaf module, where leaves are ``leaf_modules``
            instances and modules with no children (with fx also fx's standard ``torch.nn``
            leaves). Ops outside every leaf are their own nodes.
        leaf_modules: module classes never traced into.
        method: ``"fx"``, ``"export"`` or ``"auto"`` (fx, falling back to export).
        training: the graph will be trained: the accessors of memory written in place become one
            node each (a stage boundary is an autograd leaf, which an in-place op may not write).
        dynamic_dims: input dimensions besides the batch that may change between calls
            (``{"input_ids": [1]}`` or ``"auto"``; :mod:`torchplace.profiling.dynamic`). fx graphs
            hold no sizes; an exported graph gets them as dynamic dimensions.

    Returns:
        A :class:`Traced`; each fx node's :class:`TensorInfo` is in ``node.meta["torchplace"]``.

    Raises:
        UsageError: for an unknown ``granularity`` or ``method``.
        TraceError: if no method can capture the model; names the failing module and what to try.

    Example:
        >>> from torchplace.models import build
        >>> model, inputs = build("mlp")
        >>> len(trace(model, inputs).graph) > 0
        True
    """
    if granularity not in _GRANULARITIES:
        raise UsageError(f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
    if method not in _METHODS:
        raise UsageError(f"trace method must be one of {_METHODS}, got {method!r}")
    leaf_types, module_level = tuple(leaf_modules), granularity == "module"
    kwargs = dict(example_kwargs or {})
    _import_torch_internals()
    dims = check_dynamic_dims(dynamic_dims, model, tuple(example_inputs), kwargs)
    gm, used = _capture(model, tuple(example_inputs), kwargs, method, leaf_types, module_level, dims)
    gm.meta["var_keyword"] = _takes_var_keyword(model)  # what bind_call says of a keyword the graph lacks
    gm.meta["defaults"] = _defaults(model)  # what bind_call gives an argument a call leaves out
    gm.meta["model_name"] = type(model).__name__
    effects = _record(gm, model, example_inputs, kwargs)
    # strides are the tracing device's: a stage placed elsewhere may get others
    relax_views(gm, keep=frozenset().union(*effects.written.values()))
    grouping = replace(effects, merged=effects.merged + effects.colocated, colocated=()) if training else effects
    graph = build_opgraph(gm, model, leaf_types=leaf_types, module_level=module_level, method=used, effects=grouping)
    return Traced(gm=gm, graph=graph, method=used, effects=effects, model=model, granularity=granularity,
                  leaf_types=leaf_types, dynamic_dims=dynamic_dims)
