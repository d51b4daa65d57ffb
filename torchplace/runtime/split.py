"""Split a GraphModule into one submodule per stage.

The chain of steps, each a small function:

1. :func:`compute_nodes` lists the nodes a plan must place (call_function / call_method /
   call_module);
2. :func:`validate_assignment` checks that every one has a stage in range and that no node reads
   a value from a later stage;
3. :func:`stage_interfaces` collects, per stage, the values it reads (model inputs or earlier
   stages' outputs) and the values it must hand on (read by a later stage or by the output);
4. :func:`build_stage` copies the stage's nodes, and the get_attr nodes they use, into a new graph
   with ``Graph.node_copy``, lints it and wraps it in a :class:`StageModule`.

Modules and parameters are shared, not copied: a stage calls the model's own submodules and reads
its own tensors (:class:`~torchplace.runtime.params.StageParameters` then moves each tensor to its
home device and gives stages elsewhere a replica, in a copy of the module path of that stage only).
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from torchplace.errors import InvalidPlanError
from torchplace.fxutil import COMPUTE_OPS
from torchplace.profiling.effects import Effects

__all__ = [
    "StageInterface",
    "StageModule",
    "build_stage",
    "compute_nodes",
    "split_stages",
    "stage_interfaces",
    "validate_assignment",
]



class StageModule(fx.GraphModule):
    """One stage of a split model: a GraphModule holding only the parameters it uses.

    ``forward`` takes the values named by :attr:`inputs` positionally and returns a tuple with the
    values named by :attr:`outputs`.

    Attributes:
        index: the stage's position in the pipeline.
        inputs: names of the values the stage reads (model placeholders or outputs of earlier
            stages), in the order ``forward`` takes them.
        outputs: names of the values the stage produces that later stages or the model output
            need, in the order ``forward`` returns them.
        waits_for: earlier stages that must finish before this one starts although it reads no
            value of theirs (in-place writes, :mod:`torchplace.profiling.effects`).
        writes: names of values (model inputs among them) whose memory the stage writes in
            place: copies of them made before it ran are stale afterwards, and a model input it
            wrote through a copy is copied back into the caller's tensor.
    """

    def __init__(
        self,
        root: torch.nn.Module,
        graph: fx.Graph,
        index: int,
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        waits_for: tuple[int, ...] = (),
        writes: tuple[str, ...] = (),
    ) -> None:
        """Build the module; ``root`` supplies the submodules and attributes the graph uses."""
        super().__init__(root, graph, class_name=f"Stage{index}")
        self.index = index
        self.inputs = inputs
        self.outputs = outputs
        self.waits_for = waits_for
        self.writes = writes


@dataclass(frozen=True)
class StageInterface:
    """What one stage reads and hands on.

    Attributes:
        nodes: the stage's compute nodes, in graph order.
        inputs: nodes whose values the stage reads from the model inputs or earlier stages.
        outputs: the stage's nodes read by a later stage or by the model output.
    """

    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that a plan assigns to stages, in graph order.

    Args:
        graph: an fx graph.

    Returns:
        Every call_function, call_method and call_module node.
    """
    return [n for n in graph.nodes if n.op in COMPUTE_OPS]


def validate_assignment(
    graph: fx.Graph, stage_of: Mapping[str, int], num_stages: int, effects: Effects | None = None
) -> None:
    """Check that ``stage_of`` places every compute node and respects the stage order.

    Args:
        graph: the model graph.
        stage_of: compute node name -> stage index.
        num_stages: the number of stages.
        effects: the graph's in-place writes; their ordering edges must go forward too.

    Raises:
        InvalidPlanError: if ``num_stages`` is below 1, a compute node has no stage, a name is not
            a compute node, a stage index is out of range, a node reads a value computed in a
            later stage, or an in-place ordering edge goes backwards.
    """
    if num_stages < 1:
        raise InvalidPlanError(f"num_stages must be at least 1 (got {num_stages})")
    nodes = compute_nodes(graph)
    names = {n.name for n in nodes}
    missing = [n.name for n in nodes if n.name not in stage_of]
    if missing:
        raise InvalidPlanError(
            f"{len(missing)} compute node(s) have no stage, e.g. {missing[:5]}; "
            "stage_of must map every call_function/call_method/call_module node"
        )
    unknown = sorted(set(stage_of) - names)
    if unknown:
        raise InvalidPlanError(
            f"stage_of names {len(unknown)} node(s) that are not compute nodes of the graph, "
            f"e.g. {unknown[:5]}"
        )
    for name, stage in stage_of.items():
        if not 0 <= stage < num_stages:
            raise InvalidPlanError(
                f"node {name!r} is assigned to stage {stage}, outside [0, {num_stages})"
            )
    for node in nodes:
        _check_precedence(node, stage_of)
    for u, v in (effects or Effects()).edges():
        if stage_of[u] > stage_of[v]:
            raise InvalidPlanError(
                f"node {v!r} in stage {stage_of[v]} must run after {u!r} in the later stage {stage_of[u]} "
                "(an in-place write orders them); stages must respect in-place ordering edges"
            )


def _check_precedence(node: fx.Node, stage_of: Mapping[str, int]) -> None:
    """Raise if ``node`` reads a compute node placed in a later stage."""
    stage = stage_of[node.name]
    for source in node.all_input_nodes:
        if source.op in COMPUTE_OPS and stage_of[source.name] > stage:
            raise InvalidPlanError(
                f"node {node.name!r} in stage {stage} reads {source.name!r} from the later "
                f"stage {stage_of[source.name]}; stages must be ordered so that every node's "
                "inputs come from the same or an earlier stage"
            )


