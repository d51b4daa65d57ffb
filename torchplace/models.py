"""Small example models for tests, benchmarks and the CLI (``torchplace plan MODEL``).

Every builder returns ``(model, example_inputs)`` with the model in eval mode, its weights drawn
from a seeded generator, and ``example_inputs`` a tuple ready for ``model(*example_inputs)``.

Example:
    >>> model, inputs = build("mlp", batch=2)
    >>> model(*inputs).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchplace.errors import UsageError
from torchplace.model_names import NAMES

__all__ = ["MLP", "NAMES", "InceptionBlock", "InceptionCNN", "ResidualBlock", "ResidualCNN", "build"]

Built = tuple[nn.Module, tuple[Any, ...]]


class MLP(nn.Module):
    """A stack of Linear + ReLU layers ending in a Linear classifier."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a skip connection (a 1x1 conv when the width changes)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.skip(x))


class ResidualCNN(nn.Module):
    """A tiny ResNet-like image classifier: stem, residual blocks, global pooling, classifier."""

    def __init__(self, channels: tuple[int, ...] = (8, 16, 16), n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels[0], 3, padding=1), nn.ReLU())
        blocks = [ResidualBlock(a, b) for a, b in itertools.pairwise(channels)]
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(y), 1))


class InceptionBlock(nn.Module):
    """Four parallel branches (1x1; 1x1->3x3; 1x1->5x5; pool->1x1) concatenated on channels.

    The branches are independent until the concatenation: the shape of GoogLeNet's Inception
    module (Szegedy et al. 2015), which a latency placement can run on several devices at once.
    """

    def __init__(self, c_in: int, c_branch: int) -> None:
        super().__init__()

        def conv(a: int, b: int, k: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(a, b, k, padding=k // 2), nn.BatchNorm2d(b), nn.ReLU())

        self.b1 = conv(c_in, c_branch, 1)
        self.b3 = nn.Sequential(conv(c_in, c_branch, 1), conv(c_branch, c_branch, 3))
        self.b5 = nn.Sequential(conv(c_in, c_branch, 1), conv(c_branch, c_branch, 5))
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), conv(c_in, c_branch, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class InceptionCNN(nn.Module):
    """A small Inception-style classifier: stem, two inception blocks, pooling, classifier."""

    def __init__(self, width: int = 16, n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(InceptionBlock(width, width), InceptionBlock(4 * width, width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _mlp(batch: int) -> Built:
    return MLP(), (torch.randn(batch, 32),)


def _resnet(batch: int) -> Built:
    return ResidualCNN(), (torch.randn(batch, 3, 16, 16),)


def _inception(batch: int) -> Built:
    return InceptionCNN(), (torch.randn(batch, 3, 32, 32),)


def _transformer(batch: int) -> Built:
    """A 2-layer ``nn.TransformerEncoder`` (d_model 32), batch first: inputs ``(batch, seq=8, 32)``.

    The SiLU activation keeps the layers off torch's fused inference "fast path"
    (``torch._transformer_encoder_layer_fwd``, taken in eval mode under ``no_grad`` for relu/gelu),
    which a traced graph does not reproduce bit for bit.
    """
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, batch_first=True, activation=nn.functional.silu
    )
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model, (torch.randn(batch, 8, 32),)


def _gpt2(batch: int) -> Built:
    """A 2-layer GPT-2 from a config (random weights, no download), ``use_cache=False``."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise ImportError(
            "the 'gpt2' example model needs transformers: pip install torchplace[examples]"
        ) from e
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False,
        bos_token_id=127, eos_token_id=127,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (batch, 16))
    return model, (ids,)


def _bert(batch: int) -> Built:
    """A 2-layer BERT encoder from a config (random weights, no download)."""
    try:
        from transformers import BertConfig, BertModel
    except ImportError as e:
        raise ImportError("the 'bert' example model needs transformers: pip install torchplace[examples]") from e
    config = BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64, attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, config.vocab_size, (batch, 16))
    return model, (ids,)


_BUILDERS: dict[str, Callable[[int], Built]] = {
    "mlp": _mlp,
    "resnet": _resnet,
    "inception": _inception,
    "transformer": _transformer,
    "gpt2": _gpt2,
    "bert": _bert,
}
if tuple(_BUILDERS) != NAMES:  # the CLI lists NAMES without importing this module
    raise RuntimeError(f"torchplace.model_names.NAMES {NAMES} does not match the builders {tuple(_BUILDERS)}")


def leaf_modules_for(name: str) -> tuple[type, ...]:
    """The block classes to keep whole at ``granularity="module"`` for an example model."""
    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)
    if name == "bert":
        from transformers.models.bert.modeling_bert import BertLayer

        return (BertLayer,)
    return {
        "resnet": (ResidualBlock,),
        "inception": (InceptionBlock,),
        "transformer": (nn.TransformerEncoderLayer,),
    }.get(name, ())


def build(name: str, batch: int = 2, seed: int = 0) -> Built:
    """Build an example model by name.

    Args:
        name: one of :data:`NAMES` (``"mlp"``, ``"resnet"``, ``"inception"``, ``"transformer"``,
            ``"gpt2"``, ``"bert"``).
        batch: batch size of the example inputs.
        seed: seed of the weights and inputs (the same seed gives the same model and inputs).

    Returns:
        ``(model, example_inputs)``, the model in eval mode.

    Raises:
        ValueError: for an unknown name (the message lists the valid ones).
        UsageError: for a batch whose example inputs cannot be allocated or sized.
        ImportError: for ``"gpt2"`` and ``"bert"`` when transformers is not installed.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown example model {name!r}; choose one of {list(NAMES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model, inputs = _BUILDERS[name](batch)
        except (RuntimeError, MemoryError, OverflowError, TypeError) as e:
            if not isinstance(e, (MemoryError, OverflowError)) and not _too_large(str(e)):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"batch {batch}: the example inputs of {name!r} cannot be made ({first}); lower the "
                             "batch (torchplace plan/run: --batch)") from None
    return model.eval(), inputs


def _too_large(message: str) -> bool:
    """Whether torch's ``message`` says a tensor was too large to allocate or to size (a batch of
    1e12 samples: the allocator's RuntimeError; of 1e30: a size that overflows int64)."""
    return "allocate" in message or "Overflow" in message or "overflow" in message
