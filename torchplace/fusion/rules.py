"""Fusion rules: the operator sequences an inference backend fuses into one kernel.

MOIRAI (Zhang et al. 2023, Sec. III-B) coarsens a graph with *fusion rules*: "a sequence of ordered
operator types", taken from the design specifications of inference backends; its Table I lists
Eigen's ``conv, bn``, ``conv, bn, relu`` and ``conv, bn, add, relu``. :data:`DEFAULT_RULES` holds
those three and the usual TensorRT / cuDNN / TVM patterns around them (convolution or GEMM with
its bias, normalisation, activation, dropout and residual add; residual add + layer norm; scaled
softmax).

Operator strings differ by capture method: ``"call_function:aten.convolution.default"``,
``"call_function:aten.conv2d.default"``, ``"call_module:Conv2d"``,
``"call_function:torch._C._nn.linear"``, ``"call_method:relu_"``. :func:`op_kind` maps every one
of them to one short *kind* (``"conv"``, ``"linear"``, ``"relu"``, ...), and rules are written in
kinds, so one rule matches every spelling.

Besides the rules, TVM's fusion (Chen et al. 2018, Sec. 3, "injective" operators) fuses
element-wise and layout operators into a neighbour; :data:`INJECTIVE` and :data:`LAYOUT` name those
kinds for :func:`torchplace.fusion.gcof.fuse_injective`.

Example:
    >>> op_kind("call_function:aten._native_batch_norm_legit_no_training.default")
    'batch_norm'
    >>> op_kind("call_module:Conv2d"), op_kind("call_method:relu_")
    ('conv', 'relu')
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_RULES",
    "GEMM",
    "INJECTIVE",
    "LAYOUT",
    "MOIRAI_TABLE_I",
    "Rule",
    "expand_rules",
    "op_kind",
]

# -- kinds ----------------------------------------------------------------------------------------
_ALIASES: dict[str, str] = {
    **dict.fromkeys(
        ("convolution", "convolution_overrideable", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
         "conv_transpose2d", "conv_transpose3d", "convtranspose1d", "convtranspose2d", "convtranspose3d",
         "cudnn_convolution", "mkldnn_convolution"), "conv"),
    **dict.fromkeys(
        ("native_batch_norm", "native_batch_norm_legit", "native_batch_norm_legit_no_training",
         "native_batch_norm_legit_functional", "batch_norm_impl_index", "cudnn_batch_norm",
         "miopen_batch_norm", "batchnorm1d", "batchnorm2d", "batchnorm3d", "syncbatchnorm"), "batch_norm"),
    **dict.fromkeys(("native_layer_norm", "layernorm"), "layer_norm"),
    **dict.fromkeys(("native_group_norm", "groupnorm"), "group_norm"),
    **dict.fromkeys(("rmsnorm",), "rms_norm"),
    **dict.fromkeys(("iadd", "add"), "add"),
    **dict.fromkeys(("isub", "sub", "rsub"), "sub"),
    **dict.fromkeys(("imul", "mul"), "mul"),
    **dict.fromkeys(("truediv", "itruediv", "div"), "div"),
    **dict.fromkeys(("hardtanh", "relu6"), "relu6"),
    **dict.fromkeys(("leakyrelu",), "leaky_relu"),
    **dict.fromkeys(("newgeluactivation", "geluactivation", "gelutanh", "fastgeluactivation"), "gelu"),
    **dict.fromkeys(("native_dropout", "feature_dropout", "alpha_dropout", "dropout1d", "dropout2d",
                     "dropout3d"), "dropout"),
    **dict.fromkeys(("safe_softmax", "log_softmax"), "softmax"),
    **dict.fromkeys(("scaled_dot_product_flash_attention", "scaled_dot_product_efficient_attention",
                     "scaled_dot_product_cudnn_attention", "scaled_dot_product_flash_attention_for_cpu",
                     "scaled_dot_product_attention"), "sdpa"),
    **dict.fromkeys(("unsafe_view", "view_as", "reshape_as", "expand_as", "flatten", "unflatten",
                     "transpose", "t", "permute", "squeeze", "unsqueeze", "contiguous", "expand",
                     "getitem", "select", "slice", "narrow", "split", "split_with_sizes", "chunk",
                     "unbind", "alias", "detach", "identity", "clone", "reshape", "view"), "view"),
}
# Module class names whose lower-case spelling would collide with another kind.
_CLASS_ALIASES: dict[str, str] = {"Conv1D": "linear"}  # transformers' Conv1D is a (transposed) Linear

GEMM = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm"})
"""Matrix-multiply kinds (a Linear, with or without its bias folded in)."""
ACTIVATIONS = frozenset(
    {"relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu",
     "elu", "mish", "softplus"}
)
"""Point-wise activation kinds a backend folds into the producing kernel's epilogue."""
LAYOUT = frozenset({"view"})
"""Kinds that only re-index memory (every view/reshape/transpose/getitem spelling maps to ``view``)."""
INJECTIVE = LAYOUT | ACTIVATIONS | frozenset(
    {"add", "sub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "abs", "clamp",
     "maximum", "minimum", "reciprocal", "erf", "where", "masked_fill", "dropout", "to_copy", "to"}
)
"""Element-wise or layout kinds: TVM's "injective" operators, fusable into a neighbour."""