def stage_interfaces(
    graph: fx.Graph, stage_of: Mapping[str, int], num_stages: int
) -> list[StageInterface]:
    """Collect each stage's nodes, the values it reads and the values it hands on.

    Args:
        graph: the model graph, already checked by :func:`validate_assignment`.
        stage_of: compute node name -> stage index.
        num_stages: the number of stages.

    Returns:
        One :class:`StageInterface` per stage, in stage order; every tuple in graph order.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    members: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    reads: list[set[fx.Node]] = [set() for _ in range(num_stages)]
    needed_after: list[set[fx.Node]] = [set() for _ in range(num_stages)]
    for node in graph.nodes:
        if node.op in COMPUTE_OPS:
            stage = stage_of[node.name]
            members[stage].append(node)
            sources = [s for s in node.all_input_nodes if s.op != "get_attr"]
            reads[stage].update(s for s in sources if _stage(s, stage_of) != stage)
            for s in sources:
                _mark_needed(s, stage, stage_of, needed_after)
        elif node.op == "output":
            for s in node.all_input_nodes:
                _mark_needed(s, num_stages, stage_of, needed_after)
    by_order = lambda nodes: tuple(sorted(nodes, key=order.__getitem__))
    return [
        StageInterface(tuple(members[s]), by_order(reads[s]), by_order(needed_after[s]))
        for s in range(num_stages)
    ]


def _stage(node: fx.Node, stage_of: Mapping[str, int]) -> int:
    """The stage of a compute node; -1 for model inputs (placeholders)."""
    return stage_of[node.name] if node.op in COMPUTE_OPS else -1


def _mark_needed(
    source: fx.Node,
    consumer_stage: int,
    stage_of: Mapping[str, int],
    needed_after: list[set[fx.Node]],
) -> None:
    """Record that ``source`` is read by a later stage (or the output) than its own."""
    if source.op in COMPUTE_OPS and stage_of[source.name] < consumer_stage:
        needed_after[stage_of[source.name]].add(source)


def build_stage(gm: fx.GraphModule, index: int, interface: StageInterface,
                waits_for: tuple[int, ...] = (), writes: tuple[str, ...] = ()) -> StageModule:
    """Copy one stage's nodes into a new graph and wrap it as a :class:`StageModule`.

    Args:
        gm: the model GraphModule (root of submodules and attributes).
        index: the stage index.
        interface: the stage's nodes, inputs and outputs.
        waits_for, writes: see :class:`StageModule`.

    Returns:
        The stage module; it shares the model's submodules and tensors.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for source in interface.inputs:
        env[source] = graph.placeholder(source.name)
        env[source].meta = copy.copy(source.meta)
    for attr in _used_attributes(interface.nodes):
        env[attr] = graph.node_copy(attr, env.__getitem__)
    for node in interface.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in interface.outputs))
    graph.lint()
    stage = StageModule(
        gm,
        graph,
        index,
        tuple(n.name for n in interface.inputs),
        tuple(n.name for n in interface.outputs),
        waits_for,
        writes,
    )
    return stage


def _used_attributes(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The get_attr nodes read by ``nodes``, in order of first use."""
    seen: dict[fx.Node, None] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            if source.op == "get_attr":
                seen.setdefault(source, None)
    return list(seen)


def split_stages(
    gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int, effects: Effects | None = None
) -> list[StageModule]:
    """Split ``gm`` into one :class:`StageModule` per stage.

    Args:
        gm: a GraphModule from ``torch.fx.symbolic_trace`` or
            ``torch.export.export(...).module()``.
        stage_of: the stage index of every call_function / call_method / call_module node, by
            node name. Stages must be ordered: a node's inputs come from the same or an earlier
            stage. get_attr nodes are copied into every stage that uses them; placeholders are
            model inputs; the output may read any stage.
        num_stages: the number of stages; a stage may be empty.
        effects: the graph's in-place writes (:func:`torchplace.profiling.trace` finds them):
            they set each stage's ``waits_for`` and ``writes``.

    Returns:
        The stages in order. Run them in order on an environment ``{name: value}`` seeded with
        the bound model inputs (see :class:`~torchplace.runtime.graph_io.GraphIO`) to compute the
        model.

    Raises:
        InvalidPlanError: see :func:`validate_assignment`.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        >>> [s.outputs for s in split_stages(gm, {"_0": 0, "_1": 1}, 2)]
        [('_0',), ('_1',)]
    """
    effects = effects or Effects()
    validate_assignment(gm.graph, stage_of, num_stages, effects)
    interfaces = stage_interfaces(gm.graph, stage_of, num_stages)
    waits: list[set[int]] = [set() for _ in range(num_stages)]
    for u, v in effects.edges():
        if stage_of[u] < stage_of[v]:
            waits[stage_of[v]].add(stage_of[u])
    writes: list[set[str]] = [set() for _ in range(num_stages)]
    for writer, names in effects.written.items():
        writes[stage_of[writer]].update(names)
    return [
        build_stage(gm, i, interface, tuple(sorted(waits[i])), tuple(sorted(writes[i])))
        for i, interface in enumerate(interfaces)
    ]
