"""Run inside the speculators environment (tests/speculators_env.py): load a folder with the package's own classes.

    python speculators_probe.py FOLDER REPORT.json

SpeculatorModel.from_pretrained picks the class from config.json's speculators_model_type, validates the config
with the package's pydantic schema and loads model.safetensors (and the verifier's embedding from
speculators_config.verifier.name_or_path). The report says which written tensors the model holds unchanged.
"""

import json
import sys

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel

folder, report = sys.argv[1], sys.argv[2]
model = SpeculatorModel.from_pretrained(folder)
state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
written = load_file(f"{folder}/model.safetensors")
json.dump({
    "class": type(model).__name__,
    "config_class": type(model.config).__name__,
    "draft_vocab_size": model.config.draft_vocab_size,
    "aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids,
    "not_held": sorted(k for k in written if k not in state),
    "changed": sorted(k for k in written if k in state and not torch.equal(state[k].detach().to(written[k].dtype),
                                                                            written[k])),
    "not_written": sorted(k for k in state if k not in written),
}, open(report, "w"), indent=2)
