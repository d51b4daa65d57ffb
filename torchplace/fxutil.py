"""Small fx helpers shared by profiling (tracing, timing, estimates) and the runtime (splitting)."""
from __future__ import annotations

import inspect
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from torchplace.errors import UsageError

__all__ = [
    "dtype_guards",
    "COMPUTE_OPS",
    "TensorInfo",
    "bind_placeholders",
    "draws_random_numbers",
    "fetch_attr",
    "flat_inputs",
    "run_graph",
    "is_compute",
    "is_python_number",
    "left_out",
    "on_meta_device",
    "pin_arguments",
    "pin_devices",
    "relax_views",
    "tensor_bytes",
]

COMPUTE_OPS = frozenset({"call_function", "call_method", "call_module"})
"""fx node ops that become OpGraph nodes and that a plan assigns to stages."""


@dataclass(frozen=True)
class TensorInfo:
    """Shapes and sizes of one fx node's outputs, stored in ``node.meta["torchplace"]``.

    Attributes:
        shapes: shape of each output tensor (pytree leaves of the output, in order).
        dtypes: dtype name of each output tensor.
        output_bytes: sum of ``numel * element_size`` over the output tensors.
        fresh_bytes: the part of ``output_bytes`` in new memory: not a view of an input (``None``:
            not known, take ``output_bytes``).
        alias_of: the input node whose memory the first output shares (a view), if any.
        scratch_bytes: the most bytes the node held beyond its new outputs while it ran: tensors
            its kernels made and freed before returning (``max_pool2d``'s int64 indices, twice
            its output; a leaf module's own activations), measured by
            :class:`~torchplace.profiling.livebytes.LiveBytes` (memory a kernel never makes into a
            tensor, oneDNN's workspaces, is not seen).
        number: the output is a Python number (``int``, ``float``, ``bool``: a size read with
            ``x.shape[0]``) or a sequence of them (``x.shape``, a ``torch.Size``), not a tensor.
            ``torch.distributed.pipelining`` sends only tensors between stages, and an fx graph,
            unlike an exported one, holds no symbolic sizes from which the reading stage could
            compute such a number (its value here is the traced call's, not a later call's): a
            plan for the engine keeps its producer and its readers on one device
            (:func:`torchplace.api.keep_unsendable_together`).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    output_bytes: int
    fresh_bytes: int | None = None
    alias_of: str | None = None
    scratch_bytes: int = 0
    number: bool = False

    @property
    def new_bytes(self) -> int:
        """:attr:`fresh_bytes`, or :attr:`output_bytes` where not known."""
        return self.output_bytes if self.fresh_bytes is None else self.fresh_bytes


def is_python_number(value: Any) -> bool:
    """Whether ``value`` is what :attr:`TensorInfo.number` records: a Python ``int``, ``float`` or
    ``bool``, or a non-empty tuple or list of them, or a ``torch.Size`` (an empty one too: a 0-dim
    tensor's shape)."""
    if isinstance(value, (int, float, bool)):
        return True
    return isinstance(value, torch.Size) or (isinstance(value, (tuple, list)) and bool(value)
                                             and all(isinstance(v, (int, float, bool)) for v in value))


def bind_placeholders(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{placeholder name: value}`` for a call ``gm(*args, **kwargs)``, as ``gm`` would bind it.

    Exported modules flatten ``(args, kwargs)`` with their pytree input spec; fx modules bind by
    the signature of their generated ``forward``.

    Raises:
        TypeError: if the arguments do not match the signature.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound = inspect.signature(gm.forward).bind(*args, **dict(kwargs or {}))
    bound.apply_defaults()
    values = bound.arguments
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen):
        flat = _flatten_pytree_inputs(codegen, values)
        return {n.name: v for n, v in zip(placeholders, flat)}
    return {n.name: _placeholder_value(n, values) for n in placeholders}


def bind_call(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`bind_placeholders` for a user's call of a placed model. An argument of the traced
    signature the call leaves out gets the model's default (``gm.meta["defaults"]``, recorded at
    trace time): the example gave it, so the graph takes it, and the model called without it would
    use its default; a default the trace kept as a constant is then checked as any value.

    Raises:
        UsageError: if the arguments do not match the signature (naming it).
    """
    meta = getattr(gm, "meta", {})
    try:
        return bind_placeholders(gm, args, {**(kwargs or {}), **left_out(gm, args, kwargs)})
    except TypeError as e:
        hint = ""
        if "unexpected keyword" in str(e):
            hint = ("; it takes the arguments its example gave when it was placed, and was traced with the others at "
                    "their defaults: leave the argument out, or place the model with it in example_kwargs")
            if meta.get("var_keyword"):  # export takes no keyword through **kwargs
                hint += (" (if the model's forward takes it through **kwargs, which a trace cannot take as an input, "
                         "set it on the model instead before placing: for a Hugging Face model, on its config, "
                         "e.g. model.config.output_hidden_states = True)")
        name = meta.get("model_name", type(gm).__name__)
        raise UsageError(f"the placed model is called as {name}{inspect.signature(gm.forward)}: {e}{hint}") from e


def left_out(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The arguments of the traced signature a call of a placed model leaves out, at the model's
    defaults (``gm.meta["defaults"]``), which :func:`bind_call` fills in.

    Raises:
        TypeError: if the arguments do not match the signature.
    """
    defaults = getattr(gm, "meta", {}).get("defaults")
    if not defaults:
        return {}
    signature = inspect.signature(gm.forward)
    given = signature.bind_partial(*args, **(kwargs or {})).arguments
    return {name: defaults[name] for name in signature.parameters if name not in given and name in defaults}


def _flatten_pytree_inputs(codegen: _PyTreeCodeGen, values: Mapping[str, Any]) -> list[Any]:
    """Flatten bound arguments with the exported in_spec, like the generated ``forward``."""
    info = codegen.pytree_info
    in_spec = info.in_spec
    names = [a for a in info.orig_args if a != "self"]
    if in_spec.type is tuple and in_spec.num_children == 2:
        kwargs_spec = in_spec.child(1) if hasattr(in_spec, "child") else in_spec.children_specs[1]
        keyword_names = set(kwargs_spec.context)
        positional = [values[a] for a in names if a not in keyword_names]
        keywords = {a: values[a] for a in names if a in keyword_names}
        return fx_pytree.tree_flatten_spec((positional, keywords), in_spec)
    return fx_pytree.tree_flatten_spec([values[a] for a in names], in_spec)


def _placeholder_value(node: fx.Node, values: Mapping[str, Any]) -> Any:
    """The value of one placeholder of a non-pytree graph from bound arguments."""
    target = str(node.target)
    if target.startswith("**"):
        return values[target[2:]]
    if target.startswith("*"):
        return values[target[1:]]
    if target in values:
        return values[target]
    if node.args:
        return node.args[0]
    raise TypeError(f"no value for model input {target!r}")


def flat_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                *, copy: bool = False) -> tuple[Any, ...]:
    """Arguments for :meth:`torch.fx.Interpreter.run` on ``gm``: one value per placeholder.

    With ``copy=True`` every tensor is a fresh copy, so a graph that writes its inputs in place
    leaves the caller's tensors alone.
    """
    values = tuple(bind_placeholders(gm, args, kwargs).values())
    if copy:
        values = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), values)
    return values


