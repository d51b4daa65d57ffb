"""A Hugging Face model built from its ``config.json`` on the meta device: no weights, no download."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from torchplace.errors import MissingDependencyError, UsageError

__all__ = ["meta_model"]


def meta_model(config_path: str | Path) -> Any:
    """The model a ``config.json`` describes, built on the meta device (nothing allocated).

    The class is the config's first ``architectures`` entry when transformers has it, else the
    first of ``AutoModelForCausalLM``, ``AutoModelForSeq2SeqLM``, ``AutoModel`` whose mapping has
    the config's class; for an encoder-decoder config (``is_encoder_decoder``: BART, T5, Whisper)
    ``AutoModelForSeq2SeqLM`` and ``AutoModelForSpeechSeq2Seq`` come first (its ``...ForCausalLM``
    is the decoder alone, without the encoder ``from_pretrained`` loads). Code a config's
    ``auto_map`` names (``trust_remote_code``) is never fetched or run, nor asked about.

    Raises:
        MissingDependencyError: transformers is not installed.
        UsageError: the file is not a config transformers can read (a field of the wrong type),
            no model class takes it, or the classes that take it cannot build a model from it
            (transformers' own error, e.g. a hidden size its head count does not divide, a
            ``pad_token_id`` beyond the vocabulary); the message names the file.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise MissingDependencyError("--hf needs transformers: pip install torchplace[hf]") from e
    invalid = _invalid_config_errors()
    try:
        # never remote code: without trust_remote_code=False, transformers asks on the terminal whether to
        # fetch and run the code a config's auto_map names, and waits for an answer (found by fuzzing)
        config = transformers.AutoConfig.from_pretrained(str(config_path), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AssertionError, *invalid) as e:
        if "trust_remote_code" in str(e):
            raise UsageError(f"{config_path}: its model is custom code its auto_map names, which torchplace does not "
                             "fetch or run: build the model in Python (from_config(..., trust_remote_code=True) under "
                             "torch.device('meta')) and pass it to torchplace.infer_device_map") from None
        raise UsageError(f"{config_path}: not a Hugging Face config.json transformers can read "
                         f"({type(e).__name__}: {e}): fix the config") from None
    named = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    factories = [(c.__name__, c.from_config if hasattr(c, "from_config") else c._from_config)
                 for c in named if c is not None]
    autos = (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM, transformers.AutoModel)
    if getattr(config, "is_encoder_decoder", False):
        autos = (transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForSpeechSeq2Seq,
                 transformers.AutoModelForCausalLM, transformers.AutoModel)
    factories += [(auto.__name__, functools.partial(auto.from_config, trust_remote_code=False)) for auto in autos
                  if type(config) in getattr(auto, "_model_mapping", {type(config)})]
    failed: list[str] = []
    for name, make in factories:
        try:
            with torch.device("meta"):
                return make(config).eval()
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, AssertionError, *invalid) as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    if failed:
        raise UsageError(f"{config_path}: transformers cannot build a model from this {type(config).__name__} "
                         f"({failed[0]}): fix the config")
    raise UsageError(f"{config_path}: no transformers model class takes a {type(config).__name__}")


def _invalid_config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises, besides the built-in types, for a config field it refuses:
    huggingface_hub's strict-dataclass validation errors (a field of the wrong type), which
    subclass ``Exception`` only."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)
