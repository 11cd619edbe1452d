"""The EAGLE-3 head in the runtime (infer.models.eagle3_head, infer.speculative.Eagle3Drafter) on stories260K.

- Layer ids: the default (2, L//2, L-3), the rule (1, L//2, L-1) below 7 layers, refusals naming the value; the
  precompute stores the layers an eagle3 head config asks for (id i = infer's aux output of layer i - 1).
- Greedy: a head with a 256-token draft vocabulary, fitted to the story so that drafts are often accepted, drafts for
  K = 1..4 in tests/test_speculative.py's configurations (chunked prefill with late arrivals, growing caches,
  preemption): outputs equal decoding without a drafter token for token, pages add up every step and all return.
- Sampling with a draft vocabulary holding about half of the target's probability at the drafted token: no draft
  outside it is proposed, and (t1, t2) follow the target's exact joint distribution (chi-square); the statistic
  rejects the drafter's own distribution and a verifier that keeps p on the draft vocabulary only (renormalised),
  the bug a draft vocabulary invites.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from data_tools import precompute
from data_tools.config import compose
from data_tools.conversations import DataError
from infer.attention import PackedCausalAttention
from infer.engine import Engine, EngineConfig
from infer.models.eagle3_head import Eagle3Head, default_layer_ids, init_eagle3_from_target
from infer.models.mtp_head import (
    HeadLoadError, SharedTargetWeights, head_config_for, head_module, target_digest, target_identity,
)
from infer.sampling_params import SamplingParams
from mtp_train.data import PackedBatch
from mtp_train.draft_vocab import TokenScores, choose, coverage
from mtp_train.trainer import param_groups
from mtp_train.unroll import LossWeights, UnrolledHead
from tests.test_sampler import ALPHA
from tests.test_speculative import (
    CONFIGS, REFERENCE, STORY, assert_greedy_identical, drive, packed_prefill,
    workloads,  # noqa: F401 - workloads is a fixture used below
)
from tests.test_speculative_sampling import DIST_PROMPT, filtered_rows, pooled_chi_square, target_conditionals

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_CASES = [("default", k) for k in (1, 2, 3, 4)] + [("preempt", k) for k in (1, 2, 3, 4)] + \
    [(config, k) for config in ("chunked", "growing") for k in (2, 4)]
DIST_N = 3000


# --- helpers shared with tests/test_ttt.py and tests/test_mtp_head.py -----------------------------------------------
def eagle3_head(model, draft_vocab: int | None = None, trainable_lm_head: bool = False,
                draft_ids: Tensor | None = None, layer_ids: list[int] | None = None,
                num_key_value_heads: int | None = None) -> Eagle3Head:
    """An untrained EAGLE-3 head on stories260K (init_eagle3_from_target); with a draft vocabulary of `draft_ids`, or
    of the `draft_vocab` ids the target gives most probability on a fixed random context."""
    identity = target_identity("stories260K", model.config, target_digest(model))
    size = draft_vocab if draft_ids is None else draft_ids.numel()
    config = head_config_for(model.config, identity, "eagle3", draft_vocab_size=size,
                             trainable_lm_head=trainable_lm_head, layer_ids=layer_ids,
                             num_key_value_heads=num_key_value_heads)
    head = head_module(config).attach(SharedTargetWeights(model.model.embed_tokens, model.lm_head))
    init_eagle3_from_target(head, model)
    if size is not None:
        if draft_ids is None:
            context = torch.randint(3, model.config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = model(context, torch.arange(256), PackedCausalAttention([256]), [None] * 5).logits
            draft_ids = torch.softmax(logits, -1).sum(0).topk(size).indices
        head.set_draft_vocab(draft_ids)
        head.share_lm_head_rows()
    return head


def fit_to_text(head, model, text: list[int], steps: int, k: int = 4):
    """A few TTT steps on one text (AdamW, lr 1e-2): drafts along it then are often right. Returns the head in
    eval mode without gradients, and the batch it was fitted on."""
    ids = torch.tensor(text)
    with torch.no_grad():
        out = model(ids, torch.arange(len(text)), PackedCausalAttention([len(text)]), [None] * 5,
                    aux_layers=head.target_aux_layers)
    aux = torch.stack([out.aux_hidden_states[i] for i in head.target_aux_layers], 1) if head.target_aux_layers else None
    batch = PackedBatch(ids, out.hidden_states, torch.ones(len(text), dtype=torch.bool), [len(text)], [0], aux)
    objective = UnrolledHead(head.train().requires_grad_(True), model.model.norm.weight, 1e-5, k, LossWeights(ce=1.0))
    counts = torch.tensor([float(len(text) - 1 - j) for j in range(k)])
    optimizer = torch.optim.AdamW(param_groups(head, 0.0), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss, _ = objective(batch, counts)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return head.eval().requires_grad_(False), batch


# --- layer ids and the precompute ----------------------------------------------------------------------------------
def test_layer_ids_follow_the_stated_rule(stories_model):
    assert default_layer_ids(32) == [2, 16, 29] and default_layer_ids(80) == [2, 40, 77]  # vLLM / SGLang's
    assert default_layer_ids(7) == [2, 3, 4]
    assert default_layer_ids(5) == [1, 2, 4] and default_layer_ids(6) == [1, 3, 5] and default_layer_ids(4) == [1, 2, 3]
    with pytest.raises(HeadLoadError, match="3 distinct target layers"):
        default_layer_ids(3)
    identity = {"name": "stories260K"}
    with pytest.raises(HeadLoadError, match=r"head.layer_ids=\[1, 2, 6\]"):
        head_config_for(stories_model.config, identity, "eagle3", layer_ids=[1, 2, 6])  # past the last layer's output
    with pytest.raises(HeadLoadError, match=r"head.layer_ids=\[0, 2, 4\]"):
        head_config_for(stories_model.config, identity, "eagle3", layer_ids=[0, 2, 4])  # the embedding is not fused
    final = head_config_for(stories_model.config, identity, "eagle3", layer_ids=[1, 3, 5])  # 5: the last output
    assert final.aux_layer_ids == [1, 3, 5]
    with pytest.raises(HeadLoadError, match="draft_vocab_size=600"):
        head_config_for(stories_model.config, identity, "eagle3", draft_vocab_size=600)
    with pytest.raises(HeadLoadError, match="EAGLE-3 options"):
        head_config_for(stories_model.config, identity, "mtp", draft_vocab_size=100)
    head = eagle3_head(stories_model)
    assert head.config.aux_layer_ids == [1, 2, 4] and head.target_aux_layers == (0, 1, 3)


def test_precompute_stores_the_layers_the_head_asks_for(stories_hf_dir, stories_model):
    def layers(*overrides):
        cfg = compose("precompute", [f"model.path={stories_hf_dir}", "output_dir=/unused", *overrides])
        return precompute._validate(cfg, stories_model.config)[2]

    assert layers() == [] and layers("head=eagle3") == [0, 1, 3]
    assert layers("head=eagle3", "head.layer_ids=[2,3,4]", "precompute.aux_layers=[0]") == [0, 1, 2, 3]
    with pytest.raises(DataError, match="head.layer_ids"):
        layers("head=eagle3", "head.layer_ids=[0,1,2]")


def test_draft_vocabulary_rules_and_the_mass_they_cover():
    """Probability picks the ids the target puts mass on; frequency the ids sampled most, which differ when the
    data is not the target's own samples."""
    scores = TokenScores(mass=torch.tensor([5.0, 3.0, 2.0, 0.0], dtype=torch.float64),
                         count=torch.tensor([1.0, 5.0, 3.0, 9.0], dtype=torch.float64), positions=10)
    by_mass, by_count = choose(scores, 2, "probability"), choose(scores, 2, "frequency")
    assert by_mass.tolist() == [0, 1] and by_count.tolist() == [1, 3]
    assert coverage(scores, by_mass) == pytest.approx(0.8) and coverage(scores, by_count) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="head.draft_vocab_rule='zipf'"):
        choose(scores, 2, "zipf")


