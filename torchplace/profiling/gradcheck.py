"""Does the traced graph differentiate as the model does?

A trace keeps the operators a forward runs, not the autograd state around them. A
``with torch.no_grad():`` block inside ``forward`` (fx never records it; ``torch.export`` drops it
when the trace runs without grad), a gradient hook registered on a tensor, or an autograd mode
switched in ``forward`` would give the placed model other gradients than the model's, silently.
``place(..., mode="training")`` therefore runs the model and its traced graph forward and
backward on the example's last two samples (:func:`check_gradients`) and refuses a trace whose
gradients differ: the parameters', and those of the example's inputs that require grad. Both runs
start from one random seed, so dropout draws the same masks, and the model's buffers (BatchNorm's
statistics) are put back after each. The traced run also tells whether the graph draws random
numbers at all (the generator advanced): wherever it hides them (a leaf module's functional
dropout, ``scaled_dot_product_attention``'s ``dropout_p``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.errors import TraceError
from torchplace.fxutil import flat_inputs, run_graph
from torchplace.profiling.effects import StateSnapshot
from torchplace.runtime.microbatch import batch_size, last_rows

__all__ = ["check_gradients"]

RTOL = {torch.float64: 1e-5, torch.float32: 1e-5}
"""Largest gradient difference, relative to the gradient's largest value, that counts as rounding
(the traced graph may decompose an operator differently; GPT-2, BERT and Llama with dropout give
bitwise equal fp32 gradients, and Llama with grouped-query attention 1e-9 apart: traced, it gets
an explicit causal mask, so ``sdpa`` repeats the key/value heads instead of its GQA kernel); ``HALF_RTOL`` for 16-bit floats (bf16 gradients of a tiny Llama
differ by 3e-3 to 1e-2 this way). A lost ``no_grad`` block differed by 2e-4 to 1e-2 in the
fuzzer's models."""

HALF_RTOL = 5e-2

KEEP_WHOLE = ("keep the module that does it whole (trace_method='fx' with leaf_modules=(ThatModule,): a leaf runs "
              "as the module does, autograd modes and hooks included; a parametrization such as spectral_norm is "
              "kept whole with the module it belongs to)")
"""The advice both refusals give: a module fx keeps whole is called, not traced through."""

_SEED = 20261124


