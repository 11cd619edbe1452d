"""EAGLE-3 and DFlash exports run by the speculators package's own classes (0.9.0, vLLM's; in its cached environment).

A perturbed EAGLE-3 head on stories260K (a 128-id draft vocabulary, layer ids out of order) is exported in both
EAGLE-3 formats. The package loads the `speculators` export with SpeculatorModel.from_pretrained, and converts the
`eagle3` export with its own EAGLE-3 converter first; each is fed the token ids and the target's aux states as
vLLM captures them (the three layers' pre-norm outputs from infer's Llama, concatenated in layer order) and runs
its own forward for two TTT steps, in fp32 and fp64. Its draft-vocabulary logits must equal the head's (step 0 and
the head's step 1, mtp_train.unroll) within 1e-5 (of the logits' scale in fp32, see `tolerance`), its d2t must map
draft ids to the same target ids, and the broken controls (the states of the next layers, an off-by-one layer id;
the layers in reverse order) must miss by far. `pytest -rP` shows the measured differences.

In the same probe run, a block head with q/k norms and a reserved mask id (tests/test_export_dflash.py) is exported
as `dflash` and run by the package's DFlashDraftModel on one block after six context positions: its draft logits
must equal the head's within the same tolerance, and the context states in the head's own (unsorted) order miss.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.attention import PackedCausalAttention
from infer.models.mtp_head import copy_head, shared_weights
from mtp_train.data import PackedBatch
from mtp_train.engine_loaders import engine_layer_ids
from mtp_train.export import export_head
from mtp_train.unroll import batch_plan, unrolled_steps
from tests import speculators_env
from tests.test_export import eagle3_head
from tests.test_export_dflash import IDS, block_logits, dflash_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROBE = Path(__file__).with_name("speculators_probe.py")
STEPS = 2
TOLERANCE = 1e-5
CONTROLS = ("off_by_one", "reversed")  # each must miss by more than the tolerance


def tolerance(dtype: str, ours: torch.Tensor) -> float:
    """1e-5 absolute in float64 (both sides still take norms and rope in fp32, the floor: about 1.5e-6 here); in
    float32 1e-5 of the logits' scale, since each implementation alone is about 1.3e-5 from its float64 run at
    logits of magnitude 10 (fp32 rounding, which the two sum differently)."""
    return TOLERANCE * (ours.abs().max().item() if dtype == "float32" else 1.0)


def head_and_inputs(head, target, ids: torch.Tensor, cases: dict[str, list[int]]) -> tuple[list, dict]:
    """The head's draft-vocabulary logits per TTT step (mtp_train.unroll, as it trains and drafts), and per case the
    target's aux states at those layers, concatenated, for the package (rows: anchors 0..n-2)."""
    n = len(ids)
    out = target(ids, torch.arange(n), PackedCausalAttention([n]), [None] * 5,
                 aux_layers=tuple(sorted({layer for case in cases.values() for layer in case})))
    aux = out.aux_hidden_states
    batch = PackedBatch(ids, out.hidden_states, torch.ones(n, dtype=torch.bool), [n], [0],
                        torch.stack([aux[layer] for layer in head.target_aux_layers], dim=1))
    with torch.no_grad():
        ours = [head.compute_logits(step_out.hidden_states)[:, head.draft_token_ids()]
                for _, step_out in unrolled_steps(head, batch, batch_plan(batch, STEPS))]
    return ours, {name: torch.cat([aux[layer] for layer in case], dim=-1)[:-1].contiguous()
                  for name, case in cases.items()}


def run_conformance(stories_model, stories_hf_dir, root: Path, norm_before_residual: bool) -> dict:
    """The head's draft logits per dtype and step, and the package's per load (one probe run for all): both formats
    for a head whose residual is the fused state, the speculators format alone for one normed before the residual
    (SGLang's eagle3 format refuses it)."""
    head = eagle3_head(stories_model, norm_before_residual=norm_before_residual)
    n = 24
    ids = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(5))
    layers = sorted(head.target_aux_layers)  # vLLM and SGLang capture the aux states in layer order
    cases = {"served": layers, "off_by_one": [layer + 1 for layer in layers], "reversed": layers[::-1]}
    target64 = copy.deepcopy(stories_model).double()
    head64 = copy_head(head).double().attach(shared_weights(target64))
    ours, inputs = {}, {"input_ids": ids[1:], "position_ids": torch.arange(n - 1)}
    for dtype, (h, target) in {"float32": (head, stories_model), "float64": (head64, target64)}.items():
        ours[dtype], hidden = head_and_inputs(h, target, ids, cases)
        inputs.update({f"{dtype}.hidden.{name}": tensor for name, tensor in hidden.items()})
    spec = export_head(head, "speculators", root / "spec", target=stories_hf_dir)
    loads = [{"name": "speculators", "folder": str(spec), "convert": None}]
    if not norm_before_residual:  # a block head's dflash export, in the same probe run (tests/test_export_dflash.py)
        block = dflash_head(stories_model)
        features = torch.randn(6, len(IDS), stories_model.config.hidden_size,
                               generator=torch.Generator().manual_seed(2))
        dflash_ours = block_logits(block, features, [5])[0]
        ascending_ids = sorted(range(len(IDS)), key=IDS.__getitem__)  # the engines concatenate in layer order
        inputs.update({"dflash.pending": torch.tensor([5]),
                       "dflash.hidden.served": features[:, ascending_ids].flatten(1).contiguous(),
                       "dflash.hidden.head_order": features.flatten(1).contiguous()})
        loads.append({"name": "dflash", "kind": "dflash",
                      "folder": str(export_head(block, "dflash", root / "dflash", target=stories_hf_dir))})
    if not norm_before_residual:
        eagle3 = export_head(head, "eagle3", root / "eagle3", target=stories_hf_dir)
        eagle3_config = json.loads((eagle3 / "config.json").read_text())
        convert = {"verifier": str(stories_hf_dir), "output": str(root / "converted"),
                   # the converter reads neither from the eagle3 config.json (it takes them as arguments)
                   "eagle_aux_hidden_state_layer_ids": engine_layer_ids(eagle3_config["export"]["aux_layers"], "vllm"),
                   "norm_before_residual": eagle3_config["norm_before_residual"]}
        loads.append({"name": "eagle3", "folder": str(eagle3), "convert": convert})
    save_file(inputs, str(root / "inputs.safetensors"))
    for load in loads:
        load.update(report=str(root / f"{load['name']}.json"), logits=str(root / f"{load['name']}.safetensors"))
    job = root / "job.json"
    job.write_text(json.dumps({"inputs": str(root / "inputs.safetensors"), "ttt_steps": STEPS,
                               "dtypes": list(ours),
                               "loads": loads}))
    result = speculators_env.run(PROBE, str(job))
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = {load["name"]: (json.loads(Path(load["report"]).read_text()), load_file(load["logits"]))
              for load in loads}
    return {"head": head, "ours": ours, "theirs": theirs, "dflash": None if norm_before_residual else dflash_ours}


