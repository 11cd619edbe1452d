"""What vLLM's and SGLang's loaders read from a draft-model folder, as data the export tests check against.

Each `Loader` was read from the engine's source at the commit it cites (docs/engine_loaders.md has the prose and
the disagreements); none of it runs here. `check(folder, loader)` compares an export's config.json and
model.safetensors with one entry: every tensor the loader reads is there with the shape its config implies, no
tensor it would choke on or silently drop is there, and the config fields it reads are present (fixed ones with
the value it needs). It returns the problems, one line each; an empty list means the folder conforms.

Hidden-state conventions (`feeds`): "post_norm" is the target's last decoder layer output after its final norm
(what both engines hand EAGLE-1/2 and NextN/MTP drafters); "aux" the pre-norm residual stream at three layers
(EAGLE-3). `feeds_back` is what the drafter's own next step reads: the engines disagree for NextN/MTP.
Layer ids: this project's aux layer i is decoder layer i's output (infer.models.common.run_decoder_layers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Loader:
    fmt: str  # mtp_train.export's format name
    engine: str  # "vllm", "sglang" or "speculators"
    cls: str  # the class that loads the folder
    sources: tuple[str, ...]  # "owner/repo path @ commit" read for this entry
    versions: str  # which versions the rules hold for, as far as read
    serve: str  # the command that serves an export (the draft folder is DIR)
    required_config: dict[str, object]  # field -> the value the loader needs (None: present, any value)
    tensors: Callable[[dict], Shapes]  # config.json -> every tensor name the loader reads and its shape
    optional: Callable[[dict], Shapes] = lambda config: {}  # read when present (e.g. a bias a loader builds)
    feeds: str = "post_norm"
    feeds_back: str = "pre_norm"
    layer_ids: str = ""
    defaults: dict[str, object] = field(default_factory=dict)  # what the loader assumes when a field is missing
    shares: str = "embed_tokens and lm_head from the target"


# --- shapes the loaders build from config.json ------------------------------------------------------------------
def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def llama_layer(prefix: str, c: dict, input_norm: bool = True, qkv_in: int | None = None) -> Shapes:
    """A Llama decoder layer with Hugging Face's split names (both engines fuse q/k/v and gate/up on load)."""
    h, d, inter = c["hidden_size"], _head_dim(c), c["intermediate_size"]
    q, kv, qkv_in = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, qkv_in or h
    shapes = {f"{prefix}.self_attn.q_proj.weight": (q, qkv_in), f"{prefix}.self_attn.k_proj.weight": (kv, qkv_in),
              f"{prefix}.self_attn.v_proj.weight": (kv, qkv_in), f"{prefix}.self_attn.o_proj.weight": (h, q),
              f"{prefix}.mlp.gate_proj.weight": (inter, h), f"{prefix}.mlp.up_proj.weight": (inter, h),
              f"{prefix}.mlp.down_proj.weight": (h, inter), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if input_norm:
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)
    return shapes


def deepseek_moe_layer(prefix: str, c: dict) -> Shapes:
    """A DeepSeek-V2 MLA layer with the MoE MLP, as SGLang's DeepseekV2DecoderLayer(is_nextn=True) builds it."""
    h, heads, rank, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    a = f"{prefix}.self_attn"
    shapes: Shapes = {f"{a}.kv_a_proj_with_mqa.weight": (rank + rope, h), f"{a}.kv_a_layernorm.weight": (rank,),
                      f"{a}.kv_b_proj.weight": (heads * (nope + v), rank), f"{a}.o_proj.weight": (h, heads * v),
                      f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if c.get("q_lora_rank") is None:
        shapes[f"{a}.q_proj.weight"] = (heads * (nope + rope), h)
    else:
        q_rank = c["q_lora_rank"]
        shapes.update({f"{a}.q_a_proj.weight": (q_rank, h), f"{a}.q_a_layernorm.weight": (q_rank,),
                       f"{a}.q_b_proj.weight": (heads * (nope + rope), q_rank)})
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    shapes[f"{prefix}.mlp.gate.weight"] = (experts, h)
    for e in range(experts):
        shapes.update({f"{prefix}.mlp.experts.{e}.gate_proj.weight": (inter, h),
                       f"{prefix}.mlp.experts.{e}.up_proj.weight": (inter, h),
                       f"{prefix}.mlp.experts.{e}.down_proj.weight": (h, inter)})
    shared = inter * (c.get("n_shared_experts") or 0)
    if shared:
        shapes.update({f"{prefix}.mlp.shared_experts.gate_proj.weight": (shared, h),
                       f"{prefix}.mlp.shared_experts.up_proj.weight": (shared, h),
                       f"{prefix}.mlp.shared_experts.down_proj.weight": (h, shared)})
    return shapes


def _eagle(c: dict) -> Shapes:
    h = c["hidden_size"]
    return {"fc.weight": (h, 2 * h), **llama_layer("layers.0", c, input_norm=False)}


def _nextn(c: dict) -> Shapes:
    h, p = c["hidden_size"], "model.layers.0"
    return {f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h),
            f"{p}.shared_head.norm.weight": (h,), **deepseek_moe_layer(p, c)}


