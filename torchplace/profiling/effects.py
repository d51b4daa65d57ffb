"""In-place writes in a traced graph: who writes which memory, and what that forces on a placement.

A traced graph may write tensors in place: ``h.relu_()``, ``out += identity``, ``x.add_(1)`` on a
model input, ``self.n += 1`` or BatchNorm's running statistics on a buffer, a write through a view
(``h[0].mul_(2)``). Data edges alone do not order such a write after the earlier readers of the old
value, nor the later readers after it (they may read the tensor under an older name), and a copy
on another device does not see a write made on the original. So a placement that looks only at
data edges can silently change the result.

:class:`AccessLog` records, during one real run of the graph, which memory (storage) each node
reads, writes (its version counter moved) and returns an alias of; :func:`analyse` turns that
into the :class:`Effects` a placement must respect. For a storage ``S`` that some node writes, with
accessors in graph order and writers ``w_1 .. w_k``:

* **order**: every accessor before ``w_1`` runs before ``w_1`` (write after read), the accessors
  between two writers run in graph order, and every accessor after ``w_k`` runs after ``w_k`` (read
  after write). These are edges of the placement graph like data edges;
* **colocation**, when ``S`` is memory of one call (an intermediate or a model input): the writers,
  every accessor between ``w_1`` and ``w_k``, and every node before ``w_1`` that returns an alias of
  ``S`` (its creator, views of it) share one device, where the writes happen on the one tensor.
  Plain readers before ``w_1`` and after ``w_k`` may sit anywhere: they read a copy of the value
  before the first or after the last write;
* **one node**, when ``S`` is a parameter, buffer or constant (it outlives the call): every
  accessor is in one placement node, so micro-batches see the state in the order the unsplit
  model run on the same micro-batches would (a pipeline interleaves micro-batches between stages);
* **write-back**: a model input written on a device other than the caller's is copied back into
  the caller's tensor after the call, as eager PyTorch would leave it.

The analysis is dynamic: aliasing is what the example runs showed. PyTorch decides some aliasing
from strides (``reshape``, ``contiguous``), and strides of a batch of one differ from those of
larger batches (which all agree), so tracing runs the analysis at the example batch and at a batch
of one and keeps the union (:func:`union`).
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.errors import UnsupportedError
from torchplace.fxutil import is_compute

__all__ = ["AccessLog", "Effects", "StateSnapshot", "StorageKeys", "analyse", "named_state", "same_values",
           "storage_address", "union", "version_of"]

StorageKey = int
"""A storage's identity within one run (:class:`StorageKeys`): unique even where a freed
storage's address is reused."""

_Watch = tuple[torch.Tensor, "int | None", "torch.Tensor | None"]
"""A tensor a node could write: its version before the node, and a copy of its value for state."""


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def storage_address(t: torch.Tensor) -> StorageKey | None:
    """The address of ``t``'s storage; None for tensors without memory of their own (empty, meta)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None
    if storage.nbytes() == 0 or t.device.type == "meta":
        return None
    return storage.data_ptr()


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class StorageKeys:
    """Unique keys for the storages a run meets, in a run that frees values after their last use.

    A storage is known by its address, but an address is reused once the memory is freed, and a
    new tensor there is other memory. So each address holds a key and weak references to the
    tensors seen on it; a tensor met on an address none of whose tensors is alive any more gets a
    new key. The interpreter frees only its own values, and the model's parameters, buffers and
    the run's inputs outlive the run, so a storage that is still alive is always found alive
    (keeping every value alive instead cost GPT-2 small's trace 2 s: fresh memory for every
    intermediate). Memory that only a module's own, unregistered attributes keep alive (neither
    parameter nor buffer) is not tracked, as it is not by the rest of the analysis either.
    """

    def __init__(self) -> None:
        self._by_address: dict[int, tuple[StorageKey, list[weakref.ref[torch.Tensor]]]] = {}
        self._count = 0

    def key(self, t: torch.Tensor) -> StorageKey | None:
        """The key of ``t``'s storage (None for tensors without memory of their own)."""
        address = storage_address(t)
        if address is None:
            return None
        entry = self._by_address.get(address)
        if entry is not None:
            entry[1][:] = [r for r in entry[1] if r() is not None]
        if entry is None or not entry[1]:  # memory never seen, or freed since and reused
            entry = self._by_address[address] = (self._count, [])
            self._count += 1
        if not any(r() is t for r in entry[1]):
            entry[1].append(weakref.ref(t))
        return entry[0]


