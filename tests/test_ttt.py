"""Training-time test: the trainer's unroll (mtp_train.ttt) computes what the runtime's drafter computes.

- `chain_attention` equals attention written out query by query over (step-0 keys of anchors 0..j, the chain's keys
  at anchor j), in value and gradient, with grouped queries and a value width unlike the key width (MLA's shape).
- Replay on a text (BOS then the target's greedy story, so a correct draft is the text's next token): an MTP and an
  EAGLE-3 head, fitted to the text for a few steps so that chains run long, draft every anchor through infer's
  `Drafter` (catch-up over the prefix from the target's features in a paged KV cache, then K greedy drafts, each
  reading the head's own state). The trainer's per-step conditional top-1 (UnrolledHead's stats) equals the
  runtime's conditional acceptance within 1 point, and its logits equal the drafter's where the chain is reached.
  Control: the previous pattern (step k attends only to step k's own keys) gives other logits there.
- loss.chain_share: a window of anchors unrolled past step 0 (inside a record, wrapping around, or whole) computes
  exactly the full unroll's rows at those anchors. Control: the window's attention without its offset differs.
"""

from __future__ import annotations

import unittest.mock
from dataclasses import replace

import pytest
import torch

from infer.attention import PackedCausalAttention
from infer.engine import Engine, EngineConfig
from infer.kv_cache import PagePool, PageTable, build_page_metadata
from infer.models.mtp_head import init_head_from_target
from infer.sampler import SamplingTensors
from infer.sampling_params import SamplingParams
from infer.models.common import ModelOutput
from infer.speculative import DRAFTERS, TargetRows
from mtp_train.data import PackedBatch, pad_tokens, window_segments
from mtp_train.ttt import chain_attention
from mtp_train.unroll import LossWeights, UnrolledHead, batch_plan, per_step_means, unroll_plan, unrolled_steps
from tests.test_eagle3 import fit_to_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
TEXT_TOKENS = 120
FIT_STEPS = {"mtp": 12, "eagle3": 20}  # optimizer steps that bring greedy acceptance to ~0.75 on the text


def test_chain_attention_equals_attention_written_out():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, n0, dk, dv, steps = 4, 2, 9, 5, 7, 3
    n = n0 - steps
    q = torch.randn(heads, n, dk, generator=g, dtype=torch.float64, requires_grad=True)
    k0 = torch.randn(kv_heads, n0, dk, generator=g, dtype=torch.float64, requires_grad=True)
    v0 = torch.randn(kv_heads, n0, dv, generator=g, dtype=torch.float64, requires_grad=True)
    ck = torch.randn(steps, kv_heads, n, dk, generator=g, dtype=torch.float64, requires_grad=True)
    cv = torch.randn(steps, kv_heads, n, dv, generator=g, dtype=torch.float64, requires_grad=True)
    out = chain_attention(q, k0, v0, ck, cv, 0.3)
    rows = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        for j in range(n):
            keys = torch.cat((k0[kv, : j + 1], ck[:, kv, j]))
            values = torch.cat((v0[kv, : j + 1], cv[:, kv, j]))
            rows.append(torch.softmax(0.3 * keys @ q[h, j], 0) @ values)
    reference = torch.stack(rows).view(heads, n, dv)
    torch.testing.assert_close(out, reference)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k0, v0, ck, cv)),
                         torch.autograd.grad((reference * weights).sum(), (q, k0, v0, ck, cv))):
        torch.testing.assert_close(got, want)
    # no chain: plain causal attention
    plain = chain_attention(q, k0[:, :n], v0[:, :n], ck[:0], cv[:0], 0.3)
    assert torch.allclose(plain[:, 0], v0[:, :1].repeat_interleave(2, 0)[:, 0])


@pytest.fixture(scope="module")
def text(stories_model, stories_tokenizer) -> list[int]:
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", num_pages=32))
    request = engine.generate([[1]], SamplingParams(max_new_tokens=TEXT_TOKENS - 1, ignore_eos=True))[0]
    return request.token_ids


@pytest.fixture(scope="module")
def target_out(stories_model, text):
    ids = torch.tensor(text)
    with torch.no_grad():
        return stories_model(ids, torch.arange(len(text)), PackedCausalAttention([len(text)]),
                             [None] * len(stories_model.model.layers), aux_layers=(0, 1, 3))


@pytest.fixture(scope="module", params=["mtp", "eagle3"])
def fitted(request, stories_model, text):
    """A head of each kind fitted to the text with the TTT unroll, so that drafts are often right; the trainer's
    stats (UnrolledHead) and per-step logits (unrolled_steps) on the text."""
    head = init_head_from_target(stories_model, "stories260K", request.param)
    head, batch = fit_to_text(head, stories_model, text, FIT_STEPS[request.param], K)
    objective = UnrolledHead(head, stories_model.model.norm.weight, 1e-5, K, LossWeights(ce=1.0))
    counts = torch.tensor([float(len(text) - 1 - k) for k in range(K)])
    with torch.no_grad():
        _, stats = objective(batch, counts)
        logits = [head.compute_logits(out.hidden_states) for _, out in unrolled_steps(head, batch, batch_plan(batch, K))]
    return request.param, head, batch, per_step_means(stats, counts), logits