def check_gradients(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    microbatches: int = 1) -> bool:
    """Refuse a traced graph ``gm`` whose gradients differ from ``model``'s on the example's last
    two samples (or one of its ``microbatches``, or all of it, where the model needs more): those of
    the parameters, and of the example's inputs that require grad (a model input's gradient passes
    through no parameter on its way: a no_grad block on the input alone changes only it).

    Returns:
        Whether the traced graph draws random numbers (its run advanced the generator): what a
        recomputed stage would draw again, differently.

    Raises:
        TraceError: a gradient differs, named, with what causes it and what to do.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    try:
        batch = batch_size(args, kwargs)
    except ValueError:
        batch = None
    sizes = [2, batch // max(microbatches, 1), batch] if batch else [None]
    for n in dict.fromkeys(k for k in sizes if k is None or 0 < k <= batch):  # type: ignore[operator]
        few_args, few_kwargs = (args, kwargs) if n is None or n == batch else last_rows(args, kwargs, batch, n)
        weights: list[torch.Tensor | None] = []  # one random projection of the outputs, for both runs
        try:
            theirs, _ = _gradients(model, params, lambda a, k: model(*a, **k), few_args, few_kwargs, weights)
        except Exception:  # noqa: BLE001 - a model that needs more samples: try more
            continue
        try:
            mine, draws = _gradients(model, params, lambda a, k: run_graph(gm, flat_inputs(gm, a, k)), few_args,
                                     few_kwargs, weights)
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0]
            raise TraceError(
                f"the traced model fails forward or backward where the model does not ({type(error).__name__}: "
                f"{first}): its forward changes what autograd records (a torch.no_grad() block around an in-place "
                "write, a hook), which a trace does not keep. Use .detach() where the forward stops a gradient, "
                f"{KEEP_WHOLE}, or place the model for inference") from error
        break
    else:
        return False  # it runs on none of them here: the micro-batch checks say why
    if theirs is None:
        return draws  # nothing differentiable comes out: the placed model has nothing to differ in
    names = [repr(name) for name, _ in params] + [f"the input {name}" for name, _ in _wanting_grad(args, kwargs)]
    for name, a, b in zip(names, theirs, mine if mine is not None else [None] * len(names)):
        if a is None and b is None:
            continue
        a = a.to_dense() if a is not None and a.layout != torch.strided else a  # nn.Embedding(sparse=True)
        b = b.to_dense() if b is not None and b.layout != torch.strided else b
        a = torch.zeros_like(b) if a is None else a  # type: ignore[arg-type]
        b = torch.zeros_like(a) if b is None else b
        scale = float(a.abs().max()) if a.numel() else 0.0
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        if diff > RTOL.get(a.dtype, HALF_RTOL) * max(scale, 1e-12) and diff > 1e-12:
            raise TraceError(
                f"the traced model's gradient of {name} differs from the model's by {diff:.3g} (values up to "
                f"{scale:.3g}): its forward changes what autograd records (a torch.no_grad() or enable_grad block, "
                "a gradient hook on a tensor, requires_grad_, a torch.autograd.Function with a backward of its own "
                "such as a straight-through estimator), which a trace does not keep, or a module backward "
                "hook changes gradients (a traced graph makes no module calls, so it never runs). Use .detach() "
                "where the forward stops a gradient, move hooks out of forward (tensor hooks on the parameters, "
                f"p.register_hook, run), {KEEP_WHOLE}, or place the model for inference")
    return draws


def _gradients(model: nn.Module, params: Sequence[tuple[str, nn.Parameter]], run: Any, args: Sequence[Any],
               kwargs: Mapping[str, Any],
               weights: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None] | None, bool]:
    """The gradients of the parameters, then of the inputs that require grad, of a fixed random
    projection of the floating-point outputs of ``run(args, kwargs)`` on fresh copies of the inputs
    (``weights`` made on the first call, reused after), the model's state put back; and whether the
    run drew random numbers."""
    snapshot = StateSnapshot(model)
    devices = _cuda_devices(params)
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.manual_seed(_SEED)
            seeded = _generator_states(devices)
            args, kwargs = _fresh(args), _fresh(kwargs)
            inputs = [t for _, t in _wanting_grad(args, kwargs)]
            leaves = [t for t in pytree.tree_leaves(run(args, kwargs)) if isinstance(t, torch.Tensor)]
            draws = any(not torch.equal(a, b) for a, b in zip(seeded, _generator_states(devices)))
        if not weights:
            generator = torch.Generator().manual_seed(_SEED)
            weights.extend(torch.randn(t.shape, generator=generator).to(t.device, t.dtype)
                           if t.is_floating_point() and t.requires_grad else None for t in leaves)
        if len(weights) != len(leaves):
            return [None] * (len(params) + len(inputs)), draws  # another structure: compared against none
        terms = [(t * w).sum() for t, w in zip(leaves, weights) if w is not None and t.requires_grad]
        if not terms or not (params or inputs):
            return None, draws
        loss = terms[0]
        for term in terms[1:]:
            loss = loss + term.to(loss.device)
        # backward, not autograd.grad: reentrant checkpointing (use_reentrant=True) supports only the former
        kept = [p.grad for _, p in params]
        try:
            for _, p in params:
                p.grad = None
            loss.backward()
            return [p.grad for _, p in params] + [t.grad for t in inputs], draws
        finally:
            for (_, p), grad in zip(params, kept):
                p.grad = grad
    finally:
        snapshot.restore()


def _generator_states(cuda: Sequence[int]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in cuda)]


def _wanting_grad(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The input tensors that require grad, named by where they are in the call (``args[0]``,
    ``kwargs['x']``)."""
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return [(("args", "kwargs")[path[0].idx] + pytree.keystr(path[1:]), t)  # type: ignore[attr-defined]
            for path, t in paths if isinstance(t, torch.Tensor) and t.requires_grad]


def _fresh(value: Any) -> Any:
    """Copies of the tensors in ``value`` (a forward may write its inputs in place)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), value)


def _cuda_devices(params: Sequence[tuple[str, nn.Parameter]]) -> list[int]:
    return sorted({p.device.index or 0 for _, p in params if p.is_cuda})