@dataclass
class _Access:
    reads: set[StorageKey] = field(default_factory=set)
    writes: set[StorageKey] = field(default_factory=set)
    makes: set[StorageKey] = field(default_factory=set)


class AccessLog:
    """What each fx node of one run read, wrote and returned, by storage.

    Use it from an :class:`torch.fx.Interpreter` (storages are told apart by
    :class:`StorageKeys`, so the interpreter may free values after their last use)::

        token = log.before(node, args, kwargs, module)
        out = ...run the node...
        log.after(node, token, out)

    Args:
        state: the model's parameters and buffers by name; a node that writes one of them is
            recorded even when the tensor is not among its arguments.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = [(name, t) for name, t in state.items()]
        self._state_ids = {id(t) for t in state.values()}
        self._keys = StorageKeys()
        self.access: dict[str, _Access] = {}
        self.inputs: dict[str, set[StorageKey]] = {}  # placeholder -> its storages
        self.creator: dict[StorageKey, tuple[str, str]] = {}  # storage -> (kind, fx node name)
        self.state_names: dict[StorageKey, str] = {}
        for name, t in self._state:
            key = self._keys.key(t)
            if key is not None:
                self.creator.setdefault(key, ("state", name))
                self.state_names.setdefault(key, name)

    def placeholder(self, node: fx.Node, value: Any) -> None:
        """A model input: its storages are created by the caller."""
        keys = self.inputs.setdefault(node.name, set())
        for t in _tensors(value):
            key = self._keys.key(t)
            if key is not None:
                keys.add(key)
                self.creator.setdefault(key, ("input", node.name))

    def constant(self, node: fx.Node, value: Any) -> None:
        """A get_attr value: parameters, buffers and constants outlive the call."""
        for t in _tensors(value):
            key = self._keys.key(t)
            if key is not None:
                self.creator.setdefault(key, ("state", str(node.target)))

    def before(self, node: fx.Node, args: Any, kwargs: Any, module: nn.Module | None) -> list[_Watch]:
        """What the node could write, with version counters (and copies of the parameters and
        buffers it reads), taken just before it runs."""
        read = _tensors((args, kwargs))
        if module is not None:
            read += [*module.parameters(), *module.buffers()]
        access = self.access.setdefault(node.name, _Access())
        declared = _declares_no_writes(node)
        watched: list[_Watch] = []
        for t in read:
            key = self._keys.key(t)
            if key is not None:
                access.reads.add(key)
                copy = t.detach().clone() if id(t) in self._state_ids and not (declared and _is_param(t)) else None
                watched.append((t, version_of(t), copy))
        if not declared:
            watched += [(t, version_of(t), None) for _, t in self._state]
        return watched

    def after(self, node: fx.Node, token: Sequence[_Watch], out: Any) -> None:
        """Record the node's writes and the storages it returned.

        A write is a moved version counter, or a changed value of a parameter or buffer the node
        read: some kernels update state without moving its counter (BatchNorm's running
        statistics in training)."""
        access = self.access[node.name]
        for t, version, copy in token:
            moved = version is not None and version_of(t) != version
            if moved or (copy is not None and not same_values(t, copy)):
                key = self._keys.key(t)
                if key is not None:
                    access.writes.add(key)
        for t in _tensors(out):
            key = self._keys.key(t)
            if key is not None:
                access.makes.add(key)
                self.creator.setdefault(key, ("temp", node.name))


def _declares_no_writes(node: fx.Node) -> bool:
    """Whether ``node`` calls an ATen operator whose schema writes none of its arguments (an
    exported graph's nodes). Such an operator cannot write state it does not get, and writes no
    parameter it gets, so those counters and value copies are skipped (a copy of every parameter
    read cost seconds: GPT-2's 150 MB embedding table). Buffers it gets are still compared:
    ``aten.batch_norm``'s schema declares no write, yet in training it updates the running
    statistics without moving their version counters."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, a NaN where the other has a NaN (a NaN that stays a NaN is no
    write); sparse and other non-strided tensors are compared dense. A tensor on the meta device
    holds no values: two meta tensors of one shape count as equal (a write to one still moves its
    version counter)."""
    if a.is_meta or b.is_meta:
        return a.shape == b.shape
    if a.layout != torch.strided or b.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    equal = a == b
    if a.is_floating_point() or a.is_complex():
        equal |= a.isnan() & b.isnan()
    return a.shape == b.shape and bool(equal.all())


@dataclass(frozen=True)
class Effects:
    """What in-place writes force on a placement (see the module docstring).

    Attributes:
        after: fx node -> the fx nodes that must run before it although it reads no output of
            theirs (write-after-read, read-after-write, write-after-write).
        colocated: sets of fx nodes that must share a device.
        merged: sets of fx nodes that must form one placement node (accessors of written state).
        written: writer fx node -> names of the values (fx nodes, placeholders among them) that
            alias the memory it writes: after it runs, copies of them on other devices are stale,
            and a written placeholder is copied back into the caller's tensor.
        written_state: names of parameters, buffers and constants the graph writes.
    """

    after: Mapping[str, frozenset[str]] = field(default_factory=dict)
    colocated: tuple[frozenset[str], ...] = ()
    merged: tuple[frozenset[str], ...] = ()
    written: Mapping[str, frozenset[str]] = field(default_factory=dict)
    written_state: tuple[str, ...] = ()

    @property
    def pure(self) -> bool:
        """Whether the graph writes nothing in place."""
        return not self.written

    def edges(self) -> Iterator[tuple[str, str]]:
        """Every ordering edge ``(before, after)`` between fx node names."""
        for v, us in self.after.items():
            for u in sorted(us):
                yield u, v


def _accessors(order: Sequence[str], log: AccessLog, key: StorageKey) -> list[str]:
    """The compute nodes that read, write or return an alias of storage ``key``, in graph order."""
    out = []
    for n in order:
        a = log.access.get(n)
        if a is not None and (key in a.reads or key in a.writes or key in a.makes):
            out.append(n)
    return out


def _order_edges(accessors: Sequence[str], writers: set[str]) -> Iterator[tuple[str, str]]:
    """Edges that keep every access in its place relative to the writes (transitively)."""
    since: list[str] = []
    last_writer: str | None = None
    for a in accessors:
        if a in writers:
            yield from ((p, a) for p in since)
            since, last_writer = [a], a
        else:
            if last_writer is not None:
                yield last_writer, a
            since.append(a)


def analyse(graph: fx.Graph, log: AccessLog) -> Effects:
    """The :class:`Effects` of the writes recorded in ``log`` (see the module docstring)."""
    order = [n.name for n in graph.nodes if is_compute(n)]
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    written_keys = sorted({k for a in log.access.values() for k in a.writes})
    after: dict[str, set[str]] = {}
    colocated: list[frozenset[str]] = []
    merged: list[frozenset[str]] = []
    written: dict[str, set[str]] = {}
    state: set[str] = set()
    for key in written_keys:
        accessors = _accessors(order, log, key)
        writers = [a for a in accessors if key in log.access[a].writes]
        for u, v in _order_edges(accessors, set(writers)):
            if u != v:
                after.setdefault(v, set()).add(u)
        kind, creator = log.creator.get(key, ("state", "<unknown>"))
        aliases = {a for a in accessors if key in log.access[a].makes}
        aliases.update(p for p in placeholders if key in log.inputs.get(p, ()))
        for w in writers:
            written.setdefault(w, set()).update(aliases)
        if kind == "state":
            merged.append(frozenset(accessors))
            state.add(log.state_names.get(key, creator))
            continue
        first, last = accessors.index(writers[0]), accessors.index(writers[-1])
        early_aliases = (a for a in accessors[:first] if a in aliases)
        colocated.append(frozenset([*accessors[first:last + 1], *early_aliases]))
    return Effects(
        after={v: frozenset(us) for v, us in after.items()},
        colocated=tuple(c for c in colocated if len(c) > 1),
        merged=tuple(m for m in merged if len(m) > 1),
        written={w: frozenset(names) for w, names in written.items()},
        written_state=tuple(sorted(state)),
    )


def union(effects: Sequence[Effects]) -> Effects:
    """Effects that hold for every run in ``effects``: the union of their edges, sets and writes
    (what each run found is a constraint, so all of them together are)."""
    if len(effects) == 1:
        return effects[0]
    after: dict[str, set[str]] = {}
    written: dict[str, set[str]] = {}
    for e in effects:
        for v, us in e.after.items():
            after.setdefault(v, set()).update(us)
        for w, names in e.written.items():
            written.setdefault(w, set()).update(names)
    return Effects(
        after={v: frozenset(us) for v, us in after.items()},
        colocated=tuple(dict.fromkeys(c for e in effects for c in e.colocated)),
        merged=tuple(dict.fromkeys(m for e in effects for m in e.merged)),
        written={w: frozenset(n) for w, n in written.items()},
        written_state=tuple(sorted({s for e in effects for s in e.written_state})),
    )


class StateSnapshot:
    """A model's buffers (copied) and parameters (version counters), to restore later.

    Tracing and profiling run the model; a model that updates its buffers in forward (BatchNorm
    in training, counters) must come out of :func:`torchplace.place` as it went in. Parameters are
    not copied (that would double the model's memory while placing it, for models that do not fit
    one device); a forward that writes a parameter in place cannot be undone, and :meth:`restore`
    refuses it with :class:`~torchplace.errors.UnsupportedError`.
    """

    def __init__(self, model: nn.Module) -> None:
        self._tensors = named_state(model)
        params = {id(p) for p in model.parameters()}
        with torch.no_grad():
            self._saved = {name: t.detach().clone() for name, t in self._tensors.items() if id(t) not in params}
        self._versions = {name: _identity(t) for name, t in self._tensors.items()}
        # What each module's parameter and buffer slots hold: a forward that assigns one (fx tracing
        # ``self.acc += h`` stores a Proxy there) is undone by putting the object back.
        self._slots = [(f"{prefix}.{key}" if prefix else key, slots, key, value)
                       for prefix, module in model.named_modules(remove_duplicate=False)
                       for slots in (module._parameters, module._buffers) for key, value in slots.items()]
        # Which slots there were: a forward that registers a buffer (``self.register_buffer("cache",
        # torch.zeros(n))``) adds one, which fx tracing fills with a Proxy and export with a fake tensor.
        self._keys = [(prefix, slots, frozenset(slots))
                      for prefix, module in model.named_modules(remove_duplicate=False)
                      for slots in (module._parameters, module._buffers)]
        self.registered: list[str] = []  # the slots restore() removed: registered by the forward

    def _added(self) -> list[tuple[str, dict[str, Any], str]]:
        """The parameter and buffer slots registered since the snapshot: (name, slots, key)."""
        added: dict[tuple[int, str], tuple[str, dict[str, Any], str]] = {}  # a shared module once
        for prefix, slots, before in self._keys:
            for key in list(slots):
                if key not in before:
                    added.setdefault((id(slots), key), (f"{prefix}.{key}" if prefix else key, slots, key))
        return list(added.values())

    def changed(self) -> list[str]:
        """Names of the tensors written since the snapshot (moved version counter, new memory, or
        for a buffer a new value), of the parameter and buffer slots assigned another object, and
        of those registered since."""
        out = [name for name, slots, key, value in self._slots if slots.get(key, _GONE) is not value]
        out += [name for name, _, _ in self._added() if name not in out]
        for name, t in self._tensors.items():
            before = self._versions[name]
            saved = self._saved.get(name)
            if name not in out and (_identity(t) != before or (saved is not None and not same_values(t, saved))):
                out.append(name)
        return out

    def restore(self) -> None:
        """Write the saved values back into every buffer that was written, and remove the
        parameters and buffers registered since the snapshot (their names go to ``registered``).

        Raises:
            UnsupportedError: if a parameter was written (it was not copied, so it cannot be).
        """
        for _, slots, key, value in self._slots:  # first the objects, then their values
            if slots.get(key, _GONE) is not value:
                slots[key] = value
        for name, slots, key in self._added():  # the forward registers them again when it runs
            del slots[key]
            self.registered.append(name)
        changed = self.changed()
        lost = [n for n in changed if n not in self._saved]
        if lost:
            raise UnsupportedError(
                f"the model writes its parameter {lost[0]!r} in place in forward; torchplace runs the model while "
                "placing it and does not copy parameters to undo that: make it a buffer, or update it outside forward"
            )
        with torch.no_grad():
            for name in changed:
                self._tensors[name].copy_(self._saved[name])
        self._versions = {name: _identity(t) for name, t in self._tensors.items()}


_GONE = object()
"""A slot deleted since the snapshot."""


def _identity(t: torch.Tensor) -> tuple[int | None, int]:
    """A tensor's version counter and the address of its memory (``.data`` assignments change it)."""
    return version_of(t), t.data_ptr() if t.layout == torch.strided else id(t)


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its first name (tied tensors once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out

