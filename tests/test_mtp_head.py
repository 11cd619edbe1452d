"""The head folder format and how a head binds to its target: round trip, contents, refusals, shared tensors; for
MTP, EAGLE-1 and EAGLE-3 heads (the latter with a 256-token draft vocabulary and its own lm_head rows)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from infer.engine import Engine, EngineConfig
from infer.models.llama import LlamaForCausalLM
from infer.models.mtp_head import (
    DRAFTER_KINDS, HeadLoadError, MTPHead, init_head_from_target, load_head, save_head,
)
from infer.sampling_params import SamplingParams
from tests.test_eagle3 import eagle3_head
from tests.test_export import dsv2_dir, dsv2_head, dsv2_model  # noqa: F401 - fixtures
from tests.test_speculative import packed_prefill

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 403, 407, 261, 378], [1, 420], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]]


def trained_like(head: MTPHead, seed: int) -> MTPHead:
    """Perturb every parameter of a head so a round trip cannot pass by re-deriving the weights from the target."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return head


def tiny_llama(vocab_size: int = 512, hidden_size: int = 64, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama (infer's) of stories260K's shape by default: a different target with the same vocab/hidden."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["mtp", "eagle1", "eagle3"])
def saved_head(request, stories_model, tmp_path_factory) -> tuple[MTPHead, Path]:
    if request.param == "eagle3":
        head = trained_like(eagle3_head(stories_model, draft_vocab=256, trainable_lm_head=True), seed=1)
    else:
        head = trained_like(init_head_from_target(stories_model, "stories260K", architecture=request.param), seed=1)
    return head, save_head(head, tmp_path_factory.mktemp(request.param) / "head")


@pytest.fixture
def head_copy(saved_head, tmp_path) -> Path:
    """A copy of the saved folder that a test may damage."""
    _, path = saved_head
    copy_path = tmp_path / "head"
    copy_path.mkdir()
    for file in path.iterdir():
        (copy_path / file.name).write_bytes(file.read_bytes())
    return copy_path


def test_round_trip_gives_identical_drafts_through_the_engine(saved_head, stories_model, stories_tokenizer):
    """Two engines, one with the head in memory and one with it loaded from disk, stepped in lockstep: the drafter's
    carried logits of every live request are bitwise equal after every step, and so are outputs and acceptance."""
    head, path = saved_head
    loaded = load_head(path, stories_model)
    engines = []
    for drafter in (head, loaded):
        engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(num_draft_tokens=3, backend="torch",
                                                                            page_size=16, num_pages=64))
        engine.attach_drafter(DRAFTER_KINDS[head.config.architecture], drafter)
        engines.append(engine)
    params = SamplingParams(max_new_tokens=16, stop_token_ids=(1,))
    requests = [[engine.add_request(p, params) for p in PROMPTS] for engine in engines]

    steps = 0
    while engines[0].has_unfinished():
        for engine in engines:
            engine.step()
        steps += 1
        for ours, theirs in zip(*requests):
            ours_drafter, theirs_drafter = engines[0].drafter, engines[1].drafter
            if not ours.finished:
                assert torch.equal(ours_drafter.carried_logits(ours.request_id),
                                   theirs_drafter.carried_logits(theirs.request_id)), f"step {steps}"

    assert not engines[1].has_unfinished()
    assert [r.output_ids for r in requests[0]] == [r.output_ids for r in requests[1]]
    assert engines[0].spec_stats.verify_steps > 0
    assert engines[0].spec_stats.accepted_length_histogram == engines[1].spec_stats.accepted_length_histogram
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config == head.config


def test_folder_holds_config_and_weights_without_the_targets_tensors(saved_head, stories_model):
    head, path = saved_head

    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p.name for p in path.parent.iterdir() if p.name != path.name], "save left temporary folders behind"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in keys}
    vocab, hidden = stories_model.config.vocab_size, stories_model.config.hidden_size
    eagle3 = head.config.architecture == "eagle3"
    # no target tensor: nothing named after them, no vocabulary-sized tensor but EAGLE-3's vocabulary map (t2d)
    assert not [k for k in keys if "embed" in k or ("lm_head" in k and not eagle3)]
    assert not [k for k, shape in shapes.items() if vocab in shape and k != "t2d"], "a vocabulary-sized tensor was saved"
    assert keys == set(head.state_dict())
    expected = {"layer.self_attn.qkv_proj.weight", "layer.self_attn.o_proj.weight",
                "layer.mlp.gate_up_proj.weight", "layer.mlp.down_proj.weight", "layer.post_attention_layernorm.weight"}
    if head.config.architecture == "mtp":
        expected |= {"eh_proj.weight", "enorm.weight", "hnorm.weight", "final_norm.weight",
                     "layer.input_layernorm.weight"}
    elif eagle3:  # the fusion, both input norms, the draft vocabulary's rows and maps
        expected |= {"fc.weight", "layer.input_layernorm.weight", "layer.hidden_norm.weight", "final_norm.weight",
                     "lm_head.weight", "d2t", "t2d"}
    else:  # eagle1: no norms (not even the layer's input norm, as EAGLE-1's first layer), a biased projection
        expected |= {"eh_proj.weight", "eh_proj.bias"}
    assert keys == expected
    if eagle3:
        assert shapes["fc.weight"] == (hidden, 3 * hidden) and shapes["lm_head.weight"] == (256, hidden)
        assert shapes["layer.self_attn.qkv_proj.weight"][1] == 2 * hidden and shapes["d2t"] == (256,)
    else:
        assert shapes["eh_proj.weight"] == (hidden, 2 * hidden)
    config = json.loads((path / "config.json").read_text())
    assert config["target"]["name"] == "stories260K" and config["architecture"] == head.config.architecture
    assert (config["vocab_size"], config["hidden_size"]) == (vocab, hidden)