def symbolic_sizes(gm: fx.GraphModule) -> tuple[set[Any], dict[Any, list[tuple[str, int]]]]:
    """The shape symbols of ``gm``'s placeholders (an exported graph's dynamic sizes): those of a
    dim 0 (the batch), and for each other symbol the ``(placeholder name, dim)`` that have it."""
    import sympy

    batch: set[Any] = set()
    others: dict[Any, list[tuple[str, int]]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        example = node.meta.get("val")
        if not isinstance(example, torch.Tensor):
            continue
        for dim, size in enumerate(example.shape):
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            if dim == 0:
                batch.add(size.node.expr)
            else:
                others.setdefault(size.node.expr, []).append((node.name, dim))
    return batch, {s: where for s, where in others.items() if s not in batch}


class Interpreter(fx.Interpreter):
    """:class:`torch.fx.Interpreter` that also binds a ``**kwargs`` placeholder (an fx trace of
    ``forward(self, x, **kwargs)``) to its dict; fx's binds it like ``*args``, to a list."""

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith("**"):
            return next(self.args_iter)
        return super().placeholder(target, args, kwargs)


def run_graph(gm: fx.GraphModule, flat: Sequence[Any]) -> Any:
    """The output of ``gm`` run on ``flat`` (:func:`flat_inputs`: one value per placeholder) by an
    :class:`Interpreter`: ``gm.forward`` of an exported graph takes the model's own arguments
    (keywords included), not its placeholders."""
    return Interpreter(gm).run(*flat)


def is_compute(node: fx.Node) -> bool:
    """Whether an fx node becomes (part of) an OpGraph node and is placed in a stage."""
    return node.op in COMPUTE_OPS


def on_meta_device(module: nn.Module) -> bool:
    """Whether ``module``'s parameters and buffers are on the meta device (shapes without values: a
    model planned before its weights are loaded, or its traced graph); ``False`` for a module without any."""
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def fetch_attr(module: nn.Module, target: str) -> Any:
    """``module.a.b.c`` for the get_attr target ``"a.b.c"``."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor among the pytree leaves of ``value``."""
    return sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
    )


