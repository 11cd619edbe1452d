"""Loss masks on assistant tokens only, checked by decoding the masked spans; truncation; packing; special tokens of
templates as their ids for the tokenizer the converter writes (split_special_tokens=True) and the reference one, up
to the records the precompute stores."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data_tools import precompute
from data_tools.config import compose
from data_tools.conversations import Conversation, DataError, LoadReport, load_conversations
from data_tools.convert_llama2c import convert_llama2c
from data_tools.features import FeatureDataset
from data_tools.tokenize import ChatFormat, pack_by_budget

BOS, EOS = 1, 2

# A Vicuna-style template written with ordinary text markers, so the stories260K tokenizer can render it.
VICUNA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n{% else %}ASSISTANT: {{ m['content'] | trim }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def runs(ids: list[int], mask: list[int], value: int) -> list[list[int]]:
    """Contiguous runs of ids whose mask equals value."""
    out = []
    for key, group in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]):
        if key == value:
            out.append([token for token, _ in group])
    return out


def decoded_runs(tokenizer, record, value: int = 1) -> list[str]:
    return [tokenizer.decode(run) for run in runs(record.input_ids, record.loss_mask, value)]


def test_plain_template_masks_exactly_the_assistant_turns(assets_dir: Path, stories_tokenizer) -> None:
    conversations, report = load_conversations([assets_dir / "eval" / "fastchat_dummy_conversation.json"])
    fmt = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=4096)
    records = fmt.tokenize_all(conversations, report, progress=False)
    assert len(records) == 500
    for conversation, record in zip(conversations, records):
        assistant = [m["content"] for m in conversation.messages if m["role"] == "assistant"]
        user = [m["content"] for m in conversation.messages if m["role"] == "user"]
        masked = decoded_runs(stories_tokenizer, record, 1)
        # The last answer also trains the story terminator; decode drops a leading space of a run.
        assert [s.strip() for s in masked] == [a.strip() for a in assistant[:-1]] + [assistant[-1].strip() + "<s>"]
        unmasked = decoded_runs(stories_tokenizer, record, 0)
        assert unmasked[0].startswith("<s>")  # BOS (then sentencepiece's dummy-prefix space) is context only
        assert [s.removeprefix("<s>").strip() for s in unmasked] == [u.strip() for u in user]
        assert record.input_ids[0] == stories_tokenizer.bos_token_id and record.loss_mask[0] == 0


def test_chat_template_masks_answer_and_end_of_turn_not_role_markers(stories_tokenizer) -> None:
    conversation = Conversation("mem[0]", "chat", [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes."},
        {"role": "user", "content": "yes."}, {"role": "assistant", "content": "  Good dog. "},
    ])
    fmt = ChatFormat(stories_tokenizer, VICUNA_TEMPLATE, max_length=512)
    record, truncated = fmt.tokenize(conversation)
    assert not truncated
    # A user turn equal to an earlier answer is not mistaken for it; the template's trim is handled; the eos
    # that closes each answer is trained; "ASSISTANT:" markers and user turns are not.
    assert [s.strip() for s in decoded_runs(stories_tokenizer, record, 1)] == ["yes.</s>", "Good dog.</s>"]
    unmasked = "".join(decoded_runs(stories_tokenizer, record, 0))
    assert "ASSISTANT:" in unmasked and "Say yes." in unmasked and "Good dog" not in unmasked
    # The generation prompt of the same conversation is the unmasked prefix plus the assistant marker.
    prompt = fmt.prompt_ids(conversation.messages[:2])
    assert stories_tokenizer.decode(prompt).endswith("USER: Say yes. ASSISTANT:")


def test_text_records_train_every_token_and_prompts_are_skipped(stories_tokenizer) -> None:
    fmt = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=512)
    record, _ = fmt.tokenize(Conversation("t[0]", "text", text="Once upon a time, there was a cat."))
    assert record.loss_mask == [0] + [1] * (len(record) - 1) and record.input_ids[-1] == 1
    report = LoadReport()
    prompts = Conversation("p[0]", "prompts", [{"role": "user", "content": "Hello"}])
    assert fmt.tokenize_all([prompts], report, progress=False) == []
    assert dict(report.skipped) == {"no_assistant_turn": 1}


def test_truncation_that_removes_every_answer_is_skipped(stories_tokenizer) -> None:
    conversation = Conversation("c[0]", "chat", [{"role": "user", "content": "A long question " * 20},
                                                  {"role": "assistant", "content": "Yes."}])
    report = LoadReport(on_error="fail")  # not a malformed record: skipped even under on_error=fail
    records = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=16).tokenize_all([conversation], report, False)
    assert records == [] and dict(report.skipped) == {"no_assistant_tokens": 1}


def test_missing_chat_template_is_a_clear_error(stories_tokenizer) -> None:
    with pytest.raises(DataError, match="chat_template=plain"):
        ChatFormat(stories_tokenizer, None)


def test_pack_by_budget() -> None:
    lengths = [5, 3, 9, 2, 2, 20, 1]
    batches = pack_by_budget(lengths, max_tokens=10, max_records=3)
    assert [i for b in batches for i in b] == list(range(len(lengths)))  # order kept, nothing lost
    assert batches == [[0, 1], [2], [3, 4], [5], [6]]
    assert all(sum(lengths[i] for i in b) <= 10 or len(b) == 1 for b in batches)
    assert pack_by_budget([1] * 7, max_tokens=100, max_records=3) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.fixture(scope="module")
def converted_dir(assets_dir: Path, tmp_path_factory) -> Path:
    """stories260K as the pipeline converts it: its tokenizer sets split_special_tokens=True (llama2.c keeps a
    user's literal "<s>" as text)."""
    llama2c = assets_dir / "stories260K" / "llama2c"
    return convert_llama2c(llama2c / "stories260K.bin", llama2c / "tok512.bin", tmp_path_factory.mktemp("conv") / "m")


@pytest.fixture(scope="module", params=["converted", "reference"])
def any_tokenizer(request, converted_dir: Path, stories_tokenizer):
    return AutoTokenizer.from_pretrained(converted_dir) if request.param == "converted" else stories_tokenizer


def test_template_special_tokens_are_their_ids_for_every_tokenizer(any_tokenizer) -> None:
    story = Conversation("t[0]", "text", text="Once upon a time, there was a cat.")
    record, _ = ChatFormat(any_tokenizer, "plain", "<s>", max_length=512).tokenize(story)
    assert record.input_ids[0] == BOS and record.input_ids[-1] == BOS and record.input_ids.count(BOS) == 2
    assert any_tokenizer.decode(record.input_ids[1:-1]).strip() == "Once upon a time, there was a cat."
    chat = Conversation("c[0]", "chat", [{"role": "user", "content": "Say yes."},
                                        {"role": "assistant", "content": "yes."}])
    fmt = ChatFormat(any_tokenizer, VICUNA_TEMPLATE, max_length=512)
    record, _ = fmt.tokenize(chat)
    assert record.input_ids[0] == BOS and record.input_ids[-1] == EOS and record.loss_mask[-1] == 1
    assert fmt.prompt_ids(chat.messages[:1])[0] == BOS


def test_the_converted_tokenizer_alone_would_split_them(converted_dir: Path) -> None:
    """The control: the tokenizer's own call on a rendered record, what the records held before, has no BOS id."""
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    ids = tokenizer("<s>Once upon a time<s>", add_special_tokens=False)["input_ids"]
    assert BOS not in ids and tokenizer.decode(ids).startswith("<s>")


def test_precomputed_stories_start_and_end_with_bos(converted_dir: Path, tmp_path: Path) -> None:
    """A precomputed record, read back and decoded: BOS (id 1) first, the story, BOS (the story's end) last."""
    stories = tmp_path / "stories.jsonl"
    texts = ["Tom had a red ball.", "Lily saw a big dog. She was happy."]
    stories.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    cfg = compose("precompute", [f"model.path={converted_dir}", f"output_dir={tmp_path / 'features'}",
                                 "data=stories260k", f"data.paths=[{stories}]", "precompute.dtype=float32",
                                 "precompute.progress=false"])
    precompute.run(cfg)
    dataset = FeatureDataset(tmp_path / "features")
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    for i, text in enumerate(texts):
        ids = dataset[i]["input_ids"].tolist()
        assert ids[0] == BOS and ids[-1] == BOS and BOS not in ids[1:-1], ids
        assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text
