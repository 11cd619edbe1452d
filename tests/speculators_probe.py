"""Run inside the speculators environment (tests/speculators_env.py): load exports with the package's own classes and
run its own forward on the inputs given.

    python speculators_probe.py JOB.json

JOB.json: {"inputs": INPUTS.safetensors, "ttt_steps": K, "dtypes": ["float32", ...], "loads": [{"name", "folder",
"convert", "report", "logits"}, ...]}. Each load takes `folder` as it is (a speculators export:
SpeculatorModel.from_pretrained picks the class from speculators_model_type, validates config.json with the
package's pydantic schema, loads model.safetensors and the verifier's embedding from
speculators_config.verifier.name_or_path), or, with "convert": {"verifier", "eagle_aux_hidden_state_layer_ids",
"norm_before_residual", "output"}, first converts it with the package's EAGLE-3 converter (convert_model, algorithm
"eagle3") into `output` and loads that. A load with "kind": "dflash" is a `dflash` export (DFlashDraftModel), run by
`run_dflash` on the INPUTS keys dflash.*.

INPUTS holds input_ids [T] (t_{i+1}), position_ids [T] (i, vLLM's draft positions) and, per dtype and case,
DTYPE.hidden.CASE [T, 3H]: the target's aux states concatenated as the caller says the engine captures them.
Eagle3DraftModel.forward, the model cast to DTYPE, runs ttt_steps steps (step k: the layer's own pre-norm output of
step k - 1, the tokens shifted by k, positions + k, causal attention over step 0's keys plus the diagonal of each
later step; the inputs padded to whole attention blocks, see `pad`) and returns argmax ids only, so a hook on
lm_head records the draft-vocabulary logits of every step: written as DTYPE.CASE.stepK [T, draft vocab], with
draft_to_target = arange + d2t (the target id of each draft logit).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel
from speculators.convert.entrypoints import convert_model
from speculators.utils.loading import load_model_layers

BLOCK = 128  # torch flex attention's default block size


def pad(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """[T, ...] -> [1, T', ...], T' a multiple of flex attention's block size (the package's block-mask extension for
    TTT steps assumes whole blocks, as its trainer packs them); document id -1 marks the padding, which no real query
    attends (causal, and padding comes last)."""
    extra = -len(tensor) % BLOCK
    return torch.cat([tensor, tensor.new_full((extra, *tensor.shape[1:]), value)])[None]


def run(load: dict, inputs: dict, ttt_steps: int, dtypes: list[str]) -> None:
    folder = load["folder"]
    if load.get("convert"):
        options = dict(load["convert"])
        output, verifier = options.pop("output"), options.pop("verifier")
        convert_model(model=folder, verifier=verifier, algorithm="eagle3", output_path=output, **options)
        folder = output
    model = SpeculatorModel.from_pretrained(folder).eval()
    verifier = load_model_layers(["embed_tokens.weight"], model.config.speculators_config.verifier.name_or_path)
    embedding_loaded = torch.equal(model.embed_tokens.weight, verifier["embed_tokens.weight"])
    # from_pretrained loads the verifier's embedding only where the table holds a NaN (its "not loaded" mark, set in
    # __init__); under transformers 5 the table is uninitialised memory instead, so it loads it by chance. The
    # package's own loader again, told to overwrite (vLLM takes the target's embedding itself).
    model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    written = load_file(f"{folder}/model.safetensors")
    json.dump({
        "embedding_loaded_by_from_pretrained": embedding_loaded,
        "class": type(model).__name__,
        "config_class": type(model.config).__name__,
        "draft_vocab_size": model.config.draft_vocab_size,
        "aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids,
        "norm_before_residual": model.config.norm_before_residual,
        "not_held": sorted(k for k in written if k not in state),
        "changed": sorted(k for k in written if k in state and not torch.equal(
            state[k].detach().to(written[k].dtype), written[k])),
        "not_written": sorted(k for k in state if k not in written),
    }, open(load["report"], "w"), indent=2)

    captured = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0].detach()))
    ids, positions, documents = (pad(inputs["input_ids"], 0), pad(inputs["position_ids"], 0),
                                 pad(torch.zeros_like(inputs["input_ids"]), -1))
    offsets = model.d2t if model.d2t is not None else 0  # no d2t buffer when the draft vocabulary is the target's
    out = {"draft_to_target": torch.arange(model.config.draft_vocab_size) + offsets}
    for dtype in dtypes:
        model.to(getattr(torch, dtype))
        for key, hidden in inputs.items():
            if not key.startswith(f"{dtype}.hidden."):
                continue
            captured.clear()
            with torch.no_grad():
                model(hidden_states=pad(hidden, 0.0), input_ids=ids, document_ids=documents, position_ids=positions,
                      ttt_steps=ttt_steps)
            for step, logits in enumerate(captured):
                out[f"{key.replace('.hidden.', '.')}.step{step}"] = logits[: len(hidden)].contiguous()
    save_file(out, load["logits"])


def held(model: torch.nn.Module, folder: str) -> dict:
    """How the loaded model holds the folder's tensors: names it lacks, changed, and its own not in the folder."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    written = load_file(f"{folder}/model.safetensors")
    return {"not_held": sorted(k for k in written if k not in state),
            "changed": sorted(k for k in written if k in state and not torch.equal(
                state[k].detach().to(written[k].dtype), written[k])),
            "not_written": sorted(k for k in state if k not in written)}