# --- greedy identity and pages -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def story_head(stories_model, stories_tokenizer):
    head = eagle3_head(stories_model, draft_vocab=256)
    return fit_to_text(head, stories_model, stories_tokenizer.encode(STORY), steps=25)[0]


@pytest.fixture(scope="module")
def greedy_runs(stories_model, stories_tokenizer, story_head, workloads):  # noqa: F811 - the imported fixture
    cache = {}

    def get(drafter: str, k: int, config: str):
        if (drafter, k, config) not in cache:
            setting = CONFIGS[config]
            engine = Engine(stories_model, stories_tokenizer, [2],
                            EngineConfig(num_draft_tokens=k, backend="torch", **setting["engine"]))
            if drafter == "eagle3":
                engine.attach_drafter("eagle3", story_head)
            cache[drafter, k, config] = drive(engine, *workloads[setting["workload"]], setting.get("arrivals"))
        return cache[drafter, k, config]

    return get


@pytest.mark.parametrize("config,k", GREEDY_CASES)
def test_greedy_identical_to_no_speculation_and_pages_return(greedy_runs, stories_model, workloads, config, k):  # noqa: F811
    workload = CONFIGS[config]["workload"]
    expected = greedy_runs("none", 1, REFERENCE[workload])
    run = greedy_runs("eagle3", k, config)

    assert run.spec["verify_steps"] > 0 and run.spec["acceptance_per_position"][0] > 0.2  # drafts get accepted
    assert_greedy_identical(stories_model, workloads[workload][0], expected, run)
    assert not run.violations, "\n".join(run.violations[:10])
    assert run.free_at_end == run.num_pages
    if config == "preempt":
        assert run.preempted_after_speculating > 0
    if config == "chunked":
        assert run.verify_steps_at_arrivals and run.verify_steps_at_arrivals[0] > 0


