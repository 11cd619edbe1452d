"""The block-drafting head (infer.models.block_head, infer.block_drafter, mtp_train.block_unroll) on stories260K with
a head fitted in the test (tests/fitted_block_head.py): greedy output identical to plain decoding at B-1 = 3, 7, 15
(also through chunked prefills and mixed arrivals), the runtime's conditional acceptance equal to the trainer's
replay, and sampling at T=1 lossless with argmax proposals (one-hot q) and with per-position draws."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from infer.bench.forward_costs import ForwardCosts, forward_costs
from infer.engine import Engine, EngineConfig
from infer.cli import add_spec_args, engine_kwargs, run_cli
from infer.models.head_base import repeat_kv_heads
from infer.models.mtp_head import HeadLoadError, init_head_from_target, load_head, save_head
from infer.sampling_params import SamplingParams
from mtp_train.block_unroll import block_replay
from mtp_train.export import DFLASH_FORMATS, ExportError, check_exportable
from mtp_train.export import main as export_main
from mtp_train.validate import GAP_POINTS, packed_target_forward
from tests.fitted_block_head import fit_block_head, objective_for
from tests.test_sampler import ALPHA
from tests.fitted_head import TRAIN_PROMPTS, greedy_batch
from tests.test_speculative import assert_greedy_identical, drive
from tests.test_speculative_sampling import filtered_rows, pooled_chi_square, target_conditionals

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16  # rows of the fitted head's block: it serves K = 1..15
REPLAY_PROMPTS = TRAIN_PROMPTS[:8]  # the fitted head memorises its few texts; held out, it accepts ~4% at position 1


@pytest.fixture(scope="module")
def block_head(stories_model, stories_tokenizer):
    """Fitted once for the module (~40 s on this CPU: its unigram plateau, see tests/fitted_block_head.py)."""
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=512))
    return fit_block_head(engine, block_size=BLOCK)


def engine_for(model, tokenizer, k: int, **config) -> Engine:
    return Engine(model, tokenizer, [2], EngineConfig(num_draft_tokens=k, backend="torch", **config))


@pytest.mark.parametrize("k", [3, 7, 15])
def test_greedy_identical_to_plain_decoding(stories_model, stories_tokenizer, block_head, k):
    """8-token pages and a 24-token budget (chunked prefills beside speculating decodes), half the prompts arriving
    once the others speculate: every request's tokens are plain greedy decoding's, and drafts were accepted."""
    prompts = [stories_tokenizer.encode(p) for p in TRAIN_PROMPTS[:8]]
    params = [SamplingParams(max_new_tokens=48, ignore_eos=True)] * len(prompts)
    config = dict(page_size=8, num_pages=256, max_num_batched_tokens=24)
    expected = drive(engine_for(stories_model, stories_tokenizer, 1, **config), prompts, params)
    engine = engine_for(stories_model, stories_tokenizer, k, **config)
    engine.attach_drafter("block", block_head)
    run = drive(engine, prompts, params, {10: [4, 5, 6, 7]})

    assert not run.violations and run.free_at_end == run.num_pages
    assert run.verify_steps_at_arrivals[0] > 0, "the late prompts arrived before any speculation"
    assert run.spec["tau"] > 1.3, run.spec
    assert_greedy_identical(stories_model, prompts, expected, run)


def test_block_size_is_checked(stories_model, stories_tokenizer, block_head):
    engine = engine_for(stories_model, stories_tokenizer, BLOCK, page_size=8, num_pages=64)
    with pytest.raises(ValueError, match="num_draft_tokens=16: this block head \\(block_size 16\\) drafts 1..15"):
        engine.attach_drafter("block", block_head)
    engine.num_draft_tokens = BLOCK - 1
    engine.attach_drafter("block", block_head)  # the largest K it drafts


def runtime_acceptance(model, tokenizer, head, k: int) -> dict:
    engine = engine_for(model, tokenizer, k, page_size=8, num_pages=512)
    engine.attach_drafter("block", head)
    engine.generate(REPLAY_PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True))
    return engine.spec_stats.to_dict()


def test_trainer_replay_equals_runtime_acceptance(stories_model, stories_tokenizer, block_head):
    """The trainer's conditional top-1 at the runtime's verify anchors of the same greedy texts equals the runtime's
    conditional acceptance within GAP_POINTS (the other heads' replay tolerance: near-ties of the paged and packed
    forwards; one flipped chain moves a position reached n times by 1/n) at every position reached 50 times or more;
    the untrained head's replay (control) is far from it."""
    k = 7
    runtime = runtime_acceptance(stories_model, stories_tokenizer, block_head, k)
    plain = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=512))
    batch, prompt_lens = greedy_batch(plain, REPLAY_PROMPTS, block_head.target_aux_layers)
    replay = block_replay(objective_for(plain, block_head), batch, prompt_lens, k)
    untrained = init_head_from_target(stories_model, "stories260K", "block", block_size=BLOCK, num_layers=1)
    control = block_replay(objective_for(plain, untrained), batch, prompt_lens, k)
    print(f"\nruntime {runtime['conditional_acceptance']} reached {runtime['reached']}\n"
          f"replay  {[round(a, 4) for a in replay['at_verify_steps']]} reached {replay['reached']}\n"
          f"control {[round(a, 4) for a in control['at_verify_steps']]}")

    compared = [j for j, n in enumerate(replay["reached"]) if n >= 50]
    assert len(compared) >= 3
    for j in compared:
        assert abs(runtime["conditional_acceptance"][j] - replay["at_verify_steps"][j]) <= GAP_POINTS, j
    assert abs(runtime["conditional_acceptance"][0] - control["at_verify_steps"][0]) > 0.1


