"""How a GraphModule's inputs become named values and named values become its output.

The stages of a split model exchange values by fx node name. :class:`GraphIO` is the two ends of
that exchange: it binds the caller's ``(args, kwargs)`` to the graph's placeholder names and, given
the name -> value environment after the last stage, rebuilds the model's output pytree. Graphs
from ``torch.export.export(...).module()`` carry a ``_PyTreeCodeGen`` whose input spec flattens
nested arguments and whose output spec unflattens the result; both are honoured here.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.fx.graph import _PyTreeCodeGen
from torch.fx.node import map_arg

from torchplace.fxutil import fetch_attr

__all__ = ["GraphIO"]


class GraphIO:
    """The input binding and output assembly of one GraphModule.

    Calling the object with an environment ``{node name: value}`` returns the model's output, so
    it is the ``assemble_output`` argument of :class:`~torchplace.runtime.PipelineExecutor`.

    Attributes:
        placeholder_names: names of the graph's placeholder nodes, in graph order.
        output_names: names of the computed values (placeholders and compute nodes) the output
            reads, in graph order.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        """Record the signature, placeholders, output structure and codegen of ``gm``.

        Args:
            gm: the traced or exported model.
        """
        graph = gm.graph
        self._placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.placeholder_names: tuple[str, ...] = tuple(n.name for n in self._placeholders)
        output_node = graph.find_nodes(op="output")[0]
        self._structure = output_node.args[0]
        used = set(output_node.all_input_nodes)
        self.output_names: tuple[str, ...] = tuple(
            n.name for n in graph.nodes if n in used and n.op != "get_attr"
        )
        self._constants = {n.name: fetch_attr(gm, str(n.target)) for n in used if n.op == "get_attr"}
        codegen = graph._codegen
        self._pytree_info = codegen.pytree_info if isinstance(codegen, _PyTreeCodeGen) else None
        self._codegen = codegen
        self._signature = inspect.signature(gm.forward)

    def bind_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map the caller's arguments to placeholder names, as ``gm(*args, **kwargs)`` would.

        Args:
            args: positional arguments of the model call.
            kwargs: keyword arguments of the model call.

        Returns:
            ``{placeholder name: value}`` for every placeholder.

        Raises:
            TypeError: if the arguments do not match the model's signature.
        """
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        if self._pytree_info is not None:
            flat = self._flatten_pytree_inputs(values)
            return dict(zip(self.placeholder_names, flat))
        return {n.name: _placeholder_value(n, values) for n in self._placeholders}

    def _flatten_pytree_inputs(self, values: Mapping[str, Any]) -> list[Any]:
        """Flatten bound arguments with the exported in_spec, like the generated ``forward``."""
        info = self._pytree_info
        if info is None:
            raise TypeError("the graph has no pytree input spec")
        in_spec = info.in_spec
        names = [a for a in info.orig_args if a != "self"]
        if in_spec.type is tuple and in_spec.num_children == 2:
            kwargs_spec = in_spec.child(1) if hasattr(in_spec, "child") else in_spec.children_specs[1]
            keyword_names = set(kwargs_spec.context)
            positional = [values[a] for a in names if a not in keyword_names]
            keywords = {a: values[a] for a in names if a in keyword_names}
            return fx_pytree.tree_flatten_spec((positional, keywords), in_spec)
        return fx_pytree.tree_flatten_spec([values[a] for a in names], in_spec)

    def __call__(self, env: Mapping[str, Any]) -> Any:
        """Rebuild the model output from computed values.

        Args:
            env: ``{node name: value}`` holding at least :attr:`output_names`.

        Returns:
            The output exactly as the GraphModule would return it (pytree unflattened for
            exported graphs).

        Raises:
            KeyError: if a name in :attr:`output_names` is missing from ``env``.
        """
        values = {**self._constants, **env}
        flat = map_arg(self._structure, lambda n: values[n.name])
        return self._codegen.process_outputs(flat)


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

