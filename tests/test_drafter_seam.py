"""The drafter seam end to end on stories260K (tests/test_speculative.py holds the greedy and page tests): one
`propose` per target forward with all its rows, before the host reads the outcome; a head's carry read at each
verify's last emitted row (chosen on the device) drafts as a catch-up over the settled rows alone, and a carry read
elsewhere does not.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.kv_cache import build_page_metadata
from infer.models.common import ModelOutput
from tests.test_speculative import Run, drive, untrained_head, workloads  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the drafter seam ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_reading_head(untrained_head):
    """The untrained head with its projection's token half nonzero: its drafts depend on the tokens its catch-up
    reads (the untrained head's ignore them)."""
    head = copy.deepcopy(untrained_head)
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.eh_proj.weight[:, :hidden] = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(3)) * 0.03
    return head


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
def test_the_drafter_gets_each_forwards_rows_once_before_the_host_reads_the_outcome(
        stories_model, stories_tokenizer, untrained_head, workloads, monkeypatch, drafter):
    """Every step makes one target forward and one `propose` with all of its rows, every request's carry row
    among them; in speculative steps `propose` comes before the host reads the emitted tokens."""
    import infer.engine.loop as loop_module

    prompts, params = workloads["mixed"]
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
        num_draft_tokens=3, backend="torch", page_size=8, num_pages=128, max_num_batched_tokens=24))
    engine.attach_drafter(drafter, stories_model if drafter == "draft" else untrained_head)
    events = []
    run_target, propose, read = engine.runner.run, engine.drafter.propose, loop_module.read_step_tokens

    def recording_run(input_ids, *args, **kwargs):
        events.append(("forward", input_ids.numel()))
        return run_target(input_ids, *args, **kwargs)

    def recording_propose(rows):
        assert rows.meta.output_rows is None, "the target's metadata is the drafter's to copy, not to change"
        events.append(("propose", rows.input_ids.numel()))
        assert rows.next_token_ids.shape == rows.input_ids.shape and rows.last_rows.shape == (len(rows.requests),)
        assert (rows.last_rows.diff() > 0).all() and int(rows.last_rows[-1]) < rows.input_ids.numel()
        return propose(rows)

    engine.runner.run = recording_run
    engine.drafter.propose = recording_propose
    monkeypatch.setattr(loop_module, "read_step_tokens",
                        lambda sampled, emitted: events.append(("read",)) or read(sampled, emitted))
    run = drive(engine, prompts, params)

    assert engine.spec_stats.verify_steps > 10 and not run.violations
    forwards = [e for e in events if e[0] == "forward"]
    assert [e for e in events if e[0] == "propose"] == [("propose", n) for _, n in forwards]
    for i, event in enumerate(events):
        if event == ("read",):
            assert events[i - 1][0] == "propose", events[i - 3 : i + 1]


@pytest.mark.parametrize("k", [1, 3])
def test_the_heads_carry_is_its_last_emitted_row_and_a_broken_choice_drafts_otherwise(
        stories_model, stories_tokenizer, token_reading_head, workloads, monkeypatch, k):
    """Seeded T=1 requests: a head whose carry is read at each verify's last emitted row drafts what a head
    caught up over the settled positions alone (a reference run with the drafter given only those: the same
    outputs and accepted-length histogram); a broken control reading every verify's last row drafts otherwise."""
    from infer.engine.forward import TargetForward

    prompts, greedy = workloads["mixed"]
    params = [dataclasses.replace(p, temperature=1.0, seed=i) for i, p in enumerate(greedy)]
    real_rows = TargetForward.target_rows

    def run(target_rows) -> Run:
        with monkeypatch.context() as patch:
            patch.setattr(TargetForward, "target_rows", target_rows)
            engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
                num_draft_tokens=k, backend="torch", page_size=8, num_pages=128))
            engine.attach_drafter("mtp", token_reading_head)
            return drive(engine, prompts, params)

    def last_verify_rows(self, sampled, emitted, num_emitted):
        rows = real_rows(self, sampled, emitted, num_emitted)
        if emitted is not None:
            rows.last_rows[-len(num_emitted):] += k + 1 - num_emitted
        return rows

    seam = run(real_rows)
    reference = run(settled_rows_only(real_rows))
    assert seam.outputs == reference.outputs and not seam.violations
    assert seam.spec["accepted_length_histogram"] == reference.spec["accepted_length_histogram"]
    assert sum(seam.spec["accepted_length_histogram"][1:]) > 0, "no draft was ever accepted: a weak check"
    broken = run(last_verify_rows)
    assert broken.spec["accepted_length_histogram"] != seam.spec["accepted_length_histogram"]


def settled_rows_only(real_rows):
    """`TargetForward.target_rows` cut to the settled rows on the host: each verify's emitted rows alone, packed
    with their own metadata (the reference the device-side choice must equal)."""

    def target_rows(self, sampled, emitted, num_emitted):
        rows = real_rows(self, sampled, emitted, num_emitted)
        if emitted is None:
            return rows
        counts = num_emitted.tolist()
        width, first = emitted.shape[1], self.rows.num_tokens
        keep = list(range(first)) + [first + b * width + j for b, n in enumerate(counts) for j in range(n)]
        keep_t = torch.tensor(keep)
        plain = self.rows
        q_lens = plain.q_lens + counts
        kv_lens = plain.kv_lens + [r.num_computed + n for r, n in zip(self.speculating, counts)]
        meta = build_page_metadata(plain.page_lists + [r.page_table.pages for r in self.speculating], q_lens, kv_lens,
                                   rows.meta.page_size, rows.input_ids.device)
        lasts = torch.tensor(q_lens).cumsum(0) - 1
        output = ModelOutput(None, rows.output.hidden_states[keep_t],
                             {layer: h[keep_t] for layer, h in rows.output.aux_hidden_states.items()})
        return dataclasses.replace(rows, input_ids=rows.input_ids[keep_t], next_token_ids=rows.next_token_ids[keep_t],
                                   last_rows=lasts, meta=meta, output=output)

    return target_rows