DIST_N = 1000


def dist_prompt(model, tokenizer) -> list[int]:
    """A training opening and 12 greedy tokens: a context the fitted head drafts well from (draft 1 accepted at a
    rate 0.46-0.58 at T=1, against ~0.01-0.1 after "She saw a"), so that a lossy verifier shows."""
    engine = Engine(model, tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=64))
    (request,) = engine.generate([TRAIN_PROMPTS[4]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    return request.token_ids


@torch.no_grad()
def block_second_token_logits(model, head, prompt: list[int], rows: int) -> torch.Tensor:
    """[V, V] the logits of the first draft (the second token) of a block of `rows` rows, for every first token t1."""
    out = packed_target_forward(model, [prompt], head.target_aux_layers)
    aux = torch.stack([out.aux_hidden_states[i] for i in head.target_aux_layers], dim=1)
    positions = torch.arange(len(prompt))
    context = [kv[None] for kv in head.context_kv(head.features(out.hidden_states, aux), positions)]
    vocab = model.config.vocab_size
    block_pos = (len(prompt) + torch.arange(rows)).expand(vocab, -1)
    return head(torch.arange(vocab), block_pos, context, torch.ones(vocab, len(prompt), dtype=torch.bool))[:, 0]


@pytest.mark.parametrize("proposals", ["argmax", "sample"])
def test_sampled_tokens_follow_the_target(stories_model, stories_tokenizer, stories_reference, block_head, proposals):
    """N requests generate (t1, t2) at T=1, t2 from one speculative step (K=2: two drafts from one block); the pairs
    fit the target's exact joint distribution and fit neither the drafter's nor a verifier that resamples a rejection
    from p (the tests/test_speculative_sampling.py machinery)."""
    setting = dict(temperature=1.0)
    prompt = dist_prompt(stories_model, stories_tokenizer)
    engine = engine_for(stories_model, stories_tokenizer, 2, page_size=8, num_pages=1024, max_num_seqs=512,
                        max_num_batched_tokens=512 * len(prompt), block_proposals=proposals)
    engine.attach_drafter("block", block_head)
    assert engine.drafter.proposals == proposals
    requests = [engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=seed, **setting))
                for seed in range(DIST_N)]
    while engine.has_unfinished():
        engine.step()
    assert all(r.spec_stats.verify_steps == 1 for r in requests)
    vocab = stories_model.config.vocab_size
    pairs = torch.tensor([r.output_ids for r in requests])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)

    p1, p2 = target_conditionals(stories_reference, prompt, setting)
    logits = block_second_token_logits(stories_model, block_head, prompt, engine.drafter.block_rows(2))
    if proposals == "sample":
        q2 = filtered_rows(logits, setting, p1 > 0)
    else:
        q2 = torch.nn.functional.one_hot(logits.argmax(-1), vocab).double() * (p1 > 0)[:, None]
    overlap = torch.minimum(p2, q2)
    controls = {"drafter": p1[:, None] * q2,
                "resample-from-p": p1[:, None] * (overlap + (1 - overlap.sum(1, keepdim=True)) * p2)}
    stat, pvalue, df = pooled_chi_square(counts, p1[:, None] * p2)
    rejected = engine.spec_stats.accepted_length_histogram[0]
    accept_rate = (p1[:, None] * overlap).sum().item()
    z = (DIST_N - rejected - DIST_N * accept_rate) / math.sqrt(DIST_N * accept_rate * (1 - accept_rate))
    results = {name: pooled_chi_square(counts, joint) for name, joint in controls.items()}
    print(f"\nblock proposals={proposals}: draft 1 accepted {DIST_N - rejected}/{DIST_N} (rate "
          f"{accept_rate:.3f}, z={z:.1f}); target chi2={stat:.1f} (df {df}, p={pvalue:.3f}); "
          + "; ".join(f"{n} chi2={c:.1f} (p={p:.1e})" for n, (c, p, _) in results.items()))
    assert pvalue > ALPHA, f"(t1, t2) do not follow the target: chi2={stat:.1f}, df={df}, p={pvalue:.2e}"
    assert abs(z) < 4.5, "draft 1's acceptance is not the one of the q the drafter reported"
    for name, (_, control_p, _) in results.items():
        assert control_p < ALPHA, f"the statistic cannot tell {name} from the target"


