"""The block head's training options. D-PACE per-position weights (mtp_train.block_unroll, head.position_weight=dpace):
the weights against hand-worked values, the draft confidence they read, the objective's loss against a materialised
reference on an untrained block head started from stories260K's last layer, a few training steps with it, and its
config values; head.mask_token_id from the config into the head (its function: tests/test_block_head.py);
head.num_key_value_heads (wider values: the same function at the start); the block attention against a per-head
reference, and a batch of contexts of different lengths against each drafted alone; head.anchor_input (the mask rows
reading the anchor) from the config to the runtime, whose drafts equal the training forward's."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch

from data_tools.config import ConfigError
from infer.engine import Engine, EngineConfig
from infer.models.block_head import block_attention
from infer.models.mtp_head import HeadLoadError, head_config_for, init_head_from_target
from infer.sampling_params import SamplingParams
from mtp_train.block_unroll import (BlockObjective, anchor_plan, block_outputs, block_rows, dpace_weights,
                                    greedy_confidence)
from mtp_train.config import compose_training
from mtp_train.data import PackedBatch
from mtp_train.export_dflash import dflash_problems
from mtp_train.heads import head_config
from mtp_train.losses import target_distribution
from mtp_train.unroll import LossWeights
from mtp_train.validate import packed_target_forward
from tests.fitted_block_head import objective_for
from tests.fitted_head import TRAIN_PROMPTS, adam_fit, greedy_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_dpace_weights_are_the_smoothed_prefix_products_summed_to_the_block_end():
    q = torch.tensor([[0.5, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.3, 0.0]])
    trained = torch.tensor([[True, True, True], [True, True, False], [True, False, True]])
    # row 0: s = .75, 1, .5 -> prefix .75, .75, .375 -> suffix sums 1.875, 1.125, .375
    # row 1: s = 1, 1, (untrained) 1 -> prefix x mask 1, 1, 0 -> 2, 1, 0
    # row 2: s = .5, (untrained) 1, .5 -> prefix x mask .5, 0, .25 -> .75, 0, .25
    expected = torch.tensor([[1.875, 1.125, 0.375], [2.0, 1.0, 0.0], [0.75, 0.0, 0.25]])
    assert torch.allclose(dpace_weights(q, trained, 0.5), expected)
    # control: alpha = 1 ignores the confidence: each trained row counts the trained rows from it to the end
    assert torch.equal(dpace_weights(q, trained, 1.0), torch.tensor([[3.0, 2.0, 1.0], [2.0, 1.0, 0.0],
                                                                    [2.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"head.dpace_alpha=0.0 must be in \(0, 1\]"):
        dpace_weights(q, trained, 0.0)


def test_greedy_confidence_is_the_drafts_probability_of_the_target_token():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 4, 8, generator=gen), torch.randn(11, 8, generator=gen)
    greedy = torch.tensor([[0, 5, 10, -1], [3, 3, 3, 3], [-1, 7, 1, 2]])
    probs = torch.softmax(hidden @ weight.T, dim=-1)
    expected = torch.where(greedy >= 0, probs.gather(-1, greedy.clamp(min=0)[..., None])[..., 0], 0.0)
    for chunk in (1, 5, 64):
        assert torch.allclose(greedy_confidence(hidden, weight, greedy, chunk), expected, atol=1e-6)


@pytest.fixture(scope="module")
def engine(stories_model, stories_tokenizer) -> Engine:
    return Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=256))


def fresh_head(engine: Engine):
    torch.manual_seed(0)
    return init_head_from_target(engine.model, "stories260K", "block", block_size=8, num_layers=1)


@pytest.fixture(scope="module")
def batch(engine):
    return greedy_batch(engine, TRAIN_PROMPTS[:4], fresh_head(engine).target_aux_layers, max_new_tokens=32)[0]


def dpace_objective(engine: Engine, head, alpha: float = 0.5) -> BlockObjective:
    model = engine.model
    return BlockObjective(head, model.model.norm.weight, float(model.config.rms_norm_eps), LossWeights(kl=1.0, ce=0.0),
                          16, 7.0, position_weight="dpace", dpace_alpha=alpha)


def test_dpace_objective_weights_each_rows_kl_by_its_blocks_confidence(engine, batch):
    block_head = fresh_head(engine)
    dpace, decay = dpace_objective(engine, block_head), objective_for(engine, block_head)
    plan = dpace.plan(batch)
    counts = dpace.counts(batch, plan)
    with torch.no_grad():
        loss, stats = dpace(batch, counts, plan)
        decay_loss, decay_stats = decay(batch, counts, plan)
        # the reference, materialised: KL per row from full softmaxes, weights from the rows' confidences
        rows, trained = block_rows(plan, block_head.block_size, batch.loss_mask)
        hidden = block_head.final_norm(block_outputs(block_head, batch, plan))[:, 1:]
        log_q = torch.log_softmax(hidden @ block_head.lm_head_weight().T, dim=-1)
        target = target_distribution(batch.hidden_states, dpace.target_norm, block_head.shared.lm_head, None, 4096)
        p, greedy = target.probs[rows], target.greedy[rows]
        kl = (p * (p.clamp(min=1e-30).log() - log_q)).sum(-1)
        confidence = log_q.gather(-1, greedy[..., None])[..., 0].exp()
        weights = dpace_weights(confidence, trained, 0.5)
        expected = ((weights * kl).sum(0) / counts.clamp(min=1)).sum()
    assert torch.allclose(loss, expected, rtol=1e-4), (loss, expected)
    assert torch.equal(stats, decay_stats)  # the weights change the loss, never what is reported
    assert not torch.allclose(decay_loss, expected, rtol=1e-2)  # control: the exp(-(k-1)/gamma) loss is another


def test_training_steps_with_dpace_lower_its_loss(engine, batch):
    head = fresh_head(engine).train().requires_grad_(True)
    objective = dpace_objective(engine, head)
    plan = objective.plan(batch)
    counts = objective.counts(batch, plan)
    before = float(objective(batch, counts, plan)[0].detach())
    adam_fit(head, objective, batch, plan, counts, steps=4, lr=3e-3)
    after = float(objective(batch, counts, plan)[0].detach())
    assert after < before, (before, after)


def test_position_weight_config_values_are_checked():
    cfg = compose_training(["head=block", "head.position_weight=dpace", "head.dpace_alpha=0.25"], complete=False)
    assert (cfg.head.position_weight, cfg.head.dpace_alpha) == ("dpace", 0.25)
    assert compose_training(["head=block"], complete=False).head.position_weight == "exp_decay"  # the recipe's
    with pytest.raises(ConfigError, match="head.position_weight must be one of exp_decay, dpace, got 'linear'"):
        compose_training(["head=block", "head.position_weight=linear"], complete=False)
    with pytest.raises(ConfigError, match="head.dpace_alpha must be"):
        compose_training(["head=block", "head.dpace_alpha=0"], complete=False)


def test_mask_token_id_config_reaches_the_head_config(stories_model):
    cfg = compose_training(["head=block", "head.mask_token_id=3"], complete=False)
    assert head_config(stories_model.config, cfg.head, {}).mask_token_id == 3
    assert head_config(stories_model.config, compose_training(["head=block"], complete=False).head,
                       {}).mask_token_id is None  # the recipe's: a learned mask row
    with pytest.raises(ConfigError, match="head.mask_token_id must be >= 0"):
        compose_training(["head=block", "head.mask_token_id=-1"], complete=False)


def test_anchor_input_config_reaches_the_head_config_and_is_not_exported_as_dflash(stories_model):
    """stories260K's recipe reads the anchor (docs/block_head.md); the option is false in conf/head/block.yaml (the
    DFlash formats' head) and can be set either way."""
    config = head_config(stories_model.config, compose_training(["head=block"], complete=False).head, {})
    assert config.anchor_input  # the recipe's
    off = compose_training(["head=block", "head.anchor_input=false"], complete=False)
    assert not head_config(stories_model.config, off.head, {}).anchor_input
    assert any("head.anchor_input=true" in reason for reason in dflash_problems(config))
    with pytest.raises(HeadLoadError, match="anchor_input are block head options, not mtp's"):
        head_config_for(stories_model.config, {}, "mtp", anchor_input=True)


