"""Models and data for workloads: transformers causal LMs built from configs, offline.

A model spec is a built-in name (``tiny-gpt2``, ``tiny-llama``), ``MODEL_TYPE:key=value,...``
(any transformers architecture, random weights) or a local checkpoint directory. Nothing here
reaches the network.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.errors import UsageError, first_line
from oomguard.engine.util.jsonable import parse_json, stable_hash

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # GPT-2 with a byte-level vocabulary, as in the E10 setup (vocab 256).
    "tiny-gpt2": {"model_type": "gpt2", "vocab_size": 256, "n_positions": 1024, "n_embd": 128,
                  "n_layer": 2, "n_head": 4, "bos_token_id": 0, "eos_token_id": 0},
    # A LLaMA-style decoder: RMSNorm, rotary positions, gated MLP, grouped KV heads.
    "tiny-llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 1024, "bos_token_id": 0,
                   "eos_token_id": 0},
}

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; UsageError listing the valid names otherwise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def model_config(spec: str) -> Any:
    """The transformers config a spec names (no weights are built or loaded); a one-line
    UsageError for a key the type's config does not have, or a value of the wrong type."""
    from transformers import AutoConfig  # why: transformers costs 2.5-3 s; import on use

    if spec in BUILTIN_CONFIGS:
        kw = dict(BUILTIN_CONFIGS[spec])
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    path = Path(spec).expanduser()
    if os.path.isdir(path):  # not Path.is_dir: a spec too long for a file name raises there
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            why = first_line(exc) or type(exc).__name__
            raise UsageError(f"{spec}: not a transformers checkpoint folder ({why}); give a "
                             "folder written by save_pretrained, or a built-in model") from None
    model_type, _, rest = spec.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"bad model spec {spec!r}: expected MODEL_TYPE:key=value,...; "
                             "write it like gpt2:n_layer=2")
        try:  # numbers, true/false and "quoted strings" as JSON; bare words as strings
            kw[key.strip()] = parse_json(value)  # refuses hostile nesting: a string then
        except ValueError:
            kw[key.strip()] = value.strip()
    try:
        default = AutoConfig.for_model(model_type)
    except ValueError:
        raise UsageError(
            f"unknown model {spec!r}: use {', '.join(BUILTIN_CONFIGS)}, a local checkpoint "
            "directory, or MODEL_TYPE:key=value (e.g. gpt2:n_layer=4)"
        ) from None
    # A value of the wrong type (n_layer=abc) raises StrictDataclassError, not a ValueError.
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = AutoConfig.for_model(model_type, **kw)
    except (StrictDataclassError, ValueError, TypeError) as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise UsageError(f"bad model spec {spec!r}: {first_line(cause) or type(cause).__name__}"
                         "; fix the spec (MODEL_TYPE:key=value,...)") from None
    _check_keys(spec, model_type, default, config, kw)
    return config


def _check_keys(spec: str, model_type: str, default: Any, config: Any, kw: dict[str, Any]) -> None:
    """UsageError naming every unknown key of ``kw`` and the closest valid one (transformers
    stores one as a plain attribute: ``n_layr=1`` would silently build 12 layers)."""
    import difflib
    import inspect

    from transformers import PretrainedConfig

    named = {name for cls in (type(default), PretrainedConfig)
             for name, param in inspect.signature(cls.__init__).parameters.items()
             if name != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL)}
    valid = {k for k in (set(default.to_dict()) | set(getattr(default, "attribute_map", {}) or {})
                         | set(PretrainedConfig().to_dict()) | named) if not k.startswith("_")}
    unknown = [k for k in kw if k not in valid and hasattr(config, k)]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(valid), n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise UsageError(f"bad model spec {spec!r}: {model_type} has no config key {', '.join(parts)}"
                     "; use the key names of its transformers config")


# Config keys that bound the positions a model embeds.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                 "seq_length")


def model_modules(spec: str) -> tuple[str, ...]:
    """The modules that building ``spec`` imports (transformers and its modeling module, a
    second or more each), for a parent or forkserver to import once for all its children;
    transformers alone where the spec does not resolve (the child then says why)."""
    try:
        model_type = model_config(spec).model_type.replace("-", "_")
    except Exception:  # noqa: BLE001 - preloading is an optimisation only
        return ("transformers",)
    return ("transformers", f"transformers.models.{model_type}.modeling_{model_type}")


def check_seq_len(config: Any, seq_len: int) -> None:
    """UsageError if ``config`` (a transformers config) declares fewer positions than
    ``seq_len`` tokens: learned position tables index past their end (an IndexError deep
    in the forward) and rotary models run outside what they were configured for."""
    for key in POSITION_KEYS:
        limit = getattr(config, key, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            break
    else:
        return  # no declared limit (e.g. ALiBi models such as BLOOM)
    if seq_len > limit:
        name = (getattr(config, "attribute_map", {}) or {}).get(key, key)
        kind = getattr(config, "model_type", "model")
        raise UsageError(f"sequence length {seq_len} is longer than the model's {limit} "
                         f"positions ({name}): use a sequence length <= {limit}, or a model "
                         f"with more positions (e.g. {kind}:{name}={seq_len})")


def build_model(spec: str = "tiny-gpt2", dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", seed: int = 0,
                attn_implementation: str = "eager") -> torch.nn.Module:
    """Build a causal LM from a spec, in eval mode, random weights seeded by ``seed``.
    ``attn_implementation="eager"`` materialises attention probabilities, which attention
    statistics need and which makes the memory per item honest."""
    from transformers import AutoModelForCausalLM  # why: as in model_config

    dt = parse_dtype(dtype)
    path = Path(spec).expanduser()
    if spec not in BUILTIN_CONFIGS and path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dt, attn_implementation=attn_implementation)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            model_config(spec), attn_implementation=attn_implementation).to(dt)
    if getattr(model, "loss_type", None) is None:  # or transformers warns on every model
        model.loss_type = "ForCausalLM"
    return model.to(device).eval()


def config_fingerprint(spec: str) -> str:
    """A short hash of the model's config: two specs with the same config share it (where it
    came from and the dtype it was saved in left out)."""
    volatile = {"transformers_version", "_name_or_path", "_commit_hash", "architectures", "dtype",
                "torch_dtype"}
    return stable_hash({k: v for k, v in model_config(spec).to_dict().items() if k not in volatile})


def make_batch(n: int, seq_len: int, vocab_size: int, seed: int = 0, pad: bool = True,
               device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Generated causal-LM data: ``input_ids``, ``attention_mask``, ``labels`` ``[n, seq_len]``;
    with ``pad``, sample ``i`` has a seeded length in [seq_len/2, seq_len], right-padded
    (labels -100)."""
    if n <= 0 or seq_len <= 0:
        raise UsageError(f"n and seq_len must be positive, got n={n}, seq_len={seq_len}; "
                         "give 1 or more")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)
    lengths = (torch.randint(max(2, seq_len // 2), seq_len + 1, (n,), generator=g) if pad
               else torch.full((n,), seq_len))
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}