def pin_arguments(value: Any, device: torch.device) -> Any:
    """A node's arguments with every ``torch.device`` (and a ``device=`` keyword given as a string)
    replaced by ``device``: what :func:`pin_devices` does to a graph, for one call of one node."""

    def pin(v: Any) -> Any:
        return device if isinstance(v, torch.device) else v

    out = fx.node.map_aggregate(value, pin)
    if isinstance(out, dict) and isinstance(out.get("device"), str) and torch.device(out["device"]) != device:
        out = {**out, "device": device}
    return out


def pin_devices(gm: fx.GraphModule, device: torch.device) -> int:
    """Make every device constant in ``gm``'s graph ``device``; returns how many were changed.

    ``torch.export`` records the device a factory op or conversion ran on at trace time as a
    constant (``arange(n, device=x.device)`` becomes ``aten.arange(n, device=cpu)``; the same holds
    for ``full``, ``zeros``, ``to``, ``_assert_tensor_metadata`` ...), where the model computed it
    from its inputs. A graph moved to another device would then build those tensors on the old one
    and fail (or check the wrong device). torchplace decides where every operator runs, so a
    piece of graph placed on ``device`` computes all its values there: every ``torch.device`` in a
    node's arguments, and every ``device=`` keyword given as a string, becomes ``device``, and the
    constant tensors the graph reads (``get_attr`` of a plain tensor attribute, not a parameter or
    buffer: what fx makes of ``torch.zeros(3)`` in ``forward``) move there. Values are unchanged (a
    tensor's device does not change its numbers; transfers between pieces are the runtime's job).
    Recompiles ``gm`` when anything changed.
    """
    changed = 0
    state = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and id(value) not in state and value.device != device:
                setattr(module, name, value.to(device))
                changed += 1
            continue
        if node.op not in COMPUTE_OPS:
            continue
        args, kwargs = pin_arguments(node.args, device), dict(pin_arguments(node.kwargs, device))
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    if changed:
        gm.recompile()
    return changed


def relax_views(gm: fx.GraphModule, keep: Collection[str] = ()) -> int:
    """Turn ``view`` into ``reshape``, except in the nodes named in ``keep``; returns how many.

    A graph traced on one device fixes nothing about the strides its kernels return on another:
    the CPU's attention kernel gives a tensor that ``view`` accepts where CUDA's returns one whose
    ``view`` fails ("view size is not compatible with input tensor's size and stride", seen for
    ``nn.TransformerEncoderLayer`` traced on the CPU and run on an H100). ``reshape`` is ``view``
    wherever ``view`` succeeds (same values, same memory, bit for bit) and copies only where it
    would fail, so the one difference is that such a copy no longer shares memory with its input:
    a write through either would not reach the other. ``keep`` therefore names every value whose
    memory is written in place (the aliases in :attr:`~torchplace.profiling.effects.Effects.written`,
    found when the trace ran the graph). Recompiles ``gm`` when anything changed.
    """
    changed = 0
    for node in gm.graph.nodes:
        if node.name in keep:
            continue
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            changed += 1
        elif node.op == "call_method" and node.target == "view" and not _dtype_view(node):
            node.target = "reshape"
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _dtype_view(node: fx.Node) -> bool:
    """``x.view(torch.float16)``: a reinterpretation of the bytes, which ``reshape`` is not."""
    return len(node.args) == 2 and isinstance(node.args[1], torch.dtype) or isinstance(node.kwargs.get("dtype"), torch.dtype)


