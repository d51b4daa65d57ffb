"""Which parameters, buffers and constants each placement node reads, under which names.

Every tensor is charged once, to its *owner*: the first node in topological order that reads it
(``NodeRecord.param_bytes``). A tensor no node reads (BatchNorm's ``num_batches_tracked`` in eval
mode) still occupies memory: it is owned by the owner of the nearest tensor of the same module (or
of the closest enclosing module), and lives there at run time. A tensor read by several nodes (a
tied embedding and output layer, a module called twice) is listed with all its readers, so the
cost model charges it on every device that holds a copy (:func:`torchplace.costmodel.memory`).

The result goes into ``OpGraph.meta["state"]`` (JSON): for each tensor, by its first name,
``{"bytes", "names", "owner", "readers", "trainable"}`` where ``names`` are all its names in the
model (tied weights have several, e.g. ``transformer.wte.weight`` and ``lm_head.weight``),
``owner`` / ``readers`` are node ids and ``trainable`` says whether it is a parameter that
requires grad (an optimizer keeps a gradient and state for it).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from torchplace.fxutil import fetch_attr

__all__ = ["TensorUse", "owned_bytes", "state_meta", "storage_key", "tensor_uses"]

_Key = tuple[int, int, int]


def storage_key(t: torch.Tensor) -> _Key:
    """Identity of a tensor's memory: tied weights share it. A sparse (or other non-strided)
    tensor is its own memory: its id, no offset, and the bytes of its values and indices."""
    if t.layout != torch.strided:
        parts = (t._values(), t._indices()) if t.layout == torch.sparse_coo else ()
        return (id(t), 0, sum(int(p.numel() * p.element_size()) for p in parts))
    storage = t.untyped_storage()
    where = storage._cdata if t.device.type == "meta" else storage.data_ptr()  # meta storages have no address
    return (where, int(t.storage_offset()), int(t.numel() * t.element_size()))


@dataclass
class TensorUse:
    """One tensor's names, size, owner and readers (group indices)."""

    names: list[str]
    nbytes: int
    owner: int | None = None
    readers: list[int] = field(default_factory=list)
    trainable: bool = False


def _read_by(node: fx.Node, gm: fx.GraphModule) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each parameter/buffer/constant a node reads: its get_attr inputs, or
    a called module's tensors."""
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        for name, t in [*sub.named_parameters(), *sub.named_buffers()]:
            yield f"{node.target}.{name}", t
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            value = fetch_attr(gm, str(a.target))
            if isinstance(value, torch.Tensor):
                yield str(a.target), value


def _trainable(model: nn.Module) -> set[_Key]:
    """The storages of the model's parameters that require grad (what an optimizer updates)."""
    return {storage_key(p) for p in model.parameters() if p.requires_grad}


def _model_names(model: nn.Module) -> dict[_Key, list[str]]:
    """Every name of every parameter and buffer of the model, by storage (tied tensors share one)."""
    out: dict[_Key, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None:
            names = out.setdefault(storage_key(t), [])
            if name not in names:
                names.append(name)
    return out


def _owner_of_unread(name: str, read: Sequence[TensorUse], fallback: int) -> int:
    """The owner of the read tensor nearest in the module tree to tensor ``name``."""
    path = name.rpartition(".")[0]
    while True:
        prefix = f"{path}." if path else ""
        for use in read:
            if any(n.startswith(prefix) for n in use.names):
                assert use.owner is not None
                return use.owner
        if not path:
            return fallback
        path = path.rpartition(".")[0]


def tensor_uses(groups: Sequence[Sequence[fx.Node]], order: Sequence[int], gm: fx.GraphModule,
                model: nn.Module) -> list[TensorUse]:
    """Each tensor the groups read or the model holds, with its owner and readers.

    Args:
        groups: the fx nodes of each placement node.
        order: the group indices in topological order (the first reader owns a tensor).
        gm: the traced module (its get_attr targets and called modules).
        model: the traced model (the names of its tensors).
    """
    names = _model_names(model)
    trainable = _trainable(model)
    uses: dict[_Key, TensorUse] = {}
    for i in order:
        for n in groups[i]:
            for name, t in _read_by(n, gm):
                key = storage_key(t)
                use = uses.setdefault(key, TensorUse(list(names.get(key, [name])), key[2], trainable=key in trainable))
                if use.owner is None:
                    use.owner = i
                if i not in use.readers:
                    use.readers.append(i)
    read = list(uses.values())
    for key, model_names in names.items():
        if key not in uses:
            owner = _owner_of_unread(model_names[0], read, order[0]) if order else None
            uses[key] = TensorUse(list(model_names), key[2], owner, trainable=key in trainable)
    return list(uses.values())


def state_meta(uses: Sequence[TensorUse], ids: Sequence[str]) -> dict[str, dict]:
    """``OpGraph.meta["state"]``: each tensor by its first name (see the module docstring)."""
    return {
        use.names[0]: {
            "bytes": use.nbytes, "names": list(use.names),
            "owner": ids[use.owner] if use.owner is not None else None,
            "readers": [ids[i] for i in use.readers],
            "trainable": use.trainable,
        }
        for use in uses
    }


def owned_bytes(uses: Sequence[TensorUse], count: int) -> list[int]:
    """Bytes each of ``count`` groups owns."""
    out = [0] * count
    for use in uses:
        if use.owner is not None:
            out[use.owner] += use.nbytes
    return out
