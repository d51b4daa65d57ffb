"""A Hugging Face model built from its ``config.json`` on the meta device: no weights, no download."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torchplace.errors import MissingDependencyError, UsageError

__all__ = ["meta_model"]


def meta_model(config_path: str | Path) -> Any:
    """The model a ``config.json`` describes, built on the meta device (nothing allocated).

    The class is the config's first ``architectures`` entry when transformers has it, else the
    first of ``AutoModelForCausalLM``, ``AutoModelForSeq2SeqLM``, ``AutoModel`` that takes the config.

    Raises:
        MissingDependencyError: transformers is not installed.
        UsageError: the file is not a config transformers can read, or no model class takes it.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise MissingDependencyError("--hf needs transformers: pip install torchplace[hf]") from e
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_path))
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"{config_path}: not a Hugging Face config.json transformers can read ({e})") from None
    named = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    factories = [c.from_config if hasattr(c, "from_config") else c._from_config for c in named if c is not None]
    factories += [transformers.AutoModelForCausalLM.from_config, transformers.AutoModelForSeq2SeqLM.from_config,
                  transformers.AutoModel.from_config]
    for make in factories:
        try:
            with torch.device("meta"):
                return make(config).eval()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    raise UsageError(f"{config_path}: no transformers model class takes a {type(config).__name__}")
