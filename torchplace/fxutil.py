"""Small fx helpers shared by profiling (tracing, timing, estimates) and the runtime (splitting)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["COMPUTE_OPS", "TensorInfo", "fetch_attr", "flat_inputs", "is_compute", "tensor_bytes"]

COMPUTE_OPS = frozenset({"call_function", "call_method", "call_module"})
"""fx node ops that become OpGraph nodes and that a plan assigns to stages."""


@dataclass(frozen=True)
class TensorInfo:
    """Shapes and sizes of one fx node's outputs, stored in ``node.meta["torchplace"]``.

    Attributes:
        shapes: shape of each output tensor (pytree leaves of the output, in order).
        dtypes: dtype name of each output tensor.
        output_bytes: sum of ``numel * element_size`` over the output tensors.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    output_bytes: int


def flat_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Arguments for :meth:`torch.fx.Interpreter.run` on ``gm``: one value per placeholder.

    An exported module flattens ``(args, kwargs)`` into its placeholders; an fx module takes the
    positional arguments as they are.
    """
    if getattr(gm, "_in_spec", None) is not None:
        return tuple(pytree.tree_leaves((tuple(example_inputs), {})))
    return tuple(example_inputs)


def is_compute(node: fx.Node) -> bool:
    """Whether an fx node becomes (part of) an OpGraph node and is placed in a stage."""
    return node.op in COMPUTE_OPS


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