def test_more_key_value_heads_start_as_the_target_layer(stories_model):
    """head.num_key_value_heads=8 on a target of 4: the untrained block head is the same function as the 4-head one
    (each key and value head repeated for the query heads it served; tiled instead, the control, it is not), and the
    trainer's config reaches it (served: tests/test_block_head.py)."""
    wide = init_head_from_target(stories_model, "stories260K", "block", block_size=4, num_key_value_heads=8)
    narrow = init_head_from_target(stories_model, "stories260K", "block", block_size=4)
    assert wide.layers[0].self_attn.num_kv_heads == 8 and narrow.layers[0].self_attn.num_kv_heads == 4
    gen = torch.Generator().manual_seed(1)
    features, first = torch.randn(12, 64, generator=gen), torch.tensor([5, 9])
    positions, valid = 12 + torch.arange(4).expand(2, -1), torch.arange(12).expand(2, -1) < torch.tensor([[12], [7]])

    def logits(head) -> torch.Tensor:
        with torch.no_grad():
            context = [kv[None] for kv in head.context_kv(features, torch.arange(12))]
            return head(first, positions, context, valid)

    torch.testing.assert_close(logits(wide), logits(narrow), rtol=1e-5, atol=1e-5)
    tiled = deepcopy(wide)
    with torch.no_grad():  # the broken control: key / value heads 0 1 2 3 0 1 2 3 instead of 0 0 1 1 2 2 3 3
        for proj in (tiled.layers[0].self_attn.k_proj, tiled.layers[0].self_attn.v_proj):
            rows = proj.weight.unflatten(0, (8, -1))
            proj.weight.copy_(torch.cat((rows[0::2], rows[0::2])).flatten(0, 1))
    assert (logits(tiled) - logits(narrow)).abs().max() > 1e-2

    with pytest.raises(HeadLoadError, match="num_key_value_heads=3 must divide"):
        head_config_for(stories_model.config, {}, "block", num_key_value_heads=3)
    cfg = compose_training(["head=block", "head.num_key_value_heads=8"], complete=False)
    assert head_config(stories_model.config, cfg.head, {}).decoder["num_key_value_heads"] == 8


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_step_runs_the_last_layer_on_the_rows_it_keeps(stories_model, num_layers):
    """The runtime's K drafts (the last layer querying and running its MLP on rows 1..K alone, every row's keys and
    values still read) equal the first K of the whole block's; the control, rows 2..K+1, does not."""
    head = init_head_from_target(stories_model, "stories260K", "block", block_size=8, num_layers=num_layers)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        head.mask_embedding.normal_(generator=gen)  # mask rows unlike each other's neighbours' positions
        features, first = torch.randn(10, 64, generator=gen), torch.tensor([5, 9, 11])
        context = [kv[None] for kv in head.context_kv(features, torch.arange(10))]
        positions = 10 + torch.arange(8).expand(3, -1)
        valid = torch.arange(10).expand(3, -1) < torch.tensor([[10], [6], [9]])
        whole = head(first, positions, context, valid)
        kept = head(first, positions, context, valid, num_drafts=3)
    assert kept.shape == (3, 3, 512)
    torch.testing.assert_close(kept, whole[:, :3], rtol=1e-5, atol=1e-5)
    assert (kept - whole[:, 1:4]).abs().max() > 1e-2


