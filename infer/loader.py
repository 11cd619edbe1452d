"""Load a model from a Hugging Face folder: config.json plus safetensors (one file or a sharded index).

Weights are read only from safetensors, never unpickled. Each architecture's module names equal the
checkpoint keys; an architecture may declare `checkpoint_renames` for keys stored in another layout.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

# model_type in config.json -> the class in infer/models that implements it (one file per architecture).
MODEL_CLASSES = {
    "llama": "infer.models.llama:LlamaForCausalLM",
    "deepseek_v2": "infer.models.deepseek_v2:DeepseekV2ForCausalLM",
}
# Keys some exporters leave in checkpoints that carry no weights of ours.
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)
# The dtypes a user may name for weights, activations or stored features.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ModelLoadError(ValueError):
    """A user-facing problem with a model folder; the message names the file or field."""


def load_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path / 'config.json'} is missing: expected a Hugging Face model folder")
    try:  # check the architecture before transformers does, for a one-line answer
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object: {err}") from err
    if model_type not in MODEL_CLASSES:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {path / 'config.json'} (supported: {supported})"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, json.JSONDecodeError, KeyError) as err:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {err}") from err
    return config


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {err}") from err
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: pickled weights are never loaded, convert them to safetensors)" if pickled else ""
        raise ModelLoadError(f"no .safetensors weights in {path}{hint}")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Build the model on the meta device, then fill every parameter from the checkpoint's tensors.

    An architecture's `checkpoint_renames(key, tensor, config)` says where a checkpoint tensor goes: whole
    parameters as (name, tensor), pieces of a fused parameter as (name, tensor, first_row, rows); one
    checkpoint tensor may also be split into several whole parameters.
    """
    path = Path(path)
    config = load_config(path)
    module_name, class_name = MODEL_CLASSES[config.model_type].split(":")
    model_cls = getattr(importlib.import_module(module_name), class_name)
    with torch.device("meta"):
        model = model_cls(config)
    params = dict(model.named_parameters())
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    state: dict[str, torch.Tensor] = {}
    rows_filled: dict[str, int] = {}
    renames = getattr(model_cls, "checkpoint_renames", None)
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith(IGNORED_KEY_SUFFIXES) or key in tied:
                        continue
                    tensor = f.get_tensor(key)
                    for name, piece, *rows in renames(key, tensor, config) if renames else [(key, tensor)]:
                        _place(file, key, name, piece, rows, params, state, rows_filled, dtype)
        except (OSError, RuntimeError, SafetensorError) as err:  # truncated or non-safetensors files
            raise ModelLoadError(f"cannot read {file}: {err}") from err
    incomplete = sorted(n for n in params if n not in tied and rows_filled.get(n, 0) < params[n].shape[0])
    if incomplete:
        shown = ", ".join(incomplete[:5]) + (f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint lacks tensors for {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval().requires_grad_(False)


def _place(
    file: Path, key: str, name: str, tensor: torch.Tensor, rows: list[int], params: dict[str, torch.nn.Parameter],
    state: dict[str, torch.Tensor], rows_filled: dict[str, int], dtype: torch.dtype,
) -> None:
    """Copy checkpoint tensor `key` into parameter `name` (rows = [first_row, num_rows] for a fused piece)."""
    if name not in params:
        raise ModelLoadError(f"{file}: tensor {key!r} matches no parameter of the model in config.json")
    full = params[name].shape
    first, expected = (rows[0], (rows[1], *full[1:])) if rows else (0, tuple(full))
    if tuple(tensor.shape) != tuple(expected):
        raise ModelLoadError(
            f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected)}"
        )
    if name not in state:
        state[name] = torch.empty(full, dtype=dtype)
    state[name][first : first + tensor.shape[0]] = tensor
    rows_filled[name] = rows_filled.get(name, 0) + tensor.shape[0]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it has none (a model can still be served on token ids)."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        return None
    return AutoTokenizer.from_pretrained(path)


def default_eos_ids(path: str | Path, model_config: PretrainedConfig) -> list[int]:
    """Stop ids from generation_config.json (as Hugging Face does), else from config.json."""
    path = Path(path)
    eos = None
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