_RANDOM = frozenset({"dropout", "bernoulli", "rand", "randn", "randint", "randperm", "random", "normal", "multinomial",
                     "poisson", "exponential", "geometric", "cauchy", "uniform", "rrelu"})
"""Words of operator names that draw random numbers (``native_dropout``, ``randn_like``,
``normal_``, ``log_normal``; not ``normalize``)."""


def dtype_guards(gm: fx.GraphModule) -> list[str]:
    """The nodes of an exported graph that fix a dtype the model's code may take from autocast:
    checks of a tensor's dtype (``aten._assert_tensor_metadata``), where the model converted a tensor
    to the dtype it already had (``x.float()``, ``.to(torch.float32)``, ``type_as``), which export
    records as a check, not as a conversion, and whose later readers read the unconverted tensor;
    operators given a floating ``dtype`` (``torch.full(..., dtype=h.dtype)``, ``.to(h.dtype)``),
    which export records as the dtype it saw, where the model's code may read it from a tensor that
    autocast makes bfloat16; and operators given a float32 or float16 limit as a number
    (``masked_fill(mask, torch.finfo(h.dtype).min)``), which export records as the number it saw
    (a bfloat16 tensor cannot hold float32's: the placed call failed). Under ``torch.autocast`` such
    a graph does not compute what the model does there. The subgraphs of higher-order operators (a ``with torch.autocast(...)`` region in
    the forward is a ``wrap_with_autocast`` subgraph) are searched too, their nodes named ``path.node``."""
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    checks = () if target is None else (target, target.default)
    return [f"{path}.{n.name}" if path else n.name
            for path, module in gm.named_modules() if isinstance(module, fx.GraphModule)
            for n in module.graph.nodes
            if n.op == "call_function" and (n.target in checks or _fixes_floating_dtype(n) or _dtype_limit(n))]


_LIMITS = frozenset(getattr(torch.finfo(dtype), name) for dtype in (torch.float32, torch.float16)
                    for name in ("min", "max", "eps", "tiny"))


def _dtype_limit(n: fx.Node) -> bool:
    """Whether node ``n`` is given a float32 or float16 ``torch.finfo`` limit as a Python number."""
    return any(type(a) is float and a in _LIMITS for a in pytree.tree_leaves((n.args, n.kwargs)))


def _fixes_floating_dtype(n: fx.Node) -> bool:
    """Whether aten node ``n`` is given a floating-point ``dtype`` argument (by keyword or position)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dtype":
            value = n.args[i] if i < len(n.args) and not arg.kwarg_only else n.kwargs.get("dtype")
            return isinstance(value, torch.dtype) and value.is_floating_point
    return False


def draws_random_numbers(module: nn.Module, n: fx.Node) -> bool:
    """Whether fx node ``n`` of ``module`` (its GraphModule, or a stage of it) draws random numbers:
    a random operator (a dropout with ``p = 0`` or in eval mode, an attention with ``dropout_p =
    0`` do not), or a leaf module holding a dropout in training mode. What a leaf module's Python
    calls itself is not seen here (``torchplace.profiling.gradcheck`` runs the graph to see it)."""
    if n.op not in ("call_function", "call_method", "call_module"):
        return False
    if n.op == "call_module":
        sub = module.get_submodule(str(n.target))
        return any(_random_module(m) for m in sub.modules())
    name = str(getattr(n.target, "__name__", n.target)).lower()
    words = set(re.split(r"[^a-z]+", name))
    if "dropout" in words:
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", n.kwargs.get("training", True))
        return not (isinstance(p, (int, float)) and p == 0) and train is not False
    if "scaled_dot_product" in name or "attention" in words:
        p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return not words.isdisjoint(_RANDOM)


def _random_module(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    if "dropout" in name or "rrelu" in name:
        return bool(m.training and getattr(m, "p", getattr(m, "lower", 1.0)) != 0)
    return False