def run_dflash(load: dict, inputs: dict) -> None:
    """A dflash export by the package's DFlashDraftModel, one block a case: INPUTS dflash.pending [1] (the pending
    token) and dflash.hidden.CASE [T, n H] (the context's target states, concatenated as the caller says the engine
    captures them). The package's own modules, in its training forward's order (fc, hidden_norm, the block [pending,
    mask_token_id x (B-1)] embedded, each Qwen3DFlashDecoderLayer over context + block at positions 0..T+B-1, norm,
    lm_head), with eager attention and no mask (the block sees the whole context and itself); the logits of rows
    1..B-1 written as dflash.CASE [B-1, V]."""
    model = SpeculatorModel.from_pretrained(load["folder"]).eval()
    model.load_verifier_weights()  # the verifier's embedding and (full vocabulary) lm_head, as the package reloads
    model.config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    config = model.config
    json.dump({"class": type(model).__name__, "config_class": type(config).__name__, "block_size": config.block_size,
               "mask_token_id": config.mask_token_id, "aux_layer_ids": config.aux_hidden_state_layer_ids,
               "layer_class": type(model.layers[0]).__name__, **held(model, load["folder"])},
              open(load["report"], "w"), indent=2)
    out = {}
    for key, hidden in inputs.items():
        if not key.startswith("dflash.hidden."):
            continue
        length, block = hidden.shape[0], model.block_size
        ids = torch.full((1, block), model.mask_token_id, dtype=torch.long)
        ids[0, 0] = inputs["dflash.pending"][0]
        with torch.no_grad():
            context = model.hidden_norm(model.fc(hidden[None]))
            x = model.embed_tokens(ids)
            positions = torch.arange(length + block)[None]
            rope = model.rotary_emb(x, positions)
            for layer in model.layers:
                x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=positions,
                          position_embeddings=rope)
            out[key.replace(".hidden.", ".")] = model.lm_head(model.norm(x))[0, 1:].contiguous()
    save_file(out, load["logits"])


def main() -> None:
    job = json.load(open(sys.argv[1]))
    inputs = load_file(job["inputs"])
    for load in job["loads"]:
        if load.get("kind") == "dflash":
            run_dflash(load, inputs)
        else:
            run(load, inputs, job["ttt_steps"], job["dtypes"])


if __name__ == "__main__":
    main()
