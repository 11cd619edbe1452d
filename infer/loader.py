"""Load a model from a Hugging Face folder: config.json plus safetensors (one file or a sharded index).

Weights are read only from safetensors, never unpickled. Each architecture's module names equal the
checkpoint keys; an architecture may declare `checkpoint_renames` for keys stored in another layout.
Under tensor parallelism a rank reads only the slices it keeps (safetensors' get_slice).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from infer.parallel import Shard, TPGroup, current

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


class CheckpointTensor:
    """A checkpoint tensor not read yet: `[i]`, `chunk` and `narrow` pick a part, `read()` reads just that part.

    checkpoint_renames index it like a tensor, and the loader narrows it to the rows or columns a
    tensor-parallel rank keeps, so no rank reads a tensor it does not keep.
    """

    def __init__(self, file, key: str, index: tuple | None = None) -> None:
        self._file, self.key, self._whole = file, key, index is None
        # per stored dimension: an int (selected away) or the slice still kept
        self._index = index if index is not None else tuple(slice(0, n) for n in file.get_slice(key).get_shape())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self._index if isinstance(s, slice))

    def _kept_dims(self) -> list[int]:
        return [i for i, s in enumerate(self._index) if isinstance(s, slice)]

    def _with(self, dim: int, selection: int | slice) -> "CheckpointTensor":
        index = list(self._index)
        index[self._kept_dims()[dim]] = selection
        return CheckpointTensor(self._file, self.key, tuple(index))

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        first = self._index[self._kept_dims()[dim]].start
        return self._with(dim, slice(first + start, first + start + length))

    def __getitem__(self, i: int) -> "CheckpointTensor":
        return self._with(0, self._index[self._kept_dims()[0]].start + i)

    def chunk(self, chunks: int, dim: int = 0) -> list["CheckpointTensor"]:
        size = -(-self.shape[dim] // chunks)
        return [self.narrow(dim, start, min(size, self.shape[dim] - start)) for start in range(0, self.shape[dim], size)]

    def read(self) -> torch.Tensor:
        return self._file.get_tensor(self.key) if self._whole else self._file.get_slice(self.key)[self._index]


def build_on_meta(config: PretrainedConfig, tp: TPGroup) -> torch.nn.Module:
    """The architecture of `config` with `tp`'s rank's shard of every parameter, on the meta device: shapes
    without storage (load_model fills them; mtp_train.inspect counts them)."""
    module_name, class_name = MODEL_CLASSES[config.model_type].split(":")
    with torch.device("meta"):
        return getattr(importlib.import_module(module_name), class_name)(config, tp)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LEAN_CLASSES: dict[type, type] = {}


def _call_forward(module: torch.nn.Module, *args, **kwargs):
    return module.forward(*args, **kwargs)  # the instance's forward: one patched on a module still runs


def serve_lean(model: torch.nn.Module) -> torch.nn.Module:
    """Take nn.Module's per-call machinery out of a served model's forward, for every submodule without hooks;
    returns the model. The loaders call it last (`load_model`, `load_head`); call it on a model built otherwise
    before serving it, after its last move to another device or dtype.

    On a small model that machinery is a sixth of a decode step (see docs/benchmark_history.md): `module(x)`
    dispatches hooks around each forward, and each `self.weight` or `self.mlp` is a Python call into `__getattr__`.
    Each module gets a subclass of its own class whose __call__ calls its forward (isinstance, names and state_dict
    are unchanged), and its parameters and submodules become instance attributes too. nn.Module's __setattr__
    drops such a copy when a parameter or submodule is replaced, so assign them as usual (never through
    `_parameters` directly). A module with hooks (DeepSpeed ZeRO-3 places them on a model it trains) keeps the full
    dispatch, and so does every module while a global hook is registered; a hook registered on a module after this
    does not run (load with lean=False, hook, then call this).
    """
    if any(getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOKS):
        return model
    for module in model.modules():
        cls = type(module)
        if cls not in _LEAN_CLASSES.values():
            if cls.__call__ is not torch.nn.Module.__call__ or any(getattr(module, name) for name in _MODULE_HOOKS):
                continue
            if cls not in _LEAN_CLASSES:
                _LEAN_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _call_forward, "__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
            module.__class__ = _LEAN_CLASSES[cls]
        module.__dict__.update(module._parameters)
        module.__dict__.update(module._modules)
    return model


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    tp: TPGroup | None = None, lean: bool = True,
) -> torch.nn.Module:
    """Build the model on the meta device, then fill every parameter from the checkpoint's tensors.

    An architecture's `checkpoint_renames(key, tensor, config)` says where a checkpoint tensor goes: whole
    parameters as (name, tensor), pieces of a fused parameter as (name, tensor, first_row, rows); one
    checkpoint tensor may also be split into several whole parameters.
    tp: the tensor-parallel group to shard over (default: the current one, see infer.parallel.init_tp); a
    sharded parameter (its module's `tp_shards`) is filled with just this rank's rows or columns, and the
    parameters other ranks own (`tp_foreign_params`, another rank's experts) are skipped unread.
    lean: served without nn.Module's per-call machinery (`serve_lean`); False to hook the model first.
    """
    path = Path(path)
    config = load_config(path)
    model = build_on_meta(config, tp or current())
    params = dict(model.named_parameters())
    modules = list(model.named_modules())
    shards = {_join(prefix, name): shard for prefix, m in modules for name, shard in getattr(m, "tp_shards", {}).items()}
    foreign = {_join(prefix, name) for prefix, m in modules for name in getattr(m, "tp_foreign_params", ())}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    state: dict[str, torch.Tensor] = {}
    rows_filled: dict[str, int] = {}
    renames = getattr(type(model), "checkpoint_renames", None)
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith(IGNORED_KEY_SUFFIXES) or key in tied:
                        continue
                    tensor = CheckpointTensor(f, key)
                    for name, piece, *rows in renames(key, tensor, config) if renames else [(key, tensor)]:
                        if name not in foreign:
                            _place(file, key, name, piece, rows, params, shards.get(name), state, rows_filled, dtype)
        except (OSError, RuntimeError, SafetensorError) as err:  # truncated or non-safetensors files
            raise ModelLoadError(f"cannot read {file}: {err}") from err
    incomplete = sorted(n for n in params if n not in tied and rows_filled.get(n, 0) < params[n].shape[0])
    if incomplete:
        shown = ", ".join(incomplete[:5]) + (f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint lacks tensors for {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval().requires_grad_(False)
    return serve_lean(model) if lean else model


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _place(
    file: Path, key: str, name: str, tensor: CheckpointTensor, rows: list[int], params: dict[str, torch.nn.Parameter],
    shard: Shard | None, state: dict[str, torch.Tensor], rows_filled: dict[str, int], dtype: torch.dtype,
) -> None:
    """Copy checkpoint tensor `key` into parameter `name` (rows = [first_row, num_rows] of the whole parameter
    for a fused piece); of a sharded parameter, read and copy only the rows or columns this rank keeps."""
    if name not in params:
        raise ModelLoadError(f"{file}: tensor {key!r} matches no parameter of the model in config.json")
    full = shard.full if shard else tuple(params[name].shape)
    first, expected = (rows[0], (rows[1], *full[1:])) if rows else (0, full)
    if tuple(tensor.shape) != tuple(expected):
        raise ModelLoadError(
            f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected)}"
        )
    if name not in state:
        state[name] = torch.empty(params[name].shape, dtype=dtype)
    target, count = state[name], expected[0]
    if shard is None:
        target[first : first + count] = tensor.read()
    elif shard.dim == 0:  # kept rows [lo, hi) of the whole parameter land one after another
        count, offset = 0, 0
        for lo, hi in shard.ranges:
            start, stop = max(lo, first), min(hi, first + expected[0])
            if start < stop:
                target[offset + start - lo : offset + stop - lo] = tensor.narrow(0, start - first, stop - start).read()
                count += stop - start
            offset += hi - lo
    else:  # kept columns, of every row of the piece
        offset = 0
        for lo, hi in shard.ranges:
            target[first : first + count, offset : offset + hi - lo] = tensor.narrow(1, lo, hi - lo).read()
            offset += hi - lo
    rows_filled[name] = rows_filled.get(name, 0) + count


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
