"""Whether splitting a call's batch into micro-batches keeps the model's outputs.

A throughput pipeline splits every batched input along dim 0 (:func:`~torchplace.runtime.microbatch.scatter`)
and joins each output of the micro-batches along dim 0 (:func:`~torchplace.runtime.microbatch.gather`).
That gives the model's output only where dim 0 is the batch of every input and output and no
output mixes the samples of a batch. ``place()`` checks it on the example (:func:`check_split`).
The property does not depend on how many rows are split off, so the traced graph runs on the
example's last sample and on its last two (on the last micro-batch and twice its rows where the
model needs more): two small forwards, not the example's.

- an output that reads no batched input (a constant, a parameter, a size other than the batch's)
  is the same on every micro-batch: the placed model returns it once, not ``m`` copies joined;
- every other tensor output must have a dim 0 that scales with the rows, and a floating-point one
  must hold for the last sample alone what it holds for it beside another, up to rounding (of an
  output that is rounding noise itself, relative to its operands: :class:`_Recheck`). Where
  it does not (a reduction over the batch, batch statistics, attention over dim 0 because the model
  puts the sequence first, a layout that is not batch-major), :class:`~torchplace.errors.MicrobatchError`
  names the output and says what to do.

A graph that draws random numbers (dropout in training mode) is checked by shape only. The check
is as good as the example: an output whose rows mix only on other inputs is not seen.

``torch.export`` traces every dynamic size as 2 or more and drops, without a guard, what a branch
on a size of one does (``if x.shape[1] == 1:``, ``L - 1 if L > 1 else 1``). For the batch,
:func:`rows_needed` finds it; for the other dynamic dimensions (a sequence length declared with
``dynamic_dims``), :func:`dims_of_one` runs the model and its trace at size one along each, and
:class:`CallSizes` refuses the calls the trace does not compute as the model does.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from torchplace.checks import brief
from torchplace.errors import MicrobatchError, TraceError, UsageError
from torchplace.fxutil import (Interpreter, bind_call, bind_placeholders, draws_random_numbers, flat_inputs, run_graph,
                               symbolic_sizes)
from torchplace.profiling.effects import StateSnapshot, same_values
from torchplace.runtime.microbatch import batch_size, last_rows

__all__ = ["CallSizes", "Runs", "check_broadcast_rows", "check_rows", "check_split", "dims_of_one", "joined_outputs",
           "reads_batch", "rows_needed", "state_written_per_microbatch"]

TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3}
"""Largest difference, relative to the output's largest value, between rows computed alone and
beside others that counts as rounding (a different batch size may take other kernels);
``HALF_TOLERANCE`` for 16-bit and smaller floating types. Mixing samples differs by far more."""

HALF_TOLERANCE = 5e-2


class Runs:
    """The traced graph's (and the model's) outputs on the example's last ``n`` samples, each run
    once (the checks share them); one random seed for every run, the buffers put back.

    Args:
        model: the model (``None``: only the graph runs).
        gm: the traced graph; ``flat(args, kwargs)`` gives fresh values of its placeholders.
    """

    def __init__(self, model: torch.nn.Module | None, gm: fx.GraphModule, flat: Any, args: tuple[Any, ...],
                 kwargs: Mapping[str, Any]) -> None:
        self.model, self.gm, self.flat, self.args, self.kwargs = model, gm, flat, tuple(args), dict(kwargs)
        try:
            self.batch = batch_size(args, kwargs)
        except ValueError:
            self.batch = None
        self._outputs: dict[tuple[str, int], Any] = {}

    def graph(self, n: int) -> Any:
        """The graph's output on the last ``n`` samples (raises what the graph raises)."""
        return self._get("graph", n)

    def eager(self, n: int) -> Any:
        """The model's own output on the last ``n`` samples."""
        return self._get("eager", n)

    def beside_copy(self, n: int) -> Any:
        """The graph's output on the last ``n`` samples followed by a copy of them: the batch of
        ``graph(2 * n)``, so the same kernels, with other rows beside the last ``n``."""
        return self._get("beside_copy", n)

    def magnitudes(self, n: int) -> dict[fx.Node, float]:
        """The largest finite magnitude of every floating-point tensor value of the graph (its
        nodes' outputs, parameters and inputs among them) on the last ``n`` samples."""
        return self._get("magnitudes", n)

    def last(self, n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example call cut to its last ``n`` samples."""
        return last_rows(self.args, self.kwargs, self.batch, n) if self.batch else (self.args, dict(self.kwargs))

    def run(self, eager: bool, call: tuple[tuple[Any, ...], Mapping[str, Any]],
            interpreter: Interpreter | None = None) -> Any:
        """The model's (``eager``) or the graph's output on ``call`` (run by ``interpreter`` where
        given), from the seed every run uses."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if eager:
                return _run(self.model, _copies(call), call=True)  # type: ignore[arg-type]
            return _run(self.gm, self.flat(*call), interpreter=interpreter)

    def _get(self, what: str, n: int) -> Any:
        key = (what, n)
        if key not in self._outputs:
            try:
                if what == "magnitudes":
                    self._outputs[key] = self._magnitudes(n)
                elif what == "beside_copy":
                    self._outputs[key] = self.run(False, self._beside_copy(n))
                else:
                    self._outputs[key] = self.run(what == "eager", self.last(n))
            except Exception as error:  # noqa: BLE001 - kept, to raise again on the next ask
                self._outputs[key] = error
        out = self._outputs[key]
        if isinstance(out, Exception):
            raise out
        return out

    def _beside_copy(self, n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example call with each batched tensor cut to its last ``n`` rows, twice over."""
        def doubled(whole: Any, cut: Any) -> Any:
            batched = isinstance(whole, torch.Tensor) and whole.dim() > 0 and whole.shape[0] == self.batch
            return torch.cat([cut, cut]) if batched else cut

        return pytree.tree_map(doubled, (self.args, dict(self.kwargs)), self.last(n))

    def _magnitudes(self, n: int) -> dict[fx.Node, float]:
        recorder = _Magnitudes(self.gm)
        self.run(False, self.last(n), recorder)
        return recorder.largest


class _Magnitudes(Interpreter):
    """Runs a graph and keeps the largest finite magnitude of each floating-point tensor value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.largest: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
            finite = out.detach().abs()
            finite = finite[finite.isfinite()]
            self.largest[n] = float(finite.max()) if finite.numel() else 0.0
        return out


def check_split(runs: Runs, m: int, *, values: bool = True) -> tuple[bool, ...] | None:
    """Check that micro-batches of the example give the model's outputs (module docstring).

    Args:
        runs: the graph's runs on the example (:class:`Runs`).
        m: the micro-batches (at least 2 to check anything).
        values: check values too, not only shapes (a training graph computes each micro-batch
            with its own batch statistics by design).

    Returns:
        Per output leaf (``tree_flatten`` order), ``False`` for a tensor that reads no batched input
        (taken from the first micro-batch), ``True`` for the rest (a tensor joined along dim 0, any
        other value taken from the first, as :func:`~torchplace.runtime.microbatch.gather` does);
        ``None`` where nothing is split (no batch, or ``m < 2``), or where the graph does not run
        on a micro-batch (the micro-batch profile then says why).

    Raises:
        MicrobatchError: an output that micro-batches cannot reproduce (see the module docstring).
    """
    batch, gm = runs.batch, runs.gm
    if batch is None or batch < 2 or m < 2:
        return None
    rows = batch // min(m, batch)  # the executor's smallest micro-batch
    outputs = None
    for one in dict.fromkeys((1, rows)):
        try:
            outputs = [runs.graph(2 * one), runs.graph(one)]
            break
        except Exception:  # noqa: BLE001 - a model that needs more rows (or fails on any split)
            continue
    if outputs is None:
        check_broadcast_rows(runs, m)
        return None
    pair, _ = pytree.tree_flatten_with_path(outputs[0])
    alone = pytree.tree_leaves(outputs[1])
    if len(pair) != len(alone):
        raise MicrobatchError(f"the model's output has {len(pair)} parts on {2 * one} samples and {len(alone)} on "
                              f"{one}: its structure depends on the batch; place it with microbatches=1")
    reads = reads_batch(gm, flat_inputs(gm, runs.args, runs.kwargs), batch, len(pair))  # no copies: shapes only
    random = any(draws_random_numbers(gm, n) for n in gm.graph.nodes)
    joined = []
    for index, ((path, both), single, read) in enumerate(zip(pair, alone, reads)):
        what = f"model output {pytree.keystr(path)}" if path else "the model's output"
        if not isinstance(both, torch.Tensor):
            if _holds_tensor(both):  # a container torch's pytree does not know: a micro-batch's would come back
                kind = "dataclass" if dataclasses.is_dataclass(both) else "object"
                register = ("torch.utils._pytree.register_dataclass" if kind == "dataclass"
                            else "torch.utils._pytree.register_pytree_node")
                raise MicrobatchError(
                    f"{what} is a {type(both).__name__} {kind} holding tensors, which micro-batches cannot join: "
                    f"torch's pytree does not know the type, so the placed model would return one micro-batch's. "
                    f"Register it before placing ({register}({type(both).__name__}{'' if kind == 'dataclass' else ', ...'})), "
                    "or place it with microbatches=1")
            if read and _scalar_of_values(gm, index):  # y.max().item(): equal on two probes by chance
                raise MicrobatchError(
                    f"{what} is a Python {type(both).__name__} read from the values of the batch (.item() or "
                    ".tolist()): micro-batches would return one micro-batch's; return it as a tensor with a batch "
                    "dimension, or place it with microbatches=1")
            if not _same_value(both, single):  # a batch size the model returns, say
                raise MicrobatchError(
                    f"{what} is a Python {type(both).__name__} that depends on the batch ({both!r} on {2 * one} samples, "
                    f"{single!r} on {one}): micro-batches would return one micro-batch's; return it as a tensor "
                    "with a batch dimension or compute it outside the model, or place it with microbatches=1")
            joined.append(True)  # gather takes it from the first micro-batch anyway
            continue
        if not read:
            joined.append(False)
            continue
        _check_output(what, both, single, one, values=values and not random,
                      recheck=_Recheck(runs, one, index))
        joined.append(True)
    return tuple(joined)


def check_broadcast_rows(runs: Runs, m: int) -> None:
    """Refuse a split into ``m`` micro-batches whose micro-batches the graph runs on (the
    executor's smallest) although it fails on twice as many of the example's samples: a tensor
    input whose dim 0 is not the batch but has the batch's size (an attention bias of shape
    ``(T, T)`` with ``T`` samples) is cut like the batch, and where a micro-batch leaves it one row
    it broadcasts, so the graph runs and computes something else than the model, silently.

    Raises:
        MicrobatchError: naming the sizes and what to do.
    """
    batch = runs.batch or 0
    if batch < 2 or m < 2:
        return
    rows = batch // min(m, batch)
    if 2 * rows > batch:
        return
    try:
        runs.graph(2 * rows)
        return  # not this case
    except Exception:  # noqa: BLE001 - what follows says whether the micro-batch runs
        pass
    try:
        runs.graph(rows)
    except Exception:  # noqa: BLE001 - the micro-batch profile says why the graph fails there
        return
    raise MicrobatchError(
        f"the model runs on micro-batches of {rows} sample(s) of the example but fails on {2 * rows}: a tensor input "
        f"whose dim 0 is not the batch, but as long as it ({runs.batch}; an attention bias of shape (T, T), say), is "
        "cut into micro-batches too, and broadcasts where it has one row, computing something else than the model. "
        "Give every tensor input the batch along dim 0 (or make such an input a buffer of the model), or place it "
        "with microbatches=1")


def guard_error(guard: str, dynamic_dims: Any = None, left_out: Mapping[str, Any] | None = None) -> UsageError:
    """The :class:`UsageError` for a call that breaks ``guard``, a guard of the exported graph
    (``input_ids.size()[1] == 16``), saying what to do; ``dynamic_dims``: the placement's (see
    :mod:`torchplace.profiling.dynamic`); ``left_out``: the arguments the call left out, at their
    defaults (:func:`torchplace.fxutil.left_out`). A size the user declared dynamic (or ``"auto"``)
    that the model's code fixed while tracing gets no advice to declare it."""
    # dim 0 is asked dynamic: only the model fixes it to a number (not two inputs' batches compared)
    if "==" in guard and re.search(r"size\(\)\[0\]", guard) and guard.count("size()") == 1:
        return UsageError(
            f"the placed model was traced for inputs with {guard}, which this call breaks: the model fixes its batch "
            "size (a reshape to the example's size, a size taken from a constant); call it with the example's batch "
            "size, or take the size from the input (x.view(x.shape[0], ...)) and place it again")
    if "size()" not in guard and "stride()" not in guard:  # a value: a Python number the export baked in
        number = re.match(r"\s*(\w+)\s*==", guard)
        breaks = "which this call breaks"
        if number and number.group(1) in (left_out or {}):  # the call left it out: the model's default
            breaks = f"which this call, leaving {number.group(1)} out (the model's default, {left_out[number.group(1)]!r}), breaks"
        return UsageError(
            f"the placed model was traced for inputs with {guard}, {breaks}: torch.export keeps a Python "
            "number (an int, float or bool argument) as the constant the example had; call it with that value, pass "
            "the number as a tensor (torch.tensor(x)), or place it with trace_method='fx'")
    if re.search(r"[<>]", guard):  # a range the export found in the model (a table of positions, a size branch)
        return UsageError(
            f"the placed model was traced for inputs with {guard}, which this call breaks: the exported graph holds "
            "only within that range (the model has a table of that many positions, or its code branches on the "
            "size and the trace took the example's side); call it within the range, or place it again with an "
            "example on the side this call needs")
    pair = re.fullmatch(r"\s*(\w+)\.size\(\)\[(\d+)\]\s*==\s*(\w+)\.size\(\)\[(\d+)\]\s*", guard)
    if pair and pair.group(1, 2) != pair.group(3, 4):  # two inputs' sizes the model computes with together
        return UsageError(
            f"the placed model was traced for inputs with {guard}, which this call breaks: the model computes with "
            f"dim {pair.group(2)} of {pair.group(1)!r} and dim {pair.group(4)} of {pair.group(3)!r} together, so "
            "they must be equal (an attention mask as long as the input ids); pass inputs whose sizes match")
    named = re.match(r"\s*(\w+)\.size\(\)\[(\d+)\]", guard)
    sizes = re.findall(r"(\w+)\.size\(\)\[(\d+)\]", guard)
    if not named and sizes and all(_declared(dynamic_dims, name, int(dim)) for name, dim in sizes):
        named_dims = list(dict.fromkeys(f"dim {dim} of {name!r}" for name, dim in sizes))
        were = "was" if len(named_dims) == 1 else "were"
        return UsageError(
            f"the placed model was traced for inputs with {guard}, which this call breaks: {', '.join(named_dims)} "
            f"{were} asked dynamic, "
            "but the trace holds only where that condition does (torch.export specializes sizes of 0 and 1, the "
            "sizes it computes from them included, and takes the example's side of a branch on them); call it with "
            "inputs that keep that condition, or place it again with an example on the side this call needs")
    if named and _declared(dynamic_dims, named.group(1), int(named.group(2))) and re.search(r"==\s*1\s*$", guard):
        return UsageError(  # "auto" keeps a dim of size one in the example as it was
            f"the placed model was traced for inputs with {guard}, which this call breaks: dim {named.group(2)} of "
            f"{named.group(1)!r} had size one in the example, and torch.export fixes a size of 0 or 1 (dynamic_dims="
            "'auto' keeps it so); place it again with an example of size 2 or more there (the placed model then "
            "serves size one too)")
    if named and _declared(dynamic_dims, named.group(1), int(named.group(2))):
        return UsageError(
            f"the placed model was traced for inputs with {guard}, which this call breaks: dim {named.group(2)} of "
            f"{named.group(1)!r} was asked dynamic, but the model's code fixed it while tracing (a branch on its size, "
            "or a Python number computed from it, such as math.sqrt(x.shape[1]) or x.shape[1] % 2); call it with "
            "inputs that keep that condition, or compute with the size as a tensor or torch.sym_* function and no "
            "branch on it, and place it again")
    example = f"dynamic_dims={{{named.group(1)!r}: [{named.group(2)}]}}" if named else "dynamic_dims={input: [dims]}"
    return UsageError(
        f"the placed model was traced for inputs with {guard}, which this call breaks; declare the dimensions that "
        f"vary when placing (place(..., {example}) or dynamic_dims='auto'), or place the model again with an "
        "example of this shape")


def _declared(dynamic_dims: Any, name: str, dim: int) -> bool:
    """Whether ``dynamic_dims`` (a placement's) asked dim ``dim`` of input ``name`` dynamic:
    ``"auto"`` asks for every dim that varies."""
    if dynamic_dims == "auto":
        return True
    if not isinstance(dynamic_dims, Mapping):
        return False
    dims = dynamic_dims.get(name)
    try:
        return dims is not None and dim in {int(d) for d in dims}
    except (TypeError, ValueError):
        return False


def _holds_tensor(value: Any, depth: int = 4) -> bool:
    """Whether a value the pytree took for a leaf holds a tensor: in its dataclass fields or its
    attributes, or in containers of them (``depth`` levels down)."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (str, bytes, type)):
        return False
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif dataclasses.is_dataclass(value):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__"):
        items = vars(value).values()
    else:
        return False
    return any(_holds_tensor(item, depth - 1) for item in items)


def _same_value(a: Any, b: Any) -> bool:
    """Whether two non-tensor outputs are the same value (not comparable: taken as the same)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable ==
        return True


def output_spec(runs: Runs) -> pytree.TreeSpec | None:
    """The model's output structure where its trace returns the same leaves under the same keys in
    other containers (fx returns a ``dict`` for a ``ModelOutput`` or an ``OrderedDict``), for the
    placed model to return the model's; ``None`` where they agree or cannot be compared."""
    if runs.model is None:
        return None
    try:
        eager, graph = runs.eager(1), runs.graph(1)
    except Exception:  # noqa: BLE001 - the checks that need these runs say why
        return None
    (mine, spec), (theirs, graph_spec) = pytree.tree_flatten_with_path(eager), pytree.tree_flatten_with_path(graph)
    if spec == graph_spec or [pytree.keystr(p) for p, _ in mine] != [pytree.keystr(p) for p, _ in theirs]:
        return None
    return spec


def check_rows_apart(runs: Runs) -> None:
    """For training with micro-batches: refuse a model whose rows along dim 0 are not samples. A
    training graph mixes the samples of a micro-batch by design (batch statistics), so
    :func:`check_split` checks it by shape only; in eval mode (running statistics, no dropout) the
    model itself must compute the example's last sample alone as beside the one before it, or dim 0
    is not its batch (a sequence first, as ``nn.TransformerEncoder`` keeps by default) and
    micro-batches would cut something else than samples.

    Raises:
        MicrobatchError: naming the output and what to do.
    """
    model = runs.model
    if model is None or not runs.batch or runs.batch < 2:
        return
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        both, single = runs.eager(2), runs.eager(1)
    except Exception:  # noqa: BLE001 - the eval-mode model needs more rows: the training checks say what it needs
        return
    finally:
        for m, was in modes.items():
            m.training = was
    pairs, _ = pytree.tree_flatten_with_path(both)
    alone = pytree.tree_leaves(single)
    if len(pairs) != len(alone):
        return
    for (path, pair), one in zip(pairs, alone):
        if (isinstance(pair, torch.Tensor) and isinstance(one, torch.Tensor) and pair.dim() > 0 and one.dim() > 0
                and pair.shape[0] == 2 * one.shape[0] and pair.shape[1:] == one.shape[1:]):
            what = f"in eval mode, model output {pytree.keystr(path)}" if path else "in eval mode, the model's output"
            _check_output(what, pair, one, 1, values=True)


def joined_outputs(runs: Runs, m: int) -> tuple[bool, ...] | MicrobatchError | None:
    """:func:`check_split` for a pipeline that runs ``m`` micro-batches, or two where it runs one
    (its ``microbatches`` may be raised later): then a refusal is returned, not raised, for the
    placed model to raise if it is run split.

    Raises:
        MicrobatchError: micro-batches cannot reproduce an output, and ``m > 1``.
    """
    try:
        return check_split(runs, max(m, 2))
    except MicrobatchError as error:
        if m > 1:
            raise
        return error


def state_written_per_microbatch(written: Sequence[str], m: int | str) -> MicrobatchError:
    """The refusal of an inference pipeline whose graph writes the model's state (``written``: a
    buffer it updates in forward, a counter or a running average): each micro-batch would update
    it, ``m`` times per call where the model updates it once. Returned for ``m`` of 1 or
    ``"auto"`` (the placed model raises it if run split), else raised.

    Raises:
        MicrobatchError: for ``m > 1``.
    """
    names = ", ".join(repr(n) for n in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    error = MicrobatchError(
        f"the model writes {names} in forward: split into micro-batches, each call would update "
        f"{'it' if len(written) == 1 else 'them'} once per micro-batch where the model does once per call; "
        "place it with microbatches=1 (or 'auto'), or update the state outside forward")
    if isinstance(m, int) and m > 1:
        raise error
    return error


def rows_needed(runs: Runs) -> int:
    """The fewest samples the traced graph computes the model's outputs on: 1, or 2 where the model
    does something else for a single sample than its trace does. ``torch.export`` traces the batch
    as 2 or more (it specializes sizes 0 and 1) and drops what ``if x.shape[0] == 1:`` guards,
    without a guard: the graph then runs on one sample and silently computes the other branch.
    And a model may refuse one sample where its trace computes (batch norm in training mode, whose
    check a trace does not keep). Checked by running both on the example's last sample, and where
    they differ, on its last two.

    Raises:
        TraceError: they differ on two samples too: the trace is not the model, whatever the batch.
    """
    if not runs.batch:
        return 1
    try:
        graph = runs.graph(1)
    except Exception:  # noqa: BLE001 - a trace that does not run on one sample: the micro-batch checks say so
        return 1
    try:
        differs = _difference(runs.eager(1), graph)
    except Exception:  # noqa: BLE001 - the model refuses one sample: so must the placed model
        return 2
    if differs is None:
        return 1
    if runs.batch < 2:
        return 2
    try:
        still = _difference(runs.eager(2), runs.graph(2))
    except Exception:  # noqa: BLE001
        return 2
    if still is not None:
        raise TraceError(
            f"the traced model's output differs from the model's ({still}), on one sample and on two: the model runs "
            "code its trace does not (a fused fast path: nn.TransformerEncoder's nested tensors with a padding mask "
            "take one, so build it with enable_nested_tensor=False or call "
            "torch.backends.mha.set_fastpath_enabled(False); or Python that branches on tensor values); placing it "
            "would change its outputs")
    return 2


def check_rows(args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int, rows: int, *,
               fix: str = "placed.microbatches") -> None:
    """Refuse a call (or the example, ``fix="microbatches"``) whose batch, or whose micro-batches,
    hold fewer than ``rows`` samples (:func:`rows_needed`).

    Raises:
        UsageError: the batch is smaller than ``rows``.
        MicrobatchError: the micro-batches are.
    """
    if rows == 1:
        return
    try:
        batch = batch_size(args, kwargs)
    except ValueError:
        return
    if not batch or batch // min(microbatches, batch) >= rows:
        return
    why = ("the model does not compute for a single sample what its trace does (it refuses one, as batch norm in "
           "training mode does, or torch.export traced the batch as 2 or more and dropped what `if x.shape[0] == 1:` "
           "guards)")
    if batch < rows:
        raise UsageError(f"{why}: call it with {rows} or more samples (and place it with an example of {rows} or more)")
    most = batch // rows
    raise MicrobatchError(f"{why}: {microbatches} micro-batches of {batch} samples would hold one each; set {fix} "
                          f"to {most}{' or fewer' if most > 1 else ''}")


def dims_of_one(runs: Runs) -> tuple[tuple[str, int], ...]:
    """``(input, dim)`` of the dynamic dimensions other than the batch (the graph's placeholders,
    as ``dynamic_dims`` made them) where the trace computes something else at size one than the
    model: the model and its graph both run on the example's last samples with every input of
    that size cut to one along it. A dimension where the model itself fails at size one is not
    listed (a call there fails as the model's does).
    """
    if runs.model is None:
        return ()
    call = runs.last(min(2, runs.batch or 1))
    bound = bind_placeholders(runs.gm, *call)
    out: list[tuple[str, int]] = []
    for where in symbolic_sizes(runs.gm)[1].values():
        cut = {id(bound[name]): dim for name, dim in where if isinstance(bound.get(name), torch.Tensor)}
        short = pytree.tree_map_only(torch.Tensor, lambda t: t.narrow(cut[id(t)], 0, 1) if id(t) in cut else t, call)
        try:
            model = runs.run(True, short)
        except Exception:  # noqa: BLE001 - the model does not run at size one either
            continue
        try:
            differs = _difference(model, runs.run(False, short))
        except Exception as error:  # noqa: BLE001 - the graph fails where the model does not
            differs = f"its trace fails: {type(error).__name__}"
        if differs is not None:
            out.extend(where)
    return tuple(out)


@dataclass(frozen=True)
class CallSizes:
    """What a call must be for the trace to compute the model's outputs: at least ``rows``
    samples per call and micro-batch (:func:`rows_needed`), none of the ``(input, dim)`` of
    ``ones`` of size one (:func:`dims_of_one`), a tensor for each input in ``tensors``, and
    ``None`` for each input in ``nones`` (an fx trace takes the branches of ``None`` there:
    :func:`~torchplace.profiling.trace.example_nones`). Inputs are placeholders of ``gm``;
    :func:`call_sizes` reads the last two from the example. ``dynamic_dims``: the placement's
    (:mod:`torchplace.profiling.dynamic`), for :func:`guard_error`."""

    rows: int = 1
    ones: tuple[tuple[str, int], ...] = ()
    gm: fx.GraphModule | None = field(default=None, compare=False, repr=False)
    tensors: tuple[str, ...] = ()
    nones: tuple[str, ...] = ()
    dynamic_dims: Any = field(default=None, compare=False, repr=False)

    def check(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int, *,
              fix: str = "placed.microbatches") -> None:
        """Refuse a call whose inputs the trace does not compute as the model does.

        Raises:
            UsageError: the batch is smaller than ``rows``, a dim of ``ones`` has size one, or an
                input is not a tensor where the example's was, or not ``None`` where the example's was.
            MicrobatchError: the micro-batches hold fewer than ``rows`` samples.
        """
        check_rows(args, kwargs, microbatches, self.rows, fix=fix)
        if self.gm is None or not (self.ones or self.tensors or self.nones):
            return
        bound = bind_call(self.gm, args, kwargs)
        self._check_kinds(bound)
        self._check_ones(bound)

    def check_fixed(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a call whose inputs break a size the exported graph fixed (a sequence length
        not declared dynamic), as its guard would, or a kind or constant :meth:`check` refuses,
        for runtimes that run no guard before they communicate (``torch.distributed.pipelining``).

        Raises:
            UsageError: naming the input and what to do (:func:`guard_error` for a size).
        """
        if self.gm is None:
            return
        bound = bind_call(self.gm, args, kwargs)
        self._check_kinds(bound)
        for node in self.gm.graph.find_nodes(op="placeholder"):
            example, value = node.meta.get("val"), bound.get(node.name)
            if not isinstance(example, torch.Tensor) or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != example.dim():
                raise UsageError(f"input {node.name!r} has {value.dim()} dims, but the placed model was traced with "
                                 f"{example.dim()}: call it with inputs shaped as the example")
            for dim, size in enumerate(example.shape):
                if isinstance(size, int) and value.shape[dim] != size:
                    raise guard_error(f"{node.name}.size()[{dim}] == {size}", self.dynamic_dims)

    def _check_kinds(self, bound: Mapping[str, Any]) -> None:
        """Refuse a non-tensor for an input of ``tensors``, and a value for one of ``nones``."""
        names = {n.name: str(n.target) for n in self.gm.graph.find_nodes(op="placeholder")}  # type: ignore[union-attr]
        for name in self.tensors:
            value = bound.get(name)
            if name in bound and not isinstance(value, torch.Tensor):
                raise UsageError(
                    f"input {names.get(name, name)!r} is {brief(value)}, but the example gave a tensor and the placed "
                    "model's trace reads one (a model that branches on `is None` traced only the example's branch): "
                    "call it with a tensor there, or place the model again with an example that leaves it out")
        for node in self.gm.graph.find_nodes(op="placeholder"):  # type: ignore[union-attr]
            example, value = node.meta.get("val"), bound.get(node.name)
            if isinstance(example, torch.Tensor) and isinstance(value, torch.Tensor) and value.dtype != example.dtype:
                raise UsageError(  # torch.export asserts its inputs' dtypes inside the graph, mid-call
                    f"input {names.get(node.name, node.name)!r} is {value.dtype}, but the placed model was traced with "
                    f"{example.dtype} there (torch.export fixes the dtype of every input): convert it "
                    f"(.to({example.dtype})), or place the model again with an example of that dtype")
        for name in self.nones:
            value = bound.get(name)
            if name in bound and value is not None:
                what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else brief(value)
                raise UsageError(
                    f"input {names.get(name, name)!r} is {what}, but the placed model was traced with None there (the "
                    "example's value, or the default it left), and holds only the code the model runs without it: "
                    "leave it out, or place the model again with an example that gives it")

    def _check_ones(self, bound: Mapping[str, Any]) -> None:
        """Refuse a size of one in a dim of ``ones`` (``bound``: the call by placeholder)."""
        for name, dim in self.ones:
            value = bound.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == 1:
                raise UsageError(
                    f"the model computes other outputs when dim {dim} of {name!r} has size one than its trace does "
                    "(torch.export traces dynamic sizes as 2 or more and drops what `if x.shape[1] == 1:` guards): "
                    f"call it with a size of 2 or more there, or place another model for size one (an example of "
                    "that size, without that dim in dynamic_dims)")


def call_sizes(rows: int, ones: tuple[tuple[str, int], ...], gm: fx.GraphModule, args: tuple[Any, ...],
               kwargs: Mapping[str, Any], dynamic_dims: Any = None) -> CallSizes:
    """The :class:`CallSizes` of a trace ``gm`` of the example ``(args, kwargs)``: its inputs that
    were tensors, and those that were ``None`` (an fx trace takes the branches of ``None`` there;
    an exported graph has no placeholder for one)."""
    bound = bind_placeholders(gm, args, kwargs)
    tensors = tuple(name for name, value in bound.items() if isinstance(value, torch.Tensor))
    return CallSizes(rows, ones, gm, tensors, tuple(name for name, value in bound.items() if value is None),
                     dynamic_dims)


def _difference(theirs: Any, mine: Any) -> str | None:
    """Where two outputs differ beyond rounding (a phrase), or ``None``."""
    a_leaves, b_leaves = pytree.tree_leaves(theirs), pytree.tree_leaves(mine)
    if len(a_leaves) != len(b_leaves):
        return f"{len(b_leaves)} parts where the model has {len(a_leaves)}"
    for i, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"part {i} is {type(b).__name__} where the model's is {type(a).__name__}"
        if not isinstance(a, torch.Tensor):
            continue
        a, b = a.detach(), b.detach()  # a parameter the model returns
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"part {i} is {tuple(b.shape)} {b.dtype} where the model's is {tuple(a.shape)} {a.dtype}"
        if not a.numel():
            continue
        if a.is_floating_point():
            scale = max(float(a.abs().max()), 1.0)
            tolerance = 1e-4 if a.dtype in TOLERANCE else HALF_TOLERANCE
            if not torch.allclose(a, b, rtol=tolerance, atol=tolerance * 1e-2 * scale, equal_nan=True):
                return f"part {i} by {float((a.double() - b.double()).abs().max()):.3g}"
        elif not torch.equal(a, b):
            return f"part {i} in {int((a != b).sum())} elements"
    return None


def _copies(call: tuple[tuple[Any, ...], Mapping[str, Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh copies of a call's tensors (a forward may write its inputs)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), (tuple(call[0]), dict(call[1])))


def _run(module: torch.nn.Module, inputs: Any, call: bool = False, interpreter: Interpreter | None = None) -> Any:
    """The graph's output on ``inputs`` (its flat placeholders; run by ``interpreter`` where given),
    or with ``call`` the module's on ``inputs = (args, kwargs)``; its buffers left as they were."""
    snapshot = StateSnapshot(module)
    try:
        with torch.no_grad():
            if call:
                return module(*inputs[0], **inputs[1])
            return run_graph(module, inputs) if interpreter is None else interpreter.run(*inputs)  # type: ignore[arg-type]
    finally:
        snapshot.restore()


def _check_output(what: str, both: torch.Tensor, single: Any, rows: int, *, values: bool,
                  recheck: _Recheck | None = None) -> None:
    """Refuse an output that reads the batch but is not its parts joined along dim 0: ``both`` on
    ``2 rows`` samples, ``single`` on the last ``rows`` of them. Where the two differ by more
    than rounding at the output's own scale, ``recheck`` (the graph's runs) may still show that
    the difference is rounding (:meth:`_Recheck.rounding_only`)."""
    advice = "place it with microbatches=1"
    if not isinstance(single, torch.Tensor) or both.dim() == 0 or single.dim() == 0:
        inside = ("; a loss the model computes itself (Hugging Face's labels=) is one too: leave the labels out of the "
                  "inputs and pass the loss to training, placed.step(..., target=labels, loss_fn=f)"
                  if "loss" in what.lower() else "")
        raise MicrobatchError(f"{what} is a scalar computed from the batch (a reduction over it?): micro-batches "
                              f"give one each, not the batch's; {advice}, or return it per sample{inside}")
    if both.shape[1:] != single.shape[1:] or both.shape[0] != 2 * single.shape[0]:
        raise MicrobatchError(f"{what} has shape {tuple(both.shape)} for {2 * rows} samples and {tuple(single.shape)} "
                              f"for {rows}: its dim 0 is not the batch, so micro-batches cannot be joined into it; "
                              f"{advice}, or return the batch first")
    if not values or both.numel() == 0 or single.dtype != both.dtype:
        return
    mixes = (f"{what} for the example's last {rows} sample{'s' if rows > 1 else ''} alone differs from the same "
             f"rows computed beside {rows} more")
    tail = both[single.shape[0]:]
    if not (both.is_floating_point() or both.is_complex()):  # exact: nothing to round
        if not torch.equal(tail, single):
            raise MicrobatchError(f"{mixes}: the model mixes the samples of a batch; {advice}")
        return
    finite = tail.isfinite()
    if not torch.equal(finite, single.isfinite()) or not same_values(tail[~finite], single[~finite]):
        raise MicrobatchError(f"{mixes} in which values are inf or nan: the model mixes the samples of a batch (or "
                              f"overflows on one batch size only); {advice}")
    wide = torch.complex128 if both.is_complex() else torch.float64
    tail, single = tail[finite].to(wide), single[finite].to(wide)
    scale = float(tail.abs().max()) if tail.numel() else 0.0
    diff = float((tail - single).abs().max()) if tail.numel() else 0.0
    tolerance = TOLERANCE.get(both.real.dtype if both.is_complex() else both.dtype, HALF_TOLERANCE)
    if diff > tolerance * (scale or 1.0):
        if recheck is not None and recheck.rounding_only(both, diff, tolerance):
            return
        raise MicrobatchError(
            f"{mixes} by {diff:.3g} (values up to {scale:.3g}): the model mixes the samples "
            f"of a batch (batch statistics, a reduction or attention over dim 0, the sequence first where the batch "
            f"should be); {advice}, or put the batch first (e.g. batch_first=True)")


@dataclass(frozen=True)
class _Recheck:
    """Output leaf ``index`` (``tree_flatten`` order) of the graph's runs on the example's last
    ``rows`` samples alone and beside ``rows`` more, looked at again where the two differ by more
    than rounding relative to the output's own largest value.

    That happens without mixing samples where the output is rounding noise itself: ``a(x) - b(x)``,
    ``b`` the same map by another kernel, which a batch of another size may pick. Its scale is
    then not the output's but its operands' (:func:`_operand_scale`)."""

    runs: Runs
    rows: int
    index: int

    def rounding_only(self, both: torch.Tensor, diff: float, tolerance: float) -> bool:
        """Whether ``diff``, the largest difference between the rows alone and in ``both`` (on
        twice the rows), is rounding: the rows do not change beside a copy of themselves (the
        batch of ``both``, so the same kernels: a change means they mix), and ``diff`` is within
        ``tolerance`` of the largest operand of the operation that computes the output. A
        threshold or branch on the noise (``torch.where(noise.abs() > eps, y, -y)``) turns it
        into a difference as large as its operands, and is refused. A run that fails counts as
        mixing: the refusal stands."""
        rows = self.rows
        try:
            copy = pytree.tree_leaves(self.runs.beside_copy(rows))
            if len(copy) <= self.index or not isinstance(copy[self.index], torch.Tensor):
                return False
            other = copy[self.index]
            if other.shape != both.shape or other.dtype != both.dtype:
                return False
            if not same_values(both[both.shape[0] - rows:], other[other.shape[0] - rows:]):
                return False
            scale = _operand_scale(self.runs.gm, self.runs.magnitudes(2 * rows), self.index)
        except Exception:  # noqa: BLE001 - a run that fails: the refusal stands
            return False
        return diff <= tolerance * scale


def _operand_scale(gm: fx.GraphModule, largest: Mapping[fx.Node, float], index: int) -> float:
    """The largest magnitude among the values output leaf ``index`` of ``gm`` is computed from:
    the output, the nodes it comes from through operations of one floating-point operand (views,
    casts, scaling, unary functions), and the operands of the first operation with several
    (the subtraction where a difference cancels); ``largest``: :meth:`Runs.magnitudes`."""
    leaves = pytree.tree_leaves(gm.graph.find_nodes(op="output")[0].args[0])
    node = leaves[index] if index < len(leaves) else None
    seen = [0.0]
    for _ in range(64):
        if not isinstance(node, fx.Node) or node not in largest:
            break
        seen.append(largest[node])
        operands = [a for a in node.all_input_nodes if a in largest]
        if len(operands) != 1:
            seen += [largest[a] for a in operands]
            break
        node = operands[0]
    return max(seen)


def reads_batch(gm: fx.GraphModule, flat: Sequence[Any], batch: int, count: int) -> list[bool]:
    """Per output leaf (``count`` of them, ``tree_flatten`` order of the graph's output), whether
    it reads a batched input (a placeholder with ``batch`` rows, or an fx placeholder holding a
    tensor with them): its values, or its size along dim 0 (``torch.zeros(x.shape[0])`` has the
    batch's rows); reading another dimension's size does not count (:func:`_size_query`). All
    ``True`` where the graph's output does not flatten to ``count``."""
    batched = {n for n, v in zip(gm.graph.find_nodes(op="placeholder"), flat)  # an fx placeholder may be a dict
               if any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch for t in pytree.tree_leaves(v))}
    reads: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n in batched or (not _size_query(n) and any(a in reads for a in n.all_input_nodes)):
            reads.add(n)
    leaves = pytree.tree_leaves(gm.graph.find_nodes(op="output")[0].args[0])
    if len(leaves) != count:
        return [True] * count
    return [isinstance(leaf, fx.Node) and leaf in reads for leaf in leaves]


_SCALAR_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "_local_scalar_dense"}


def _scalar_of_values(gm: fx.GraphModule, index: int) -> bool:
    """Whether output leaf ``index`` (a non-tensor; the leaf order :func:`reads_batch` checked) is,
    or is computed from, a number read out of a tensor's values (``.item()``, ``.tolist()``,
    ``aten._local_scalar_dense``)."""
    leaves = pytree.tree_leaves(gm.graph.find_nodes(op="output")[0].args[0])
    node = leaves[index] if index < len(leaves) else None
    if not isinstance(node, fx.Node):
        return False
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        if name.split(".")[0] in _SCALAR_READS:
            return True
        info = n.meta.get("torchplace")  # an fx node's outputs (an exported one has meta["val"])
        if isinstance(n.meta.get("val"), torch.Tensor) or (info is not None and info.shapes):
            continue  # a tensor: the scalar read is below it, not past it
        frontier.extend(n.all_input_nodes)
    return False


def _size_query(n: fx.Node) -> bool:
    """A node that reads no value of its tensor and no size its batch sets: ``x.size(d)`` or
    ``aten.sym_size(x, d)`` for ``d != 0``, ``x.dim()``."""
    if n.op == "call_method":
        return n.target == "dim" or (n.target == "size" and _not_dim_0(n.args[1:2] or [n.kwargs.get("dim")]))
    if n.op == "call_function":
        name = getattr(n.target, "__name__", str(n.target))
        return name.split(".")[0] == "sym_size" and _not_dim_0(n.args[1:2] or [n.kwargs.get("dim")])
    return False


def _not_dim_0(dims: Sequence[Any]) -> bool:
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] != 0