def test_padding_a_batch_to_a_token_multiple_changes_no_loss_stat_or_gradient(fitted, stories_model, text):
    """The trainer pads each micro batch to a multiple of trainer.pad_tokens_to tokens (a grid of sizes keeps the host
    heap from fragmenting): the padding sequence must train nothing. Control: the same padding with its loss mask
    set does change the loss, so the comparison can see a sequence that trains."""
    _, head, batch, _, _ = fitted
    head.requires_grad_(True)  # the fixture's head is frozen; given back so below
    objective = UnrolledHead(head, stories_model.model.norm.weight, 1e-5, K, LossWeights(kl=1.0, ce=1.0, tv=1.0))
    counts = torch.tensor([float(len(text) - 1 - k) for k in range(K)])

    def loss_stats_grads(b: PackedBatch):
        head.zero_grad()
        loss, stats = objective(b, counts)
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in head.parameters() if p.requires_grad]

    padded = pad_tokens(batch, 64)
    assert padded.num_tokens % 64 == 0 and padded.num_tokens > batch.num_tokens  # 120 tokens -> 128
    assert padded.record_tokens == batch.num_tokens and padded.record_ids == batch.record_ids
    loss, stats, grads = loss_stats_grads(batch)
    p_loss, p_stats, p_grads = loss_stats_grads(padded)
    assert torch.allclose(p_loss, loss, rtol=1e-5) and torch.allclose(p_stats, stats, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(p_grads, grads))
    trained = PackedBatch(padded.input_ids, padded.hidden_states, torch.ones_like(padded.loss_mask), padded.seq_lens,
                          padded.record_ids, padded.aux_hidden_states)  # control: the padding's tokens trained
    assert not torch.allclose(loss_stats_grads(trained)[0], loss, rtol=1e-3)
    head.zero_grad(set_to_none=True)
    head.requires_grad_(False)


@pytest.mark.parametrize("windows", [[(30, 50), (0, 0)], [(100, 40), (5, 1)], [(0, 104), (7, 8)]],
                         ids=["inside", "wrapping", "whole"])
def test_chain_windows_compute_the_full_unrolls_rows_at_their_anchors(fitted, windows):
    """A window's later-step rows are the full unroll's at the same anchors (its queries see every earlier anchor's
    step-0 key), for a window inside the record, one wrapping around to anchor 0, and one of every anchor; step 0
    is the full unroll's. Control: the same rows with their offset dropped (top-left causal over the window's
    anchors) differ."""
    _, head, batch, _, _ = fitted
    two = PackedBatch(batch.input_ids, batch.hidden_states, batch.loss_mask, [batch.num_tokens - 12, 12], [0, 1],
                      batch.aux_hidden_states)  # a record of 108 anchors reaching every step, and a short one
    with torch.no_grad():
        full = {k: dict(zip(step.token_index.tolist(), head.compute_logits(out.hidden_states)))
                for k, (step, out) in enumerate(unrolled_steps(head, two, batch_plan(two, K)))}
        windowed_batch = replace(two, chain_windows=windows)
        windowed = list(unrolled_steps(head, windowed_batch, batch_plan(windowed_batch, K)))
    assert len(windowed) == K
    for k, (step, out) in enumerate(windowed):
        anchors = [t - 1 - k for t in step.token_index.tolist()]  # record 0 starts the batch
        if k:
            want = [offset + a for offset, window, length in zip((0, two.seq_lens[0]), windows, two.seq_lens)
                    for first, end in window_segments(window, length - K) for a in range(first, end)]
            assert sorted(anchors) == sorted(want)
        else:
            assert len(anchors) == sum(n - 1 for n in two.seq_lens)
        logits = head.compute_logits(out.hidden_states)
        torch.testing.assert_close(logits, torch.stack([full[k][t] for t in step.token_index.tolist()]),
                                   rtol=1e-4, atol=1e-4)
    if windows[0][0]:  # control: without the offset the window's queries see the wrong keys
        with torch.no_grad(), unittest.mock.patch("mtp_train.ttt.causal_lower_right", top_left_causal):
            step, out = list(unrolled_steps(head, windowed_batch, batch_plan(windowed_batch, K)))[1]
            logits = head.compute_logits(out.hidden_states)
        gap = (logits - torch.stack([full[1][t] for t in step.token_index.tolist()])).abs().max()
        assert gap > 1e-2