def test_saving_over_an_existing_head_replaces_it(saved_head, stories_model, tmp_path):
    head, _ = saved_head
    path = save_head(init_head_from_target(stories_model, "stories260K"), tmp_path / "head")
    save_head(head, path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    loaded = load_head(path, stories_model)
    assert torch.equal(loaded.layer.self_attn.o_proj.weight, head.layer.self_attn.o_proj.weight)


def test_head_uses_the_targets_tensors_in_place(saved_head, stories_model):
    head, path = saved_head
    embed, lm_head = stories_model.model.embed_tokens.weight, stories_model.lm_head.weight

    for h in (head, load_head(path, stories_model), init_head_from_target(stories_model, "stories260K")):
        assert h.shared.embed_tokens.weight.data_ptr() == embed.data_ptr()
        assert h.shared.lm_head.weight.data_ptr() == lm_head.data_ptr()
        # Referenced, not registered: no copy in the head's parameters, state dict, or `.to()` conversions.
        assert all(p.data_ptr() not in (embed.data_ptr(), lm_head.data_ptr()) for p in h.parameters())
        own_rows = h.config.trainable_lm_head  # an EAGLE-3 head's own draft rows, not the target's tensor
        assert not [k for k in h.state_dict() if "embed" in k or ("lm_head" in k and not own_rows)]


def test_head_against_another_target_is_refused_naming_the_config(saved_head, stories_model):
    _, path = saved_head
    config_file = str(path / "config.json")
    other_embedding = copy.deepcopy(stories_model)
    with torch.no_grad():
        other_embedding.model.embed_tokens.weight[7] += 1e-3  # one row, slightly: still another target
    others = {
        "modified embedding": other_embedding,
        "same shape, other weights": tiny_llama(),
        "other hidden size": tiny_llama(hidden_size=32),
        "other vocabulary": tiny_llama(vocab_size=256),
    }

    for name, target in others.items():
        with pytest.raises(HeadLoadError, match="config.json") as err:
            load_head(path, target)
        assert config_file in str(err.value), name


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_is_named(head_copy, stories_model, missing):
    (head_copy / missing).unlink()

    with pytest.raises(HeadLoadError) as err:
        load_head(head_copy, stories_model)
    assert str(head_copy / missing) in str(err.value)


def test_missing_folder_is_named(stories_model, tmp_path):
    with pytest.raises(HeadLoadError, match="config.json"):
        load_head(tmp_path / "nowhere", stories_model)


@pytest.mark.parametrize("damage", ["not json", "unknown field", "future format"])
def test_bad_config_is_refused_naming_it(head_copy, stories_model, damage):
    config_file = head_copy / "config.json"
    config = json.loads(config_file.read_text())
    if damage == "not json":
        config_file.write_text("{ not json")
    else:
        config["surprise" if damage == "unknown field" else "format_version"] = 99
        config_file.write_text(json.dumps(config))

    with pytest.raises(HeadLoadError) as err:
        load_head(head_copy, stories_model)
    assert str(config_file) in str(err.value)


@pytest.mark.parametrize("damage", ["embedding saved with the head", "tensor missing"])
def test_bad_weights_are_refused_naming_them(head_copy, stories_model, damage):
    weights_file = head_copy / "model.safetensors"
    state = load_file(str(weights_file))
    if damage == "tensor missing":
        del state["layer.self_attn.o_proj.weight"]
    else:
        state["embed_tokens.weight"] = stories_model.model.embed_tokens.weight.clone()
    save_file(state, str(weights_file))

    with pytest.raises(HeadLoadError) as err:
        load_head(head_copy, stories_model)
    assert str(weights_file) in str(err.value)


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_attach_drafter_refuses_another_vocabulary(stories_model, stories_tokenizer, kind):
    other = tiny_llama(vocab_size=256)
    drafter = other if kind == "draft" else init_head_from_target(other, "tiny")
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", num_pages=8))

    with pytest.raises(ValueError, match="vocabulary"):
        engine.attach_drafter(kind, drafter)
    assert engine.drafter is None


def test_head_loaded_in_another_dtype_runs_or_is_refused(stories_model, tmp_path):
    """load_head takes a dtype: a head it returns must run against its target (here fp32 with a bf16 head),
    with logits close to the fp32 head's; refusing the dtype at load (ValueError) is the other acceptable answer."""
    head = trained_like(init_head_from_target(stories_model, "stories260K"), seed=2)
    path = save_head(head, tmp_path / "head")
    try:
        loaded = load_head(path, stories_model, dtype=torch.bfloat16)
    except ValueError:
        return
    prompt = PROMPTS[0]
    hidden = packed_prefill(stories_model, [prompt]).hidden_states
    want = packed_prefill(head, [prompt[1:] + [300]], hidden).logits
    got = packed_prefill(loaded, [prompt[1:] + [300]], hidden).logits  # raises today: fp32 embedding, bf16 weights
    assert (got.float() - want).abs().max() <= 0.05 * (want.max() - want.min())


def catch_up_once(head, rows: list[int], alone: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A head's prefill of three sequences, then one catch-up-like forward of 3, 1 and 4 new rows each on the paged
    cache, scored at one packed row per sequence (alone: the step's output_rows, computed alone): (logits [3, V]
    and hidden states [3, H] at those rows, the caches after it)."""
    from infer.attention import TorchAttention  # noqa: PLC0415
    from infer.kv_cache import PagePool, PageTable, build_page_metadata  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    prompt_lens, q_lens, page_size = [5, 2, 7], [3, 1, 4], 4
    pool = PagePool(16, page_size)
    caches = head.allocate_kv_cache(16, page_size, torch.float32, torch.device("cpu"))
    tables = [PageTable(pool) for _ in prompt_lens]
    attn = TorchAttention()
    hidden_size = head.config.hidden_size
    for step, (lens, kv_lens) in enumerate([(prompt_lens, prompt_lens),
                                            (q_lens, [p + q for p, q in zip(prompt_lens, q_lens)])]):
        for table, kv_len in zip(tables, kv_lens):
            table.extend(kv_len)
        meta = build_page_metadata([t.pages for t in tables], lens, kv_lens, page_size, torch.device("cpu"))
        scored = torch.tensor(rows) if step == 1 else torch.tensor(lens).cumsum(0) - 1
        if alone and step == 1:
            meta.output_rows = scored
        attn.plan(meta)
        out = head(torch.randint(3, 512, (sum(lens),), generator=gen), meta.positions, attn, caches, scored,
                   hidden_states=torch.randn(sum(lens), hidden_size, generator=gen))
    assert (attn.output_rows is not None) == alone  # alone: the layer computed those rows only
    return out.logits, out.hidden_states if alone else out.hidden_states[scored], caches


@torch.no_grad()
def test_catch_up_of_the_last_rows_alone_gives_every_rows_caches_and_the_carry(saved_head):
    """A one-layer head's catch-up (output_rows: each sequence's last row, or any one row, as the verified
    schedule's carry) attends and runs its MLP for those rows only, yet writes every row's K/V: the carry (logits,
    hidden state) and the caches equal the full forward's at those rows."""
    head, _ = saved_head
    assert_same_catch_up(head)


@torch.no_grad()
def test_deepseek_head_catch_up_of_the_last_rows_alone(dsv2_model):
    """The same for an MLA head with the target's MoE (latent and rope-key caches)."""
    assert_same_catch_up(dsv2_head(dsv2_model))


def assert_same_catch_up(head) -> None:
    for rows in ([2, 3, 7], [1, 3, 5]):  # packed rows 0-2, 3, 4-7: the last rows, then rows inside the spans
        logits, hidden, caches = catch_up_once(head, rows, alone=False)
        row_logits, row_hidden, row_caches = catch_up_once(head, rows, alone=True)
        torch.testing.assert_close(row_logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_hidden, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_caches, caches, rtol=0, atol=0)