def test_forward_costs_price_one_block_forward_a_step(stories_model, stories_tokenizer):
    """infer.bench prices a block head's step as its catch-up, one block forward and the verify, whatever K (a chain
    head's drafting grows with K: the control)."""
    head = init_head_from_target(stories_model, "stories260K", "block", block_size=8, num_layers=1)
    engine = engine_for(stories_model, stories_tokenizer, 7, page_size=8, num_pages=64)
    engine.attach_drafter("block", head)
    costs = forward_costs(engine, 2, context=16, repeats=1, num_draft_tokens=7)

    assert costs.one_forward and costs.catch_up is not None and costs.draft > 0
    assert costs.drafting(1) == costs.drafting(7) == costs.catch_up + costs.draft
    chain = ForwardCosts(costs.decode, costs.draft, costs.verify, costs.catch_up)
    assert chain.drafting(7) > chain.drafting(1)
    printed = ForwardCosts.from_milliseconds(costs.milliseconds(), one_forward=True)  # as infer.bench re-reads rows
    assert printed.one_forward and printed.drafting(7) == pytest.approx(costs.drafting(7), rel=1e-2)


def test_dflash_formats_refuse_a_block_head_naming_what_it_lacks(stories_model, tmp_path, capsys):
    head = init_head_from_target(stories_model, "stories260K", "block", block_size=4)
    check_exportable(head.config, "runtime")  # control: the runtime format takes it
    with pytest.raises(ExportError, match="a block head exports to the runtime, dflash or sglang-dflash format"):
        check_exportable(head.config, "speculators")
    for fmt in DFLASH_FORMATS:  # the engines' layers have per-head q/k norms and embed a reserved mask id
        with pytest.raises(ExportError, match=f"the {fmt} engines' DFlash drafters need per-head q_norm / k_norm"
                                              ".*a mask_token_id"):
            check_exportable(head.config, fmt)
    reserved = init_head_from_target(stories_model, "stories260K", "block", block_size=4, mask_token_id=3)
    with pytest.raises(ExportError) as refused:
        check_exportable(reserved.config, "dflash")
    assert "q_norm / k_norm" in str(refused.value) and "mask_token_id" not in str(refused.value)
    normed = init_head_from_target(stories_model, "stories260K", "block", block_size=4, qk_norm=True)
    with pytest.raises(ExportError) as refused:
        check_exportable(normed.config, "sglang-dflash")
    assert "a mask_token_id" in str(refused.value) and "q_norm" not in str(refused.value)
    for fmt in DFLASH_FORMATS:  # control: with both, the formats take it (tests/test_export_dflash.py writes them)
        check_exportable(init_head_from_target(stories_model, "stories260K", "block", block_size=4, qk_norm=True,
                                               mask_token_id=3).config, fmt)
    mtp = init_head_from_target(stories_model, "stories260K", "mtp")
    with pytest.raises(ExportError, match="the sglang-dflash format holds block heads"):
        check_exportable(mtp.config, "sglang-dflash")
    save_head(head, tmp_path / "head")
    assert run_cli(lambda: export_main(["--head", str(tmp_path / "head"), "--format", "dflash", "--out",
                                        str(tmp_path / "out")])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "q_norm / k_norm" in err and not (tmp_path / "out").exists()


def test_a_reserved_mask_token_id_embeds_the_mask_rows_as_that_token(stories_model, tmp_path):
    learned = init_head_from_target(stories_model, "stories260K", "block", block_size=4)
    reserved = init_head_from_target(stories_model, "stories260K", "block", block_size=4, mask_token_id=7)
    first = torch.tensor([5, 9])
    rows = reserved.block_inputs(first)
    embed = stories_model.model.embed_tokens(torch.tensor([5, 9, 7]))
    assert torch.equal(rows[:, 0], embed[:2]) and torch.equal(rows[:, 1:], embed[2].expand(2, 3, -1))
    assert "mask_embedding" not in dict(reserved.named_parameters())  # the target's frozen row, not a parameter
    assert not torch.equal(learned.block_inputs(first)[:, 1:], rows[:, 1:])  # control: the learned (zero) row
    loaded = load_head(save_head(reserved, tmp_path / "reserved"), stories_model)
    assert loaded.config.mask_token_id == 7 and torch.equal(loaded.block_inputs(first), rows)
    with pytest.raises(HeadLoadError, match="head.mask_token_id=512 is not a token of the target's 512-token"):
        init_head_from_target(stories_model, "stories260K", "block", block_size=4, mask_token_id=512)


def test_a_head_with_more_key_value_heads_serves_as_the_narrow_one(stories_model, stories_tokenizer, block_head):
    """The fitted head with each key/value head repeated (head.num_key_value_heads=8, the same function): the runtime
    sizes its context cache for 8 heads and drafts, accepts and emits exactly what the 4-head head does."""
    wide = init_head_from_target(stories_model, "stories260K", "block", block_size=BLOCK, num_key_value_heads=8)
    state = block_head.state_dict()
    for i, layer in enumerate(wide.layers):
        attn, name = layer.self_attn, f"layers.{i}.self_attn"
        fused = torch.cat([state[f"{name}.{p}_proj.weight"] for p in "qkv"])
        q, k, v = repeat_kv_heads(fused, attn.num_heads, 8, attn.head_dim, "test").split((64, 64, 64))
        state |= {f"{name}.q_proj.weight": q, f"{name}.k_proj.weight": k, f"{name}.v_proj.weight": v}
    wide.load_state_dict(state)
    prompts = [stories_tokenizer.encode(p) for p in TRAIN_PROMPTS[:4]]
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * len(prompts)
    runs = []
    for head in (wide, block_head):
        engine = engine_for(stories_model, stories_tokenizer, 7, page_size=8, num_pages=128)
        engine.attach_drafter("block", head)
        assert engine.drafter.runner.kv_caches[0].shape[2] == head.layers[0].self_attn.num_kv_heads
        runs.append(drive(engine, prompts, params))
    timing = ("draft_time_s", "verify_time_s")
    wide_spec, narrow_spec = ({k: v for k, v in run.spec.items() if k not in timing} for run in runs)
    assert wide_spec == narrow_spec and narrow_spec["tau"] > 1.3, narrow_spec
    assert runs[0].outputs == runs[1].outputs


def test_proposals_at_t_above_zero_are_the_engine_configs(stories_model, stories_tokenizer, block_head):
    """An engine's block drafter proposes argmax drafts by default (the drafter's graph settings once landed in its
    per-position-draws flag, which made every engine draw); `--block-proposals` reaches it from the CLIs."""
    engine = engine_for(stories_model, stories_tokenizer, 3, page_size=8, num_pages=64)
    engine.attach_drafter("block", block_head)
    assert engine.drafter.proposals == "argmax" and engine.drafter.short_blocks is False
    bad = engine_for(stories_model, stories_tokenizer, 3, page_size=8, num_pages=64, block_proposals="top")
    with pytest.raises(ValueError, match="block_proposals='top': choose one of argmax, sample"):
        bad.attach_drafter("block", block_head)
    parser = argparse.ArgumentParser()
    add_spec_args(parser)
    args = parser.parse_args(["--block-proposals", "sample"])
    args.page_size, args.num_pages, args.max_num_batched_tokens, args.decode_run_steps = 8, 64, 64, 1
    args.attention_backend, args.cuda_graphs, args.overlap = "torch", False, False
    assert engine_kwargs(args, max_num_seqs=4)["block_proposals"] == "sample"
