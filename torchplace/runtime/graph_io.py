"""How a GraphModule's inputs become named values and named values become its output.

The stages of a split model exchange values by fx node name. :class:`GraphIO` is the two ends of
that exchange: it binds the caller's ``(args, kwargs)`` to the graph's placeholder names and, given
the name -> value environment after the last stage, rebuilds the model's output pytree. Graphs
from ``torch.export.export(...).module()`` carry a ``_PyTreeCodeGen`` whose input spec flattens
nested arguments and whose output spec unflattens the result; both are honoured here.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import fx
from torch.utils._pytree import TreeSpec, tree_leaves, tree_unflatten

from torchplace.fxutil import bind_call, fetch_attr

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

    def __init__(self, gm: fx.GraphModule, output_spec: TreeSpec | None = None) -> None:
        """Record the signature, placeholders, output structure and codegen of ``gm``.

        Args:
            gm: the traced or exported model.
            output_spec: the model's own output structure, where the graph's differs from it in
                container types only (:attr:`torchplace.profiling.Traced.output_spec`).
        """
        self._output_spec = output_spec
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
        self._codegen = graph._codegen
        self._gm = gm

    def bind_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map the caller's arguments to placeholder names, as ``gm(*args, **kwargs)`` would.

        Raises:
            UsageError: if the arguments do not match the model's signature.
        """
        return bind_call(self._gm, args, kwargs)

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
        out = self._codegen.process_outputs(_rebuild(self._structure, values))
        return out if self._output_spec is None else tree_unflatten(tree_leaves(out), self._output_spec)


def _rebuild(structure: Any, values: Mapping[str, Any]) -> Any:
    """``structure`` (an output node's argument) with every fx node replaced by its value, in
    plain containers: fx keeps the graph's output as ``immutable_list`` / ``immutable_dict`` (so
    ``fx.node.map_arg`` returns those), where the GraphModule's code returns a ``list`` / ``dict``
    the caller may change."""
    if isinstance(structure, fx.Node):
        return values[structure.name]
    if isinstance(structure, tuple):
        items = [_rebuild(s, values) for s in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)  # a namedtuple keeps its type
    if isinstance(structure, list):
        return [_rebuild(s, values) for s in structure]
    if isinstance(structure, dict):
        return {k: _rebuild(v, values) for k, v in structure.items()}
    if isinstance(structure, slice):
        return slice(_rebuild(structure.start, values), _rebuild(structure.stop, values),
                     _rebuild(structure.step, values))
    return structure
