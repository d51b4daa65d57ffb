"""Tensor parallelism of pipeline stages: Megatron-LM's MLP split, by ``torch.distributed.tensor.parallel``.

A stage with tensor-parallel degree ``t`` runs on ``t`` ranks that hold slices of its weights
(Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, Sec. 3, Fig. 3a): in a pair of linear
layers ``A`` then ``B`` with only elementwise operators between them (``relu``, ``tanh``, ``gelu``,
...), ``A`` is split by its output features (``ColwiseParallel``) and ``B`` by its input features
(``RowwiseParallel``), so each rank computes its slice of the hidden activation without
communication and one all-reduce after ``B`` gives every rank the whole output. Everything else in
the stage runs replicated: every rank of the stage computes it alike, on alike inputs.

:func:`linear_pairs` finds the pairs in a stage's graph; :func:`shard_stage` applies
``parallelize_module`` to them. The pairs must be ``nn.Linear`` modules the graph calls as
modules (place with ``leaf_modules=[nn.Linear]``: the default trace calls ``F.linear`` on the
weights, where the module hooks that ``ColwiseParallel`` installs never run), each called once in
the whole model, with out-features divisible by ``t``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from torchplace.errors import UnsupportedError

__all__ = ["linear_pairs", "shard_stage"]

_ELEMENTWISE_FUNCTIONS = {torch.relu, torch.tanh, torch.sigmoid, nn.functional.relu, nn.functional.gelu,
                          nn.functional.silu, nn.functional.tanh, nn.functional.sigmoid}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid)


def _linear(gm: fx.GraphModule, node: fx.Node) -> nn.Linear | None:
    if node.op != "call_module":
        return None
    module = gm.get_submodule(str(node.target))
    return module if type(module) is nn.Linear else None


def _elementwise(gm: fx.GraphModule, node: fx.Node, source: fx.Node) -> bool:
    """``node`` applies an elementwise operator to ``source`` alone."""
    if node.args != (source,) or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return False
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), _ELEMENTWISE_MODULES)


def linear_pairs(gm: fx.GraphModule, tensor: int, calls: Counter[str] | None = None) -> list[tuple[str, str]]:
    """The ``(A, B)`` module paths of ``gm`` to split (module docs), in graph order.

    Args:
        gm: a stage's graph module.
        tensor: the tensor-parallel degree; ``A``'s out-features must divide by it.
        calls: how often each module path is called in the whole model (default: in ``gm``); a
            module called more than once is not split.
    """
    calls = calls if calls is not None else Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    pairs: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        first = _linear(gm, node)
        if first is None or calls[str(node.target)] != 1 or first.out_features % tensor:
            continue
        current = node
        while len(current.users) == 1:
            (user,) = current.users
            if _linear(gm, user) is not None:
                if user.args == (current,) and calls[str(user.target)] == 1 and not any(
                        str(user.target) in p or str(node.target) in p for p in pairs):
                    pairs.append((str(node.target), str(user.target)))
                break
            if not _elementwise(gm, user, current):
                break
            current = user
    return pairs


def shard_stage(gm: fx.GraphModule, pairs: Sequence[tuple[str, str]], mesh: Any) -> None:
    """Split each pair of ``gm`` over the ranks of the 1-D device ``mesh`` (their weights become
    ``DTensor`` parameters holding this rank's slice)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for a, b in pairs:
        plan[a], plan[b] = ColwiseParallel(), RowwiseParallel()
    if plan:
        parallelize_module(gm, mesh, plan)


def refuse_unsplit(stage: int, pieces: Sequence[fx.GraphModule], tensor: int) -> None:
    """Refuse a stage with tensor parallelism that has no pair to split (its ``t`` ranks would
    only repeat each other's work).

    Raises:
        UnsupportedError: naming the stage and the way out.
    """
    linears = sum(_linear(p, n) is not None for p in pieces for n in p.graph.nodes)
    raise UnsupportedError(
        f"engine stage {stage} has tensor_parallel={tensor} but no pair of nn.Linear modules to split (Linear -> "
        f"elementwise ops -> Linear, out-features divisible by {tensor}; it calls {linears} Linear module(s)): place "
        "with leaf_modules=[torch.nn.Linear] so that the graph calls the Linear modules, or plan this stage with "
        "tensor_parallel=1")