def _deepseek_mtp(c: dict) -> Shapes:
    h, p = c["hidden_size"], f"model.layers.{c['num_hidden_layers']}"
    return {f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h),
            f"{p}.shared_head.norm.weight": (h,), f"{p}.shared_head.head.weight": (c["vocab_size"], h),
            **deepseek_moe_layer(p, c)}


def _eagle3(prefix: str, c: dict) -> Shapes:
    h = c["hidden_size"]
    aux = len(c.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    return {"fc.weight": (h, aux * (c.get("target_hidden_size") or h)), "norm.weight": (h,),
            f"{prefix}.hidden_norm.weight": (h,), **llama_layer(prefix, c, qkv_in=2 * h)}


def _eagle3_vocab(c: dict) -> Shapes:
    draft = c.get("draft_vocab_size") or c["vocab_size"]
    return {"lm_head.weight": (draft, c["hidden_size"]), "d2t": (draft,), "t2d": (c["vocab_size"],)}


def _speculators_eagle3(c: dict) -> Shapes:
    return _eagle3("layers.0", {**c["transformer_layer_config"], **{k: c[k] for k in (
        "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "draft_vocab_size") if c.get(k)}})


def _speculators_vocab(c: dict) -> Shapes:
    return _eagle3_vocab({**c["transformer_layer_config"], "draft_vocab_size": c.get("draft_vocab_size")})


VLLM_EAGLE = "vllm-project/vllm vllm/model_executor/models/llama_eagle.py @ 00da92319af4b2ad2cde8525b7b609c779bdc52f"
VLLM_EAGLE_CONFIG = "vllm-project/vllm vllm/transformers_utils/configs/eagle.py (stored version, EAGLEConfig)"
VLLM_MTP = "vllm-project/vllm vllm/model_executor/models/deepseek_mtp.py @ 03356f8cb59ba27f3d0ce8866d7516b5e32cff65"
VLLM_EAGLE3 = "vllm-project/vllm vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190"
VLLM_LLAMA_AUX = "vllm-project/vllm vllm/model_executor/models/llama.py (stored version: aux state appended before layer idx)"
VLLM_SPECULATORS = ("vllm-project/vllm vllm/transformers_utils/configs/speculators/base.py @ "
                    "94699746757f9d68e2f4bd89ad2c4b10ed962457",
                    "vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py @ "
                    "cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec (eagle3; later versions add mtp)")
SGLANG_EAGLE = "sgl-project/sglang python/sglang/srt/models/llama_eagle.py @ 3b64d5dee0756de843b5f022966f69c995cd15ea"
SGLANG_NEXTN = ("sgl-project/sglang python/sglang/srt/models/deepseek_nextn.py @ "
                "c28bdc9012d29bed6b96688a44d6788157ef3d86")
SGLANG_NEXTN_OLD = ("sgl-project/sglang python/sglang/srt/models/deepseek_nextn.py @ "
                    "0114f9c923f237b42b5a769a8370a71b8b1cee56 (own load_weights: model.layers.0 only)")
SGLANG_SPARSE = "sgl-project/sglang python/sglang/srt/models/deepseek_v2.py DeepseekV2DecoderLayer._is_layer_sparse"
SGLANG_EAGLE3 = "sgl-project/sglang python/sglang/srt/models/llama_eagle3.py @ d737979cbd17c6162f39c1953cfa72d3d23cc0d0"
SGLANG_AUX = "sgl-project/sglang python/sglang/srt/models/llama.py set_eagle3_layers_to_capture (stored version)"
SPECULATORS = "speculators 0.9.0 wheel (PyPI): speculators/config.py, speculators/models/eagle3/{config,core}.py"
SPECULATORS_CONVERTER = "speculators 0.9.0 wheel (PyPI): speculators/convert/eagle/eagle3_converter.py"

LOADERS: tuple[Loader, ...] = (
    Loader("eagle", "sglang", "LlamaForCausalLMEagle", (SGLANG_EAGLE,), "stored versions to 2025",
           "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE "
           "--speculative-draft-model-path DIR --speculative-num-steps 3 --speculative-eagle-topk 1 "
           "--speculative-num-draft-tokens 4",
           {"architectures": None, "num_hidden_layers": 1, "hidden_size": None, "intermediate_size": None,
            "num_attention_heads": None, "num_key_value_heads": None, "rms_norm_eps": None, "vocab_size": None,
            "max_position_embeddings": None, "rope_theta": None},
           _eagle, lambda c: {"fc.bias": (c["hidden_size"],)},
           layer_ids="none (one decoder layer, named layers.0)",
           defaults={"fc bias": "built (nn.Linear default): a missing fc.bias is never loaded, so write zeros",
                     "layers.0.input_layernorm": "deleted (identity)", "final norm": "none"}),
    Loader("eagle", "vllm", "EagleLlamaForCausalLM", (VLLM_EAGLE, VLLM_EAGLE_CONFIG), "stored versions to 2025",
           "vllm serve TARGET --speculative-config '{\"method\": \"eagle\", \"model\": \"DIR\", "
           "\"num_speculative_tokens\": 3}'",
           {"architectures": None, "num_hidden_layers": 1, "hidden_size": None, "intermediate_size": None,
            "num_attention_heads": None, "num_key_value_heads": None, "rms_norm_eps": None, "vocab_size": None,
            "max_position_embeddings": None, "rope_theta": None},
           _eagle, lambda c: {"fc.bias": (c["hidden_size"],)},
           layer_ids="none",
           defaults={"fc bias": "not built: fc.bias is skipped (only a zero bias survives)",
                     "architectures": "each prefixed 'Eagle' (EAGLEConfig): needs LlamaForCausalLM in the list",
                     "add_para_norm": "false (HASS input norms, not written)"}),
    Loader("sglang-nextn", "sglang", "DeepseekV3ForCausalLMNextN", (SGLANG_NEXTN, SGLANG_NEXTN_OLD, SGLANG_SPARSE),
           "old versions assert num_nextn_predict_layers == num_hidden_layers == 1; later ones read "
           "model.layers.0 when num_hidden_layers == 1, else model.layers.{num_hidden_layers}",
           "python -m sglang.launch_server --model-path TARGET --speculative-algorithm NEXTN "
           "--speculative-draft-model-path DIR --speculative-num-steps 1 --speculative-eagle-topk 1 "
           "--speculative-num-draft-tokens 2 --trust-remote-code",
           {"architectures": ["DeepseekV3ForCausalLMNextN"], "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
            "hidden_size": None, "vocab_size": None, "rms_norm_eps": None, "kv_lora_rank": None,
            "qk_nope_head_dim": None, "qk_rope_head_dim": None, "v_head_dim": None, "n_routed_experts": None,
            "num_experts_per_tok": None, "moe_intermediate_size": None, "topk_method": None,
            "max_position_embeddings": None, "rope_theta": None},
           _nextn, feeds_back="post_norm",
           layer_ids="the NextN layer is model.layers.0 (see versions)",
           defaults={"decoder": "DeepseekV2DecoderLayer(config, 0, is_nextn=True): always MoE",
                     "embed_tokens, shared_head.head": "skipped: the target's are used"}),
    Loader("sglang-nextn", "vllm", "DeepSeekMTP", (VLLM_MTP,), "stored versions to 2025",
           "vllm serve TARGET --speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}' "
           "(reads the MTP layer from the target's own checkpoint)",
           {"num_hidden_layers": None, "num_nextn_predict_layers": 1, "n_routed_experts": None},
           _deepseek_mtp,
           layer_ids="the MTP layer is model.layers.{num_hidden_layers}, after the target's layers",
           defaults={"shared_head.head": "loaded from the checkpoint (the export holds no lm_head)"}),
    Loader("eagle3", "sglang", "LlamaForCausalLMEagle3", (SGLANG_EAGLE3, SGLANG_AUX), "stored versions to 2025",
           "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
           "--speculative-draft-model-path DIR --speculative-num-steps 3 --speculative-eagle-topk 1 "
           "--speculative-num-draft-tokens 4",
           {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "hidden_size": None,
            "vocab_size": None, "draft_vocab_size": None, "max_position_embeddings": None, "rope_theta": None},
           lambda c: _eagle3("midlayer", c), _eagle3_vocab, feeds="aux",
           layer_ids="eagle_config.eagle_aux_hidden_state_layer_ids [i]: captured before layer i + 1 (= layer i's "
                     "output); default [2, L//2, L-3] captured before those layers",
           defaults={"draft_vocab_size": "vocab_size; lm_head then loaded from the target",
                     "d2t": "hot_token_id = d2t + arange", "t2d": "ignored", "fc bias": "config 'bias', false"}),
    Loader("eagle3", "speculators", "Eagle3Converter (convert_model algorithm eagle3)", (SPECULATORS_CONVERTER,),
           "0.9.0",
           "(converts to the speculators format, which vLLM serves: pass eagle_aux_hidden_state_layer_ids and "
           "norm_before_residual)",
           {"hidden_size": None, "intermediate_size": None, "num_attention_heads": None, "num_key_value_heads": None,
            "head_dim": None, "rms_norm_eps": None, "max_position_embeddings": None, "rope_theta": None,
            "draft_vocab_size": None, "target_hidden_size": None},
           lambda c: _eagle3("midlayer", c), _eagle3_vocab, feeds="aux",
           layer_ids="not read from config.json: the eagle_aux_hidden_state_layer_ids argument, vLLM's convention "
                     "(default [2, L//2, L-3])",
           defaults={"rms_norm_eps": "1e-6 when missing", "norm_before_residual": "the argument (false: SGLang's)",
                     "max_position_embeddings": "the larger of the draft's and the verifier's",
                     "midlayer.*": "renamed layers.0.*", "t2d": "gives the target vocabulary size"}),
    Loader("speculators", "vllm", "Eagle3LlamaForCausalLM (via SpeculatorsConfig)", (*VLLM_SPECULATORS, VLLM_EAGLE3,
           VLLM_LLAMA_AUX), "stored versions to 2025",
           "vllm serve TARGET --speculative-config '{\"model\": \"DIR\", \"num_speculative_tokens\": 3}' "
           "(method taken from speculators_model_type)",
           {"speculators_model_type": "eagle3", "speculators_config": None, "transformer_layer_config": None,
            "draft_vocab_size": None, "norm_before_residual": None},
           _speculators_eagle3, _speculators_vocab, feeds="aux",
           layer_ids="eagle_aux_hidden_state_layer_ids [i]: the input of layer i (= layer i-1's output); "
                     "default (2, L//2, L-3)",
           defaults={"norm_before_residual": "true when missing (speculators' own default is false: write it)",
                     "midlayer.*": "renamed layers.0.*", "d2t": "draft_id_to_target_id"}),
    Loader("speculators", "speculators", "Eagle3DraftModel", (SPECULATORS,), "0.9.0",
           "(the package's own class; vLLM serves the folder as above)",
           {"speculators_model_type": "eagle3", "architectures": None, "speculators_config": None,
            "transformer_layer_config": None, "draft_vocab_size": None},
           _speculators_eagle3, _speculators_vocab, feeds="aux",
           layer_ids="as vLLM",
           defaults={"embed_tokens": "loaded from speculators_config.verifier.name_or_path where the table holds a "
                                     "NaN: on transformers 5 the table is uninitialised memory, so by chance",
                     "norm_before_residual": "false", "d2t, t2d": "no buffers (dropped) when draft_vocab_size is "
                                                                  "the verifier's vocab_size",
                     "draft positions": "1 + arange in training (rope is relative: the same logits as vLLM's i)"}),
)


# --- DFlash (block heads; mtp_train.export_dflash writes them) ------------------------------------------------
def _dflash(c: dict, prefix: str = "layers") -> Shapes:
    """A DFlash draft: fc over the context layers, hidden_norm, Qwen3-style layers (per-head q_norm / k_norm), norm."""
    layer_config = c.get("transformer_layer_config") or c
    h, d = layer_config["hidden_size"], _head_dim(layer_config)
    ids = c.get("aux_hidden_state_layer_ids") or (c.get("dflash_config") or {}).get("target_layer_ids") or []
    shapes: Shapes = {"fc.weight": (h, len(ids) * (c.get("target_hidden_size") or h)), "hidden_norm.weight": (h,),
                      "norm.weight": (h,)}
    for i in range(layer_config["num_hidden_layers"]):
        shapes.update(llama_layer(f"{prefix}.{i}", layer_config))
        shapes.update({f"{prefix}.{i}.self_attn.q_norm.weight": (d,), f"{prefix}.{i}.self_attn.k_norm.weight": (d,)})
    return shapes


VLLM_DFLASH = "vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9"
VLLM_SPECULATORS_DFLASH = ("vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py update_dflash "
                           "(versions after cfb173ab, read in a fork's copy: maps aux_hidden_state_layer_ids to "
                           "eagle_aux_hidden_state_layer_ids and dflash_config.target_layer_ids; mask_token_id "
                           "required)")
SGLANG_DFLASH = "sgl-project/sglang python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734"
SGLANG_DFLASH_CONFIG = "sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config"
SPECULATORS_DFLASH = ("speculators 0.9.0 wheel (PyPI): speculators/models/dflash/{config,core,model_definitions}.py "
                      "(DFlashSpeculatorConfig, DFlashDraftModel, Qwen3DFlashDecoderLayer)")
ZLAB_DFLASH = "z-lab/dflash model/dflash.py @ a3516f8 (Qwen3 layers with q_norm / k_norm; dflash_config in config.json)"
# What every DFlash loader builds that a block head must match to be served as trained: the refusal's reasons.
DFLASH_NEEDS = {
    "qk_norm": "per-head q_norm / k_norm (the engines' DFlash layers are Qwen3's: an RMSNorm over each head's q and "
               "k before rope, on the context keys too); this head's layers have none: train with head.qk_norm=true",
    "mask_token_id": "a mask_token_id (the engines embed the mask rows as the target's embedding of "
                     "dflash_config.mask_token_id; vLLM alone overrides that row from a pickled mask_embedding.pt, "
                     "which this project does not write); this head learned its own mask row: train with "
                     "head.mask_token_id=<a reserved id> where the tokenizer has one",
    "anchor_input": "mask rows that read the context only through keys and values (the engines' DFlash blocks add "
                    "nothing to a mask row's input); this head's mask rows also read the anchor "
                    "(head.anchor_input=true): train without it",
}
DFLASH_LOADERS: tuple[Loader, ...] = (
    Loader("dflash", "speculators", "DFlashDraftModel (speculators_model_type dflash)", (SPECULATORS_DFLASH,),
           "0.9.0", "(the package's own class; vLLM serves the folder: method taken from speculators_model_type)",
           {"speculators_model_type": "dflash", "transformer_layer_config": None, "speculators_config": None,
            "draft_vocab_size": None, "block_size": None, "aux_hidden_state_layer_ids": None, "mask_token_id": None},
           _dflash, lambda c: {"lm_head.weight": (c["draft_vocab_size"], c["transformer_layer_config"]["hidden_size"])},
           feeds="aux", layer_ids="aux_hidden_state_layer_ids, as vLLM's (the input of layer i)",
           defaults={"mask_token_id": "required: the mask_token_id property raises when it is None",
                     "embed_tokens, lm_head": "the verifier's (lm_head saved only for a reduced draft vocabulary)",
                     "sample_from_anchor": "false: row 0 is the pending token, rows 1..B-1 draft"}),
    Loader("dflash", "vllm", "DFlashQwen3ForCausalLM (via SpeculatorsConfig)", (VLLM_DFLASH, VLLM_SPECULATORS_DFLASH),
           "the stored versions", "vllm serve TARGET --speculative-config '{\"model\": \"DIR\", "
           "\"num_speculative_tokens\": 15}' (method taken from speculators_model_type)",
           {"speculators_model_type": "dflash", "transformer_layer_config": None, "speculators_config": None,
            "mask_token_id": None, "aux_hidden_state_layer_ids": None},
           _dflash, lambda c: {"lm_head.weight": (c["draft_vocab_size"], c["transformer_layer_config"]["hidden_size"])},
           feeds="aux",
           layer_ids="aux_hidden_state_layer_ids as eagle_aux_hidden_state_layer_ids: the input of layer i",
           defaults={"mask_token_id": "dflash_config.mask_token_id; mask_embedding.pt (torch.load) overrides its row",
                     "mask_hidden": "asserted absent", "causal": "false unless dflash_config.causal or sliding layers",
                     "midlayer.*": "renamed layers.0.*", "rope": "neox unless is_neox_style=false"}),
    Loader("sglang-dflash", "sglang", "DFlashDraftModel (--speculative-algorithm DFLASH)",
           (SGLANG_DFLASH, SGLANG_DFLASH_CONFIG, ZLAB_DFLASH), "the stored version",
           "python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
           "--speculative-draft-model-path DIR",
           {"num_hidden_layers": None, "hidden_size": None, "num_attention_heads": None, "intermediate_size": None,
            "dflash_config": None},
           _dflash, feeds="aux",
           layer_ids="dflash_config.target_layer_ids, 0 <= id < num_target_layers (z-lab's convention: layer id's "
                     "output); absent: build_target_layer_ids(target layers, draft layers)",
           defaults={"q_norm / k_norm": "always built (weights of ones when absent: still a normalisation)",
                     "unknown tensors": "ignored", "block_size": "dflash_config.block_size, else 16",
                     "mask_token_id": "dflash_config.mask_token / mask_token_id"}),
)


def loaders(fmt: str) -> list[Loader]:
    return [loader for loader in LOADERS + DFLASH_LOADERS if loader.fmt == fmt]


def engine_layer_ids(aux_layers: list[int], engine: str) -> list[int]:
    """This project's aux layers (layer outputs) as `engine` reads eagle_aux_hidden_state_layer_ids."""
    shift = {"vllm": 1, "speculators": 1, "sglang": 0}[engine]
    return [layer + shift for layer in aux_layers]


def check(folder: str | Path, loader: Loader) -> list[str]:
    """The ways `folder` (config.json + model.safetensors) differs from what `loader` reads: one line each."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    problems = []
    for key, wanted in loader.required_config.items():
        if key not in config:
            problems.append(f"{loader.engine} {loader.cls}: config.json lacks {key!r}")
        elif wanted is not None and config[key] != wanted:
            problems.append(f"{loader.engine} {loader.cls}: config.json {key}={config[key]!r}, needs {wanted!r}")
    if problems:  # shapes come from the config: without its fields they cannot be derived
        return problems
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    expected, optional = loader.tensors(config), loader.optional(config)
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{loader.engine} {loader.cls}: model.safetensors lacks {name} {shape}")
        elif found[name] != shape:
            problems.append(f"{loader.engine} {loader.cls}: {name} is {found[name]}, the loader builds {shape}")
    for name, shape in found.items():
        if name in expected:
            continue
        if name not in optional:
            problems.append(f"{loader.engine} {loader.cls}: {name} is not read (it would be dropped or refused)")
        elif shape != optional[name]:
            problems.append(f"{loader.engine} {loader.cls}: {name} is {shape}, the loader builds {optional[name]}")
    return problems