def top_left_causal(rows: int, columns: int) -> torch.Tensor:
    return torch.ones(rows, columns, dtype=torch.bool).tril()


class Seq:
    """What the drafter reads of a request: the text up to the pending token after anchor i."""

    def __init__(self, request_id: int, token_ids: list[int], pool: PagePool) -> None:
        self.request_id, self.token_ids, self.num_computed = request_id, token_ids, len(token_ids) - 1
        self.page_table = PageTable(pool)
        self.page_table.extend(len(token_ids) + K)


def runtime_drafts(kind: str, head, text: list[int], target_out):
    """Every anchor i drafted as the engine would: a catch-up over rows 0..i of a target forward, then K greedy
    drafts.

    Returns (drafts [A, K], step logits [A, K, V] recorded from the drafter's forwards)."""
    anchors = len(text) - 1
    pool = PagePool(anchors * (-(-(len(text) + K) // 16)), 16)
    drafter = DRAFTERS[kind](head, pool.num_pages, 16, "torch")
    seqs = [Seq(i, text[: i + 2], pool) for i in range(anchors)]
    rows = torch.cat([torch.arange(i + 1) for i in range(anchors)])  # anchor i's rows: positions 0..i, packed
    ids = torch.tensor(text)
    meta = build_page_metadata([s.page_table.pages for s in seqs], [i + 1 for i in range(anchors)],
                               [i + 1 for i in range(anchors)], 16, torch.device("cpu"))
    output = ModelOutput(None, target_out.hidden_states[rows],
                         {layer: h[rows] for layer, h in target_out.aux_hidden_states.items()})
    last_rows = torch.arange(1, anchors + 1).cumsum(0) - 1  # [A] anchor i's row at position i
    drafter.propose(TargetRows(seqs, ids[rows], ids[rows + 1], last_rows, meta, output))
    recorded = [torch.stack([drafter.carried_logits(i) for i in range(anchors)])]
    run = drafter._run  # every drafter forward goes through it; from here on, only the drafts'

    def recording_run(*args, **kwargs):
        out = run(*args, **kwargs)
        recorded.append(out.logits)
        return out

    drafter._run = recording_run
    greedy = SamplingTensors.from_params([SamplingParams()] * anchors, "cpu")
    drafts, _ = drafter.draft(seqs, K, greedy, [torch.Generator()] * anchors)
    return drafts, torch.stack(recorded, dim=1)


def test_trainer_top1_equals_the_runtimes_conditional_acceptance(fitted, stories_model, text, target_out):
    kind, head, batch, trainer, trainer_logits = fitted
    drafts, runtime_logits = runtime_drafts(kind, head, text, target_out)
    target_argmax = target_out.logits.argmax(-1)  # [n]: the target's token after each position
    n = len(text)
    reached = torch.ones(n - 1, dtype=torch.bool)  # anchor i reaches step k when drafts 0..k-1 were accepted
    old_pattern = old_pattern_logits(head, batch)
    for k, step in enumerate(unroll_plan(batch.seq_lens, K)):
        valid = n - 1 - k  # anchors 0..n-2-k have a target at position i + 1 + k
        accepted = drafts[:valid, k] == target_argmax[k + 1 : k + 1 + valid]
        here = reached[:valid]
        runtime = float(accepted[here].float().mean())
        print(f"{kind} step {k}: runtime conditional acceptance {runtime:.4f} over {int(here.sum())}, trainer "
              f"{trainer[f'cond_top1_{k}']:.4f}, trainer top-1 {trainer[f'top1_{k}']:.4f}")
        assert abs(runtime - trainer[f"cond_top1_{k}"]) <= 0.01
        # where the chain is reached, the drafter read exactly the trainer's inputs: the same logits
        rows = here.nonzero().flatten()
        torch.testing.assert_close(runtime_logits[rows, k], trainer_logits[k][rows], rtol=1e-4, atol=1e-4)
        if k > 0:
            assert int(here.sum()) >= 20  # chains run: the comparison at this step is not vacuous
            gap = (old_pattern[k][rows] - trainer_logits[k][rows]).abs().max()
            assert gap > 1e-2, f"step {k}: the old attention pattern gives the same logits (max gap {gap:.1e})"
        reached = reached[:valid] & accepted


@torch.no_grad()
def old_pattern_logits(head, batch: PackedBatch) -> list[torch.Tensor]:
    """The control: the same unroll with step k attending only to step k's own keys (causal per record)."""
    hidden = head.features(batch.hidden_states, batch.aux_hidden_states)
    logits = []
    for step in unroll_plan(batch.seq_lens, K):
        out = head(batch.input_ids[step.token_index], step.positions, PackedCausalAttention(step.seq_lens), [None],
                   hidden_states=hidden[step.prev_index])
        logits.append(out.logits)
        hidden = out.hidden_states
    return logits