def _per_head_attention(q, k, v, mask, group):
    """Written out per block, row and query head: query head h reads key/value head h // group (HF's repeat_kv);
    a key is seen where the mask says."""
    out = torch.empty_like(q)
    for n in range(q.shape[0]):
        for r in range(q.shape[1]):
            for h in range(q.shape[2]):
                keys, values = k[n, :, h // group], v[n, :, h // group]  # [S, D]
                scores = (keys @ q[n, r, h]) / q.shape[-1] ** 0.5
                weights = scores.masked_fill(~mask[n], float("-inf")).softmax(0)
                out[n, r, h] = weights @ values
    return out


def test_block_attention_equals_a_per_head_reference():
    """block_attention folds each key/value head's query heads into its rows; the result is every query head
    attending over its own key/value head's visible keys. Controls: the heads mapped the other way round (head h on
    key/value head h % 2), or the mask ignored, differ from the reference."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 8, 4, generator=gen)  # 3 blocks of 5 rows, 8 query heads
    k, v = torch.randn(3, 9, 2, 4, generator=gen), torch.randn(3, 9, 2, 4, generator=gen)  # 2 key/value heads
    mask = torch.arange(9).expand(3, -1) < torch.tensor([[9], [4], [7]])
    reference = _per_head_attention(q, k, v, mask, group=4)
    torch.testing.assert_close(block_attention(q, k, v, mask), reference, rtol=1e-5, atol=1e-5)
    order = torch.arange(8).view(2, 4).t().flatten()  # query head h read as the fold's head order[h]
    strided = block_attention(q[:, :, order], k, v, mask)[:, :, order.argsort()]
    assert (strided - reference).abs().max() > 1e-2
    assert (block_attention(q, k, v, torch.ones_like(mask)) - reference).abs().max() > 1e-2


def test_a_batch_drafts_what_each_request_drafts_alone(stories_model, stories_tokenizer, monkeypatch):
    """Contexts of different lengths in one block forward (padded to the longest, the padding masked) draft what
    each request drafts alone (one length: no mask at all). Control: the batch with its mask dropped differs."""
    import infer.models.block_head as block_module

    head = init_head_from_target(stories_model, "stories260K", "block", block_size=8, num_layers=2)
    with torch.no_grad():
        head.mask_embedding.normal_(generator=torch.Generator().manual_seed(3))
    engine = Engine(stories_model, stories_tokenizer, [2],
                    EngineConfig(num_draft_tokens=3, backend="torch", page_size=8, num_pages=64))
    engine.attach_drafter("block", head)
    for prompt in (TRAIN_PROMPTS[0], TRAIN_PROMPTS[1] + " " + TRAIN_PROMPTS[2]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for _ in range(3):
        engine.step()
    requests = engine.running
    assert len(requests) == 2 and requests[0].num_computed != requests[1].num_computed
    drafter = engine.drafter
    with torch.inference_mode():
        alone = torch.cat([drafter.block_logits([r], 8, 3) for r in requests])
        torch.testing.assert_close(drafter.block_logits(requests, 8, 3), alone, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(block_module, "block_attention", lambda q, k, v, mask: block_attention(q, k, v, None))
        assert (drafter.block_logits(requests, 8, 3) - alone).abs().max() > 1e-2


def test_an_anchor_input_head_drafts_at_runtime_what_training_computes(stories_model, stories_tokenizer):
    """head.anchor_input: each mask row adds anchor_fc([c_{p-1}; Emb(t_p)]). After a prefill and verify steps (its
    feature cache written by every catch-up, rejected rows included), the runtime's drafts equal the training
    forward's (block_outputs, c_{a-1} from the packed record) at the same anchor of the same text. Controls: the
    anchor's feature one position early, or the head without its anchor_fc, differ."""
    head = init_head_from_target(stories_model, "stories260K", "block", block_size=8, anchor_input=True)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        head.mask_embedding.normal_(generator=gen)
        head.anchor_fc.weight.normal_(std=0.3, generator=gen)
    engine = Engine(stories_model, stories_tokenizer, [2],
                    EngineConfig(num_draft_tokens=3, backend="torch", page_size=8, num_pages=64))
    engine.attach_drafter("block", head)
    engine.add_request(TRAIN_PROMPTS[0], SamplingParams(max_new_tokens=32, ignore_eos=True))
    for _ in range(4):
        engine.step()
    (request,) = engine.running
    with torch.inference_mode():
        runtime = engine.drafter.block_logits([request], 8, 3)[0]  # [3, V]

    anchor = request.num_computed  # the pending token's position
    text = request.token_ids[: anchor + 1]
    target = packed_target_forward(stories_model, [text], head.target_aux_layers)
    aux = torch.stack([target.aux_hidden_states[i] for i in head.target_aux_layers], dim=1)
    batch = PackedBatch(torch.tensor(text), target.hidden_states, torch.ones(len(text), dtype=torch.bool),
                        [len(text)], [0], aux)
    with torch.no_grad():
        trained = head.compute_logits(block_outputs(head, batch, anchor_plan(batch, 0, anchors=[
            torch.tensor([anchor])]))[:, 1:4])[0]
        torch.testing.assert_close(runtime, trained, rtol=1e-4, atol=1e-4)
        features = head.features(target.hidden_states, aux)
        context = [kv[None, :anchor] for kv in head.context_kv(features, torch.arange(len(text)))]
        positions = (anchor + torch.arange(8))[None]
        first = torch.tensor([text[anchor]])
        direct = head(first, positions, context, None, 3, features[anchor - 1 : anchor])[0]
        shifted = head(first, positions, context, None, 3, features[anchor - 2 : anchor - 1])[0]
        torch.testing.assert_close(direct, trained, rtol=1e-4, atol=1e-4)
        assert (shifted - trained).abs().max() > 1e-2
        head.anchor_fc.weight.zero_()
        without = head(first, positions, context, None, 3, features[anchor - 1 : anchor])[0]
        assert (without - trained).abs().max() > 1e-2