def test_a_head_fusing_the_last_layers_output_is_served_with_it(stories_model, stories_tokenizer, workloads):  # noqa: F811
    """Id L (the last layer's output before the final norm, what an MTP head reads): the trainer and the verify
    forward read it as aux layer L - 1, and greedy speculation stays the target's."""
    head = eagle3_head(stories_model, layer_ids=[1, 3, 5])
    assert head.target_aux_layers == (0, 2, 4)
    head, batch = fit_to_text(head, stories_model, stories_tokenizer.encode(STORY), steps=25)
    torch.testing.assert_close(batch.aux_hidden_states[:, 2], batch.hidden_states, rtol=0, atol=0)
    assert_served_as_the_target(stories_model, stories_tokenizer, workloads, head)


def assert_served_as_the_target(stories_model, stories_tokenizer, workloads, head: Eagle3Head) -> Engine:  # noqa: F811
    """K=3 greedy speculation with `head` on the default workload: drafts get accepted, the tokens are the target's
    alone, every page comes back. Returns the speculative engine."""
    setting = CONFIGS["default"]
    runs, engines = [], []
    for drafter in (None, head):
        engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(num_draft_tokens=3, backend="torch",
                                                                            **setting["engine"]))
        if drafter is not None:
            engine.attach_drafter("eagle3", drafter)
        runs.append(drive(engine, *workloads[setting["workload"]]))
        engines.append(engine)
    assert runs[1].spec["verify_steps"] > 0 and runs[1].spec["acceptance_per_position"][0] > 0.2
    assert_greedy_identical(stories_model, workloads[setting["workload"]][0], runs[0], runs[1])
    assert runs[1].free_at_end == runs[1].num_pages
    return engines[1]


def test_more_key_value_heads_start_as_the_target_layer_and_are_served(stories_model, stories_tokenizer,  # noqa: F811
                                                                        workloads):
    """num_key_value_heads=8 on a target of 4: the untrained head is the same function as the 4-head one (each key
    and value head repeated for the query heads it served; tiled instead, the control, it is not); trained a little
    it drafts, the runtime sizes its cache from it, and greedy speculation stays the target's."""
    identity = target_identity("stories260K", stories_model.config, target_digest(stories_model))
    wide, narrow = eagle3_head(stories_model, num_key_value_heads=8), eagle3_head(stories_model)
    assert wide.layer.self_attn.num_kv_heads == 8 and narrow.layer.self_attn.num_kv_heads == 4
    ids, fused = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(1)), torch.randn(24, 64)

    def logits(head: Eagle3Head) -> Tensor:
        with torch.no_grad():
            return head(ids, torch.arange(24), PackedCausalAttention([24]), [None], hidden_states=fused).logits

    torch.testing.assert_close(logits(wide), logits(narrow), rtol=1e-5, atol=1e-5)
    tiled = copy.deepcopy(wide)
    with torch.no_grad():  # the broken control: key / value heads 0 1 2 3 0 1 2 3 instead of 0 0 1 1 2 2 3 3
        weight, d = tiled.layer.self_attn.qkv_proj.weight, tiled.layer.self_attn.head_dim
        for start in (64, 128):
            rows = weight[start : start + 64].unflatten(0, (8, d))
            weight[start : start + 64] = torch.cat((rows[0::2], rows[0::2])).flatten(0, 1)
    assert (logits(tiled) - logits(narrow)).abs().max() > 1e-2
    for bad, match in ((3, "num_key_value_heads=3 must divide"), (2, "multiple of the target's 4")):
        with pytest.raises(HeadLoadError, match=match):
            head_config_for(stories_model.config, identity, "eagle3", num_key_value_heads=bad)
    with pytest.raises(HeadLoadError, match="not mtp's"):
        head_config_for(stories_model.config, identity, "mtp", num_key_value_heads=8)

    wide = fit_to_text(wide, stories_model, stories_tokenizer.encode(STORY), steps=40)[0]
    spec = assert_served_as_the_target(stories_model, stories_tokenizer, workloads, wide)
    assert spec.drafter.runner.kv_caches[0].shape[3] == 8  # [pages, 2, page_size, kv heads, head_dim]


