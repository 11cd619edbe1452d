"""A speculators-format export loaded by the speculators package's own classes (0.9.0, in its cached environment).

The writer's output (an EAGLE-3 state dict, since infer has no EAGLE-3 head yet) is read by
SpeculatorModel.from_pretrained: the pydantic config schema accepts config.json, the registry picks Eagle3DraftModel,
every written tensor is held unchanged, nothing the model needs is missing but the verifier's embedding (which the
package loads from speculators_config.verifier) and training-only tensors. Comparing draft logits needs an EAGLE-3
head to compare with: what remains for the EAGLE-3 head's export.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.export import write_speculators
from tests import speculators_env
from tests.test_export import eagle3_state

PROBE = Path(__file__).with_name("speculators_probe.py")


def test_the_speculators_package_loads_a_speculators_export_unchanged(stories_hf_dir, tmp_path):
    state, decoder = eagle3_state()
    target = {"name": "stories260K", "hidden_size": 64, "vocab_size": 512, "path": str(stories_hf_dir)}
    out = write_speculators(tmp_path / "spec", state, decoder, target, ["LlamaForCausalLM"], [1, 2, 4], 3,
                            draft_vocab_size=128)
    result = speculators_env.run(PROBE, str(out), str(tmp_path / "report.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["class"], report["config_class"]) == ("Eagle3DraftModel", "Eagle3SpeculatorConfig")
    assert report["draft_vocab_size"] == 128 and report["aux_layer_ids"] == [2, 3, 5]
    assert report["not_held"] == [] and report["changed"] == []
    assert report["not_written"] == ["embed_tokens.weight", "rotary_emb.inv_freq", "rotary_emb.original_inv_freq",
                                     "verifier_lm_head.weight", "verifier_norm.weight"]
