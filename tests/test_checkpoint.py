"""Resume's identity check (mtp_train.checkpoint) across versions of the head config, and its choice of the newest
whole checkpoint.

A DeepSeek-V2 run saved before the head config gained hidden_state, mlp, the EAGLE-3 fields and the decoder's MoE
fields resumes under this version while the run keeps those fields at their defaults (a dense head ignores the MoE
fields); a run that changes one of them is refused, naming it. No DeepSpeed: a stand-in records what resume loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from transformers import DeepseekV2Config

from infer.models.mtp_head import MOE_DECODER_KEYS, head_config_for
from mtp_train import checkpoint

# What MTPHeadConfig gained after a DeepSeek-V2 run could first be saved (head.hidden_state and head.mlp with the
# decoder's MoE fields, then the EAGLE-3 fields).
NEW_FIELDS = ("hidden_state", "mlp", "aux_layer_ids", "draft_vocab_size", "trainable_lm_head")


class StandInZeroHead:
    """What resume calls of mtp_train.distributed.ZeroHead once the identity matches."""

    def __init__(self, step: int) -> None:
        self.step, self.loaded = step, False

    def load(self, checkpoint_dir: Path, tag: str) -> tuple[Path, dict]:
        self.loaded = True
        return Path(checkpoint_dir) / tag, {"step": self.step}


def identity(**head_changes) -> dict:
    """The trainer's run identity (mtp_train.trainer.run_identity) for a DeepSeek-V2 MTP head."""
    target = DeepseekV2Config(vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
    head = replace(head_config_for(target, {"name": "tiny-dsv2"}), **head_changes)
    return {"target": {"name": "tiny-dsv2"}, "seed": 0, "world_size": 1, "head": asdict(head) | {"target": None},
            "loss": {"kl": 1.0}}


def old_checkpoint(tmp_path: Path, step: int = 3) -> Path:
    """checkpoint_dir with a run.json as a version before NEW_FIELDS and the MoE decoder fields wrote it."""
    saved = identity()
    saved["head"] = {k: v for k, v in saved["head"].items() if k not in NEW_FIELDS}
    saved["head"]["decoder"] = {k: v for k, v in saved["head"]["decoder"].items() if k not in MOE_DECODER_KEYS}
    folder = tmp_path / "checkpoints"
    (folder / checkpoint.tag(step)).mkdir(parents=True)
    (folder / checkpoint.tag(step) / checkpoint.RUN_FILE).write_text(json.dumps({"step": step, **saved}))
    (folder / "latest").write_text(checkpoint.tag(step))
    return folder


def test_an_old_deepseek_run_resumes_while_the_new_head_fields_hold_their_defaults(tmp_path):
    zero_head = StandInZeroHead(3)
    mine = identity()
    assert {"n_routed_experts", "moe_intermediate_size"} <= set(mine["head"]["decoder"])  # this version writes them
    assert checkpoint.resume(zero_head, old_checkpoint(tmp_path), mine, ignore_mismatch=False) == 3
    assert zero_head.loaded


@pytest.mark.parametrize("changes,named", [
    ({"mlp": "moe"}, "head.decoder.moe_intermediate_size: checkpoint None, this run 16"),  # an MoE head reads them
    ({"hidden_state": "post_norm"}, "head.hidden_state: checkpoint 'pre_norm', this run 'post_norm'"),
    ({"enorm": False}, "head.enorm: checkpoint True, this run False"),  # a field both versions write
])
def test_an_old_run_is_refused_when_this_run_changes_a_field_naming_it(tmp_path, changes, named):
    zero_head = StandInZeroHead(3)
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.resume(zero_head, old_checkpoint(tmp_path), identity(**changes), ignore_mismatch=False)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not zero_head.loaded


def test_a_changed_moe_field_of_an_moe_head_is_refused(tmp_path):
    saved = identity(mlp="moe")
    folder = tmp_path / "checkpoints"
    (folder / "step_2").mkdir(parents=True)
    (folder / "step_2" / checkpoint.RUN_FILE).write_text(json.dumps({"step": 2, **saved}))
    (folder / "latest").write_text("step_2")
    mine = identity(mlp="moe")
    mine["head"]["decoder"]["n_routed_experts"] = 8
    with pytest.raises(checkpoint.ResumeError, match="head.decoder.n_routed_experts: checkpoint 4, this run 8"):
        checkpoint.resume(StandInZeroHead(2), folder, mine, ignore_mismatch=False)


def whole_checkpoint(folder: Path, step: int) -> Path:
    """checkpoint_dir/step_N as `save` publishes it: a shard, run.json and files.json listing the shard."""
    tagged = folder / checkpoint.tag(step)
    tagged.mkdir(parents=True)
    (tagged / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(bytes(range(256)) * 40)
    (tagged / checkpoint.RUN_FILE).write_text(json.dumps({"step": step, **identity()}))
    (tagged / checkpoint.FILES_FILE).write_text(json.dumps(checkpoint._listing(tagged)))
    (folder / "latest").write_text(checkpoint.tag(step))
    return tagged


def test_resume_passes_over_a_damaged_checkpoint_to_the_newest_whole_one_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        whole_checkpoint(folder, step)
    shard = folder / "step_6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])  # cut short: a disk that failed under it
    flipped = folder / "step_4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flipped.write_bytes(b"\xff" + flipped.read_bytes()[1:])  # its size right, one byte wrong
    (folder / ".step_8.partial").mkdir()  # a save killed before it was published
    assert checkpoint.choose(folder) == folder / "step_2"
    note = capsys.readouterr().err
    assert f"{shard} has 1,000 bytes, files.json lists 10,240" in note
    assert f"{flipped} does not match its sha256 in files.json" in note
    assert f"removing {folder / '.step_8.partial'}" in note and not (folder / ".step_8.partial").exists()
    zero_head = StandInZeroHead(2)
    assert checkpoint.resume(zero_head, folder, identity(), ignore_mismatch=False) == 2 and zero_head.loaded


def test_latest_is_read_first_and_no_checkpoint_is_a_fresh_start(tmp_path):
    folder = tmp_path / "checkpoints"
    assert checkpoint.choose(folder) is None and checkpoint.resume(StandInZeroHead(0), folder, identity(), False) == 0
    whole_checkpoint(folder, 4), whole_checkpoint(folder, 2)  # latest names step_2: a rerun's earlier save
    assert checkpoint.choose(folder) == folder / "step_2"


def test_every_checkpoint_damaged_is_one_error_naming_the_newest_file(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (2, 4):
        (whole_checkpoint(folder, step) / checkpoint.FILES_FILE).write_text("{")
    with pytest.raises(checkpoint.ResumeError) as err:
        checkpoint.resume(StandInZeroHead(4), folder, identity(), ignore_mismatch=False)
    assert str(err.value) == (f"no checkpoint in {folder} can be resumed from: {folder / 'step_4' / 'files.json'} is "
                              "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                              "point trainer.checkpoint_dir elsewhere or set trainer.resume=false")