# --- lossless sampling with a draft vocabulary --------------------------------------------------------------------
@torch.no_grad()
def second_token_logits(target, head: Eagle3Head, prompt: list[int]) -> Tensor:
    """[V, V] logits the head proposes the second token from, for every first token t1: its carry after catching
    up over the prompt's positions, which read tokens prompt[1:] + [t1] and the fused target states there."""
    vocab = target.config.vocab_size
    out = target(torch.tensor(prompt), torch.arange(len(prompt)), PackedCausalAttention([len(prompt)]), [None] * 5,
                 aux_layers=head.target_aux_layers)
    fused = head.features(out.hidden_states, torch.stack([out.aux_hidden_states[i] for i in head.target_aux_layers], 1))
    return packed_prefill(head, [prompt[1:] + [t] for t in range(vocab)], fused.repeat(vocab, 1)).logits


def test_sampled_tokens_follow_the_target_with_a_draft_vocabulary(stories_model, stories_tokenizer,
                                                                  stories_reference):
    setting = dict(temperature=1.0)
    prompt = stories_tokenizer.encode(DIST_PROMPT)
    p1, p2 = target_conditionals(stories_reference, prompt, setting)
    marginal = (p1[:, None] * p2).sum(0)  # the drafted token's distribution
    draft_ids = marginal.argsort(descending=True)[0::2][:256]  # every other token by mass: about half of it outside
    outside = float(marginal.sum() - marginal[draft_ids].sum())
    assert 0.2 < outside < 0.6, outside
    head = fit_to_text(eagle3_head(stories_model, draft_ids=draft_ids), stories_model,
                       stories_tokenizer.encode(STORY), steps=10)[0]

    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
        num_draft_tokens=2, backend="torch", page_size=8, num_pages=1024, max_num_seqs=512,
        max_num_batched_tokens=512 * len(prompt),
    ))
    engine.attach_drafter("eagle3", head)
    proposed = []
    draft = engine.drafter.draft
    engine.drafter.draft = lambda *args: proposed.append(draft(*args)) or proposed[-1]
    requests = [engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=seed, **setting))
                for seed in range(DIST_N)]
    while engine.has_unfinished():
        engine.step()

    assert engine.pool.num_free == engine.pool.num_pages
    assert all(r.spec_stats.verify_steps == 1 for r in requests), "every second token comes from a speculative step"
    drafts = torch.cat([ids.flatten() for ids, _ in proposed])
    in_vocab = torch.zeros(stories_model.config.vocab_size, dtype=torch.bool)
    in_vocab[draft_ids] = True
    assert drafts.numel() == 2 * DIST_N and bool(in_vocab[drafts].all()), "a token outside the draft vocabulary"
    assert all(bool((q[..., ~in_vocab] == 0).all()) for _, q in proposed)  # q is 0 outside
    vocab = stories_model.config.vocab_size
    pairs = torch.tensor([r.output_ids for r in requests])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)

    target = p1[:, None] * p2
    q2 = filtered_rows(second_token_logits(stories_model, head, prompt), setting, p1 > 0)
    on_vocab = p2 * in_vocab
    controls = {"drafter": p1[:, None] * q2,
                "p on the draft vocabulary only": p1[:, None] * on_vocab / on_vocab.sum(1, keepdim=True).clamp_min(1e-12)}
    stat, pvalue, df = pooled_chi_square(counts, target)
    results = {name: pooled_chi_square(counts, joint) for name, joint in controls.items()}
    print(f"\neagle3 K=2 T=1, draft vocabulary 256 ({outside:.2f} of the mass outside): target chi2={stat:.1f} (df {df}, "
          f"p={pvalue:.3f}); " + "; ".join(f"{n} chi2={c:.1f} (p={pv:.1e})" for n, (c, pv, _) in results.items()))
    assert pvalue > ALPHA, f"(t1, t2) do not follow the target: chi2={stat:.1f}, df={df}, p={pvalue:.2e}"
    for name, (control, control_pvalue, _) in results.items():
        assert control_pvalue < ALPHA, f"the statistic cannot tell {name} from the target: chi2={control:.1f}"
    outside_emitted = float((~in_vocab[pairs[:, 1]]).float().mean())
    assert abs(outside_emitted - outside) < 0.05  # tokens outside the draft vocabulary keep their probability