_PREFIXES = ("call_function", "call_method", "call_module")
_NAMESPACES = ("aten", "prims", "quantized")


def op_kind(op: str) -> str:
    """The normalised kind of an operator string (the one place op names are interpreted).

    ``"call_function:aten.relu_.default"`` -> ``"relu"``; ``"call_module:BatchNorm2d"`` ->
    ``"batch_norm"``; ``"call_function:_operator.getitem"`` -> ``"view"``. Namespaced targets keep
    the name after ``aten.`` (dropping the overload), others their last dotted part; leading and
    trailing underscores (private and in-place spellings) are dropped and aliases applied. Strings
    of fused groups (``"fused:..."``, ``"group:..."``) are kind ``"fused"``; an unknown name is
    returned lower-cased, so it matches no rule.
    """
    prefix, sep, target = op.partition(":")
    if sep and prefix not in _PREFIXES:
        return "fused"
    if not sep:
        target = op
    if prefix == "call_module":
        if target in _CLASS_ALIASES:
            return _CLASS_ALIASES[target]
        name = target
    else:
        parts = target.split(".")
        ns = next((i for i, p in enumerate(parts[:-1]) if p in _NAMESPACES), None)
        name = parts[ns + 1] if ns is not None else parts[-1]
    name = name.strip("_").lower()
    return _ALIASES.get(name, name)


# -- rules ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """An ordered list of operator kinds fused into one operator (MOIRAI Sec. III-B, ``r_i``).

    Attributes:
        name: the fused type, the kinds joined by ``+`` (MOIRAI writes ``conv o bn``).
        steps: one kind per position; element order is the precedence of the fused operators.
    """

    name: str
    steps: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.steps)


def expand_rules(*patterns: Sequence[str | Iterable[str]]) -> tuple[Rule, ...]:
    """Rules from patterns whose positions are a kind or a set of alternative kinds.

    Example:
        >>> [r.name for r in expand_rules(("conv", ("relu", "gelu")))]
        ['conv+gelu', 'conv+relu']
    """
    rules = []
    for pattern in patterns:
        choices = [[p] if isinstance(p, str) else sorted(p) for p in pattern]
        if len(choices) < 2:
            raise ValueError(f"a fusion rule needs at least two operators, got {pattern!r}")
        for steps in itertools.product(*choices):
            rules.append(Rule("+".join(steps), tuple(steps)))
    return tuple(dict.fromkeys(rules))


MOIRAI_TABLE_I: tuple[Rule, ...] = expand_rules(
    ("conv", "batch_norm"),  # r1
    ("conv", "batch_norm", "relu"),  # r2
    ("conv", "batch_norm", "add", "relu"),  # r3
)
"""MOIRAI Table I: Eigen's fusion rules on a GPU kernel, the paper's examples."""

_SCALE = ("mul", "div")
DEFAULT_RULES: tuple[Rule, ...] = expand_rules(
    *(r.steps for r in MOIRAI_TABLE_I),
    # cuDNN / TensorRT convolution epilogues: bias, residual add, any activation.
    ("conv", "batch_norm", ACTIVATIONS),
    ("conv", "batch_norm", "add", ACTIVATIONS),
    ("conv", ACTIVATIONS),
    ("conv", "add"),
    ("conv", "add", ACTIVATIONS),
    ("batch_norm", ACTIVATIONS),
    ("add", ACTIVATIONS),
    # GEMM epilogues (TensorRT / cuBLASLt): bias, activation, dropout, residual add, layer norm.
    (GEMM, "add"),
    (GEMM, ACTIVATIONS),
    (GEMM, "add", ACTIVATIONS),
    (GEMM, "dropout"),
    (GEMM, ACTIVATIONS, "dropout"),
    (GEMM, "dropout", "add"),
    (GEMM, "add", "layer_norm"),
    (GEMM, "dropout", "add", "layer_norm"),
    (ACTIVATIONS, "dropout"),
    # Residual add + normalisation ("skip layer norm") and bias-dropout-add.
    ("add", "layer_norm"),
    ("add", "rms_norm"),
    ("dropout", "add"),
    ("dropout", "add", "layer_norm"),
    # Attention scores: (matmul,) scale, (mask,) softmax.
    (GEMM, "softmax"),
    (GEMM, _SCALE, "softmax"),
    (GEMM, _SCALE, "add", "softmax"),
    (_SCALE, "softmax"),
    ("add", "softmax"),
)
"""MOIRAI Table I plus common TensorRT / cuDNN / TVM fusion patterns, in :func:`op_kind` kinds."""