@pytest.fixture(scope="module")
def conformance(stories_model, stories_hf_dir, tmp_path_factory):
    """norm_before_residual -> run_conformance's result, run once per module for each."""
    runs: dict[bool, dict] = {}

    def get(norm_before_residual: bool) -> dict:
        if norm_before_residual not in runs:
            root = tmp_path_factory.mktemp(f"speculators_nbr{int(norm_before_residual)}")
            runs[norm_before_residual] = run_conformance(stories_model, stories_hf_dir, root, norm_before_residual)
        return runs[norm_before_residual]

    return get


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Over the rows both have: step k of the package also scores the k last anchors, on padding tokens."""
    return (ours - theirs[: len(ours)]).abs().max().item()


@pytest.mark.parametrize(("fmt", "norm_before_residual"),
                         [("speculators", False), ("eagle3", False), ("speculators", True)])
def test_the_speculators_package_computes_the_heads_draft_logits_from_its_export(conformance, fmt,
                                                                                 norm_before_residual):
    run = conformance(norm_before_residual)
    report, logits = run["theirs"][fmt]
    assert (report["class"], report["config_class"]) == ("Eagle3DraftModel", "Eagle3SpeculatorConfig")
    assert report["draft_vocab_size"] == 128 and report["aux_layer_ids"] == [1, 2, 4]
    assert report["norm_before_residual"] is norm_before_residual
    assert torch.equal(logits["draft_to_target"], run["head"].draft_token_ids())
    diffs = {(dtype, case, step): (max_diff(ours, logits[f"{dtype}.{case}.step{step}"]), tolerance(dtype, ours))
             for dtype, steps in run["ours"].items() for case in ("served", *CONTROLS)
             for step, ours in enumerate(steps)}
    print(f"{fmt}, norm_before_residual={norm_before_residual} (embedding loaded by from_pretrained itself: {report['embedding_loaded_by_from_pretrained']}): "
          "max |draft logit diff| against the head (tolerance): " + ", ".join(
              f"{dtype} {case} step {step} {diff:.2e} ({bound:.1e})"
              for (dtype, case, step), (diff, bound) in diffs.items()))
    for (dtype, case, step), (diff, bound) in diffs.items():
        assert (diff <= bound) == (case == "served"), (dtype, case, step, diff, bound)


def test_the_speculators_package_holds_the_export_unchanged(conformance):
    report, _ = conformance(False)["theirs"]["speculators"]
    assert report["not_held"] == [] and report["changed"] == []
    # the embedding comes from the verifier (speculators_config.verifier), the rest is training-only
    assert report["not_written"] == ["embed_tokens.weight", "rotary_emb.inv_freq", "rotary_emb.original_inv_freq",
                                     "verifier_lm_head.weight", "verifier_norm.weight"]


def test_the_speculators_package_computes_the_block_heads_drafts_from_its_dflash_export(conformance):
    """speculators 0.9.0's DFlashDraftModel (Qwen3DFlashDecoderLayer) on the dflash export of a block head with q/k
    norms and a reserved mask id: the same draft logits at every block row from the context states in layer order;
    the states in the head's own (unsorted) order miss (the control)."""
    run = conformance(False)
    report, logits = run["theirs"]["dflash"]
    assert (report["class"], report["config_class"], report["layer_class"]) == (
        "DFlashDraftModel", "DFlashSpeculatorConfig", "Qwen3DFlashDecoderLayer")
    assert (report["block_size"], report["mask_token_id"], report["aux_layer_ids"]) == (4, 3, [1, 2, 4])
    assert report["not_held"] == [] and report["changed"] == []
    ours = run["dflash"]
    served, control = (max_diff(ours, logits[f"dflash.{case}"]) for case in ("served", "head_order"))
    print(f"dflash: max |draft logit diff| {served:.2e} (tolerance {tolerance('float32', ours):.1e}), "
          f"states in the head's order {control:.2e}")
    assert served <= tolerance("float32", ours) < control
