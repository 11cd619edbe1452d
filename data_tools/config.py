"""The typed configuration of every Hydra command, and the one way to compose it.

`conf/` holds the YAML (model shapes, data, heads, trainers, and per model its recipe: conf/recipe/); the dataclasses here and in `mtp_train.config` are
its schema, registered with Hydra's ConfigStore and named first in the defaults of conf/precompute.yaml and
conf/config.yaml. Hydra then converts and checks every value's type as it composes (`trainer.lr=abc` fails naming
the key), and `check` tests each field's range, given as dataclass field metadata, once at start:

    min / max      numbers (inclusive)
    choices        the allowed values of a string

so a mistake is a one-line `ConfigError` naming the key, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # infer.loader.DTYPES, named without importing torch


class ConfigError(ValueError):
    """A configuration value of the wrong type or out of range; the message names the key."""


def at_least(low: float, **more: Any) -> Any:
    return {"min": low, **more}


def one_of(*choices: str) -> dict:
    return {"choices": choices}


# --- shared by precompute and training --------------------------------------------------------------------------
@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # the target's Hugging Face folder
    config: dict[str, Any] = field(default_factory=dict)  # the target's shapes when path has no config.json


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    split: str = "train"  # for `datasets` folders
    chat_template: Optional[str] = None  # null: the tokenizer's own; plain: BOS + turns; or a Jinja string
    end_token: Optional[str] = None
    max_length: int = field(default=4096, metadata=at_least(1))
    truncate: bool = True
    on_error: str = field(default="skip", metadata=one_of("skip", "fail"))
    limit: Optional[int] = field(default=None, metadata=at_least(1))


@dataclass
class HeadLoss:
    """A head architecture's loss recipe; conf/config.yaml's `loss` reads it by interpolation."""

    kl: float = field(default=1.0, metadata=at_least(0.0))
    ce: float = field(default=0.0, metadata=at_least(0.0))
    feature: float = field(default=0.0, metadata=at_least(0.0))
    tv: float = field(default=0.0, metadata=at_least(0.0))


@dataclass
class HeadConfig:
    """conf/head/*.yaml. The precompute reads it too: an EAGLE-3 head's layer_ids are the aux layers it stores."""

    architecture: str = field(default="mtp", metadata=one_of("mtp", "eagle1", "eagle3", "block"))
    enorm: bool = True
    hnorm: bool = True
    final_norm: bool = True
    layer_input_norm: bool = True
    proj_bias: bool = False
    hidden_state: str = field(default="pre_norm", metadata=one_of("pre_norm", "post_norm"))
    mlp: str = field(default="dense", metadata=one_of("dense", "moe"))  # "moe": DeepSeek-V2 targets only
    # the decoder layer's dense MLP width; null: the target's (from_target_last_layer widens the target's MLP
    # without changing its function, mtp_train.heads.widen_mlp)
    intermediate_size: Optional[int] = field(default=None, metadata=at_least(1))
    init: str = field(default="from_target_last_layer", metadata=one_of("from_target_last_layer", "random"))
    loss: HeadLoss = field(default_factory=HeadLoss)
    # EAGLE-3 (infer/models/eagle3_head.py): target layer ids (null: the default rule), the draft vocabulary
    # (null: the whole vocabulary; chosen by `draft_vocab_rule` over up to `draft_vocab_tokens` training tokens)
    # and whether the head trains its own lm_head rows (else the target's, frozen and shared)
    layer_ids: Optional[list[int]] = None
    draft_vocab_size: Optional[int] = field(default=None, metadata=at_least(1))
    draft_vocab_rule: str = field(default="probability", metadata=one_of("probability", "frequency"))
    draft_vocab_tokens: int = field(default=2_000_000, metadata=at_least(1))
    trainable_lm_head: bool = False
    num_key_value_heads: Optional[int] = field(default=None, metadata=at_least(1))  # EAGLE-3 / block (null: the target's)
    norm_before_residual: bool = False  # EAGLE-3: its residual starts from the normed fused state (conf/head/eagle3)
    # block heads (infer/models/block_head.py; layer_ids as EAGLE-3's): rows of the query block (block_size - 1
    # drafts a forward), decoder layers, anchors drawn a record, and the per-position loss weights: exp_decay
    # exp(-(k-1)/gamma) (gamma <= 0: equal weights) or dpace (D-PACE, smoothing dpace_alpha; mtp_train.block_unroll)
    block_size: int = field(default=16, metadata=at_least(2, max=64))
    num_layers: int = field(default=1, metadata=at_least(1, max=16))
    anchors_per_record: int = field(default=32, metadata=at_least(1))
    gamma: float = 7.0
    position_weight: str = field(default="exp_decay", metadata=one_of("exp_decay", "dpace"))
    dpace_alpha: float = field(default=0.5, metadata=at_least(1e-6, max=1.0))
    mask_token_id: Optional[int] = field(default=None, metadata=at_least(0))  # a reserved id; null: a learned row
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3's; what the engines' DFlash layers have: exportable)
    anchor_input: bool = False  # the mask rows also read [c_{p-1}; Emb(t_p)] (infer.models.block_head; not exportable)


# --- precompute -----------------------------------------------------------------------------------------------
@dataclass
class PrecomputeSettings:
    dtype: str = field(default="bfloat16", metadata=one_of(*DTYPE_NAMES))  # stored hidden states
    aux_layers: list[int] = field(default_factory=list)
    records_per_shard: int = field(default=1024, metadata=at_least(1))
    max_tokens_per_batch: int = field(default=8192, metadata=at_least(1))
    max_records_per_batch: int = field(default=256, metadata=at_least(1))
    device: str = field(default="cpu", metadata=one_of("cpu", "cuda"))
    model_dtype: str = field(default="float32", metadata=one_of(*DTYPE_NAMES))
    attention_backend: str = field(default="auto", metadata=one_of("auto", "torch", "flashinfer"))
    page_size: int = field(default=16, metadata=at_least(1))
    tp: int = field(default=1, metadata=at_least(1, max=64))  # ranks per replica; WORLD_SIZE = tp x replicas
    dry_run: bool = False
    force: bool = False
    overwrite: bool = False
    progress: bool = True


@dataclass
class PrecomputeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    head: HeadConfig = field(default_factory=HeadConfig)  # its target layers are stored beside precompute.aux_layers
    output_dir: str = MISSING
    precompute: PrecomputeSettings = field(default_factory=PrecomputeSettings)


ConfigStore.instance().store(name="precompute_schema", node=PrecomputeConfig)


# --- composing and checking ---------------------------------------------------------------------------------------
def compose(config_name: str, overrides: list[str], complete: bool = True) -> DictConfig:
    """conf/<config_name>.yaml with Hydra overrides, typed by its schema and range-checked (ConfigError).

    complete=False lets mandatory values (`???`) stay unset, for a command that reads only part of the config.
    """
    from hydra import compose as hydra_compose  # noqa: PLC0415
    from hydra import initialize_config_dir  # noqa: PLC0415
    from hydra.errors import HydraException  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    if not (CONF_DIR / f"{config_name}.yaml").is_file():
        raise ConfigError(f"{CONF_DIR / (config_name + '.yaml')} is missing")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"config: {one_line(err)}") from err
    check(cfg, complete)
    return cfg


def check(cfg: DictConfig, complete: bool = True) -> None:
    """Resolve every value (type errors surface here) and test each schema field's min/max/choices."""
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=complete)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {one_line(err)}") from err
    schema = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(schema):
        _check_fields(cfg, schema, "")


def _check_fields(node: DictConfig, schema: type, prefix: str) -> None:
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        if OmegaConf.is_missing(node, f.name):
            continue
        value = node[f.name]
        if dataclasses.is_dataclass(f.type) or isinstance(value, DictConfig) and dataclasses.is_dataclass(
                OmegaConf.get_type(value)):
            _check_fields(value, OmegaConf.get_type(value), f"{key}.")
            continue
        meta = f.metadata
        if value is None or not meta:
            continue
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}")
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{key} must be >= {meta['min']}, got {value}")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{key} must be <= {meta['max']}, got {value}")


def one_line(err: BaseException) -> str:
    """An exception and its causes as one line (Hydra's messages also list the config search path: dropped)."""
    parts = []
    while err is not None:
        text = " ".join(str(err).split("Config search path")[0].split(" full_key:")[0].split())
        if text and text not in parts:
            parts.append(text)
        err = err.__cause__
    return ": ".join(parts) or "invalid configuration"
