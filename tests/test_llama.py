"""Parity of infer's Llama (packed batches on the paged cache) with transformers' LlamaForCausalLM, and the loader.
The same parity over a batch's KV mirror (infer.attention): tests/test_llama_mirror.py, which uses the helpers here.

References are transformers' LlamaForCausalLM in fp32 with eager attention, run on each whole sequence at once.
Logits (and hidden states) must agree to max |diff| <= 1e-4 * (max - min) of the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from infer.attention import KV_BUCKET_MIN, TorchAttention, kv_buckets
from infer.kv_cache import PagePool, PageTable, build_page_metadata
from infer.loader import ModelLoadError, load_model
from infer.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REL_TOL = 1e-4
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    rel = ((ours.float() - ref.float()).abs().max() / (ref.max() - ref.min())).item()
    assert rel <= tol, f"max |diff| is {rel:.2e} of the reference range (tolerance {tol:.0e})"


@torch.no_grad()
def reference_logits(reference: HFLlama, tokens: torch.Tensor) -> torch.Tensor:
    return reference(tokens[None]).logits[0].float()


@torch.no_grad()
def run_paged(
    model: LlamaForCausalLM, steps: list[list[torch.Tensor]], page_size: int, aux_layers: tuple[int, ...] = (),
    num_pages: int = 128,
) -> list[list]:
    """steps[s][b]: the tokens sequence b appends in step s (none: it sits the step out); each step is ONE packed
    forward of its sequences. Returns, per step and sequence, (logits [q_len, V], hidden [q_len, H], aux {layer:
    [q_len, H]}), None for a sequence that sat the step out."""
    num_seqs = len(steps[0])
    pool = PagePool(num_pages, page_size)
    caches = model.allocate_kv_cache(num_pages, page_size, torch.float32, torch.device("cpu"))
    tables = [PageTable(pool) for _ in range(num_seqs)]
    attn = TorchAttention()
    results = []
    for all_chunks in steps:
        active = [b for b, chunk in enumerate(all_chunks) if len(chunk)]
        chunks, step_tables = [all_chunks[b] for b in active], [tables[b] for b in active]
        q_lens = [len(chunk) for chunk in chunks]
        for table, q_len in zip(step_tables, q_lens):
            table.extend(table.num_tokens + q_len)  # sequences grow in turn: their pages interleave
        meta = build_page_metadata(
            [t.pages for t in step_tables], q_lens, [t.num_tokens for t in step_tables], page_size, torch.device("cpu")
        )
        attn.plan(meta)
        out = model(torch.cat(chunks), meta.positions, attn, caches, aux_layers=aux_layers)
        logits, hidden = out.logits.split(q_lens), out.hidden_states.split(q_lens)
        aux = {i: h.split(q_lens) for i, h in out.aux_hidden_states.items()}
        step = [None] * num_seqs
        for i, b in enumerate(active):
            step[b] = (logits[i], hidden[i], {layer: aux[layer][i] for layer in aux})
        results.append(step)
    return results


def decode_steps(seqs: list[torch.Tensor], prompt_lens: list[int]) -> list[list[torch.Tensor]]:
    """One prefill step of each sequence's prompt, then one token per sequence per step."""
    steps = [[seq[:n] for seq, n in zip(seqs, prompt_lens)]]
    for i in range(len(seqs[0]) - prompt_lens[0]):
        steps.append([seq[n + i : n + i + 1] for seq, n in zip(seqs, prompt_lens)])
    return steps


def concat_logits(results: list[list], b: int) -> torch.Tensor:
    return torch.cat([step[b][0] for step in results if step[b] is not None])


def random_tokens(vocab: int, *lengths: int, seed: int) -> list[torch.Tensor]:
    """BOS (1) then random ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat((torch.tensor([1]), torch.randint(3, vocab, (n - 1,), generator=gen))) for n in lengths]


# --- stories260K ------------------------------------------------------------------------------------------------


def test_stories_packed_prefill_matches_transformers(stories_model, stories_reference):
    """Three sequences of different lengths, prefilled together in ONE forward."""
    prompts = random_tokens(512, 3, 29, 130, seed=0)
    (step,) = run_paged(stories_model, [prompts], page_size=16)
    for tokens, (logits, _, _) in zip(prompts, step):
        assert_close(logits, reference_logits(stories_reference, tokens))


def test_stories_batched_decode_matches_transformers(stories_model, stories_reference):
    """Prompts of 5, 2 and 9 tokens, then 20 single-token steps of all three together; pages of 4 are crossed."""
    prompt_lens = [5, 2, 9]
    seqs = random_tokens(512, *(n + 20 for n in prompt_lens), seed=1)
    results = run_paged(stories_model, decode_steps(seqs, prompt_lens), page_size=4)
    assert len(results) == 21
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(stories_reference, tokens))


def test_stories_chunked_prefill_equals_one_shot(stories_model, stories_reference):
    """A 33-token prompt prefilled in chunks of 7 (7, 7, 7, 7, 5), each chunk in a batch with another sequence's
    prefill or decode, gives the logits of a one-shot prefill (and of transformers)."""
    tokens, other = random_tokens(512, 33, 15, seed=2)
    chunks = list(tokens.split(7))
    assert [len(c) for c in chunks] == [7, 7, 7, 7, 5]
    steps = [[chunks[0], other[:11]]] + [[chunk, other[10 + i : 11 + i]] for i, chunk in enumerate(chunks[1:], 1)]
    chunked = run_paged(stories_model, steps, page_size=4)
    (one_shot,) = run_paged(stories_model, [[tokens]], page_size=4)
    assert_close(concat_logits(chunked, 0), one_shot[0][0])
    assert_close(concat_logits(chunked, 0), reference_logits(stories_reference, tokens))
    assert_close(concat_logits(chunked, 1), reference_logits(stories_reference, other))


def test_stories_mixed_step_matches_transformers(stories_model, stories_reference):
    """One step interleaving decodes, cached chunks and fresh prompts (a long one between short ones; two short ones
    of the same length, one cached, one fresh), then a decode step of all: every sequence's logits are transformers'.
    TorchAttention attends the short and the long queries in separate groups, so this checks that each group's rows
    go back to their places in the packed batch."""
    seqs = random_tokens(512, 9, 10, 11, 4, 5, seed=4)
    empty = torch.tensor([], dtype=torch.long)
    steps = [
        [seqs[0][:8], empty, seqs[2][:6], seqs[3][:3], empty],
        [seqs[0][8:9], seqs[1][:9], seqs[2][6:10], seqs[3][3:4], seqs[4][:4]],  # q_lens 1, 9 (fresh), 4, 1, 4 (fresh)
        [empty, seqs[1][9:], seqs[2][10:], empty, seqs[4][4:]],
    ]
    results = run_paged(stories_model, steps, page_size=4)
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(stories_reference, tokens))


def test_stories_decodes_of_spread_lengths_attend_in_kv_buckets(stories_model, stories_reference):
    """64 sequences of 3 to 213 tokens decode together: their keys are not all padded to the longest, the short
    queries are attended in groups of similar kv length (kv_buckets), and every sequence's logits are transformers'.
    Equal lengths, or a small key block, stay one group."""
    prompt_lens = [round(3 * 1.07**i) for i in range(64)]
    assert (min(prompt_lens), max(prompt_lens)) == (3, 213)
    groups = kv_buckets(list(range(64)), [n + 1 for n in prompt_lens])
    assert len(groups) > 1 and sorted(b for g in groups for b in g) == list(range(64))
    assert all(len(g) >= KV_BUCKET_MIN for g in groups)
    assert len(kv_buckets(list(range(64)), [200] * 64)) == 1 and len(kv_buckets(list(range(64)), prompt_lens[:32] * 2)) == 1
    seqs = random_tokens(512, *(n + 2 for n in prompt_lens), seed=6)
    results = run_paged(stories_model, decode_steps(seqs, prompt_lens), page_size=16, num_pages=512)
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(stories_reference, tokens))


@torch.no_grad()
def test_stories_hidden_states_and_aux_layers(stories_model, stories_reference):
    """hidden_states is the last decoder layer's output before the final norm; aux_layers (1, 3) are layers 1 and
    3's outputs, transformers' hidden_states[2] and [4] (its last entry, [5], is after the final norm)."""
    (tokens,) = random_tokens(512, 40, seed=3)
    ((logits, hidden, aux),) = run_paged(stories_model, [[tokens]], page_size=4, aux_layers=(1, 3))[0]
    captured = {}
    hook = stories_reference.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.setdefault("last", output[0] if isinstance(output, tuple) else output)
    )
    try:
        ref = stories_reference(tokens[None], output_hidden_states=True)
    finally:
        hook.remove()
    ref_states = [h[0] for h in ref.hidden_states]
    assert len(ref_states) == 6 and sorted(aux) == [1, 3]
    assert_close(aux[1], ref_states[2])
    assert_close(aux[3], ref_states[4])
    assert_close(hidden, captured["last"][0])  # pre-norm output of the last layer
    assert_close(stories_model.model.norm(hidden), ref_states[5])
    assert_close(stories_model.compute_logits(hidden), ref.logits[0])
    assert_close(stories_model.compute_logits(hidden, torch.tensor([0, 39])), ref.logits[0, [0, 39]])
    assert_close(logits, ref.logits[0])


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 200])  # 1-32 rows of 64: rms_norm_small; 33 and 200: F.rms_norm
@pytest.mark.parametrize("offset", [0.0, 100.0, 1e-4])  # centred, far from centred (the mean is part of the RMS), tiny
def test_rms_norm_matches_transformers(rows: int, offset: float, monkeypatch) -> None:
    """RMSNorm takes a layer_norm route for small fp32 CPU inputs: it must equal transformers' LlamaRMSNorm
    (values and gradients) on either side of the size cut, and the route must really be taken below it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from infer.models import common
    from infer.models.common import SMALL_NORM_ELEMENTS, RMSNorm

    calls = []
    small = common.rms_norm_small
    monkeypatch.setattr(common, "rms_norm_small", lambda *args: calls.append(1) or small(*args))

    gen = torch.Generator().manual_seed(rows)
    x = (offset + torch.randn(rows, 64, generator=gen) * max(offset, 1.0) * 0.1).requires_grad_()
    ours, ref = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=gen))
        ref.weight.copy_(ours.weight)
    out, expected = ours(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    assert len(calls) == (x.numel() <= SMALL_NORM_ELEMENTS)
    grad_out = torch.randn(out.shape, generator=gen)
    ours_grad = torch.autograd.grad(out, (x, ours.weight), grad_out)
    ref_grad = torch.autograd.grad(expected, (x, ref.weight), grad_out)
    for a, b in zip(ours_grad, ref_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_stories_cache_layout(stories_model):
    caches = stories_model.allocate_kv_cache(3, 4, torch.float32, torch.device("cpu"))
    assert len(caches) == 5 and caches[0].shape == (3, 2, 4, 4, 8)  # [pages, K/V, page_size, kv_heads, head_dim]
    assert stories_model.kv_bytes_per_token(torch.float32) == 2 * 4 * 8 * 4 * 5
    assert stories_model.lm_head.weight is stories_model.model.embed_tokens.weight  # tied


# --- a tiny random Llama 3: llama3 rope scaling, GQA, biases, untied embeddings ----------------------------------


def tiny_llama3_config(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE), rms_norm_eps=1e-5, initializer_range=0.1,
        attn_implementation="eager",
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> tuple[HFLlama, Path]:
    """The transformers reference (random weights, biases randomised too) and its save_pretrained folder."""
    torch.manual_seed(0)
    reference = HFLlama(tiny_llama3_config()).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:  # transformers initialises these to 0 / 1
                param.add_(torch.randn_like(param) * 0.1)
    folder = tmp_path_factory.mktemp("llama3")
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, folder


def test_llama3_rope_scaling_biases_untied_match_transformers(llama3):
    """Positions up to 204: a 200-token prefill packed with a 6-token one, then 5 decode steps of both."""
    reference, folder = llama3
    model = load_model(folder)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None and model.model.layers[0].mlp.down_proj.bias is not None
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    seqs = random_tokens(128, 205, 11, seed=4)
    results = run_paged(model, decode_steps(seqs, [200, 6]), page_size=16)
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(reference, tokens))


def test_llama3_scaling_is_not_a_no_op(llama3):
    """The test above would pass vacuously if llama3 scaling changed nothing at these positions."""
    reference, _ = llama3
    plain = HFLlama(tiny_llama3_config(rope_parameters=dict(rope_type="default", rope_theta=10000.0))).eval()
    plain.load_state_dict(reference.state_dict())
    (tokens,) = random_tokens(128, 200, seed=5)
    diff = (reference_logits(plain, tokens) - reference_logits(reference, tokens)).abs().max()
    assert diff > 1e-2


def test_llama3_legacy_rope_scaling_key_loads(llama3, tmp_path):
    """Llama-3.x checkpoints on the hub write rope_theta + rope_scaling in config.json, not rope_parameters."""
    reference, folder = llama3
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    for shard in folder.glob("*.safetensors"):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    model = load_model(tmp_path)
    (tokens,) = random_tokens(128, 180, seed=6)
    ((logits, _, _),) = run_paged(model, [[tokens]], page_size=16)[0]
    assert_close(logits, reference_logits(reference, tokens))


def test_sharded_checkpoint_loads_and_matches(llama3, tmp_path):
    """save_pretrained with a small max_shard_size writes model.safetensors.index.json and many shards (q, k and v
    of one layer can land in different files and still fill one fused parameter)."""
    reference, folder = llama3
    reference.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, single = load_model(tmp_path), load_model(folder)
    single_params = dict(single.named_parameters())
    for name, param in sharded.named_parameters():
        assert torch.equal(param, single_params[name]), name
    seqs = random_tokens(128, 23, 9, seed=7)
    (step,) = run_paged(sharded, [seqs], page_size=4)
    for tokens, (logits, _, _) in zip(seqs, step):
        assert_close(logits, reference_logits(reference, tokens))


# --- loader errors ----------------------------------------------------------------------------------------------


@pytest.fixture
def stories_copy(stories_hf_dir, tmp_path) -> Path:
    """A writable copy of the stories260K folder's config and weights."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((stories_hf_dir / name).read_bytes())
    return tmp_path


def test_missing_folder(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelLoadError, match="no_such_model"):
        load_model(missing)


def test_folder_without_config(stories_copy):
    (stories_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(stories_copy)


def test_unsupported_model_type(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="gpt2") as info:
        load_model(tmp_path)
    assert "config.json" in str(info.value) and "llama" in str(info.value)  # names the file and what is supported


def test_refuses_pickled_weights(stories_copy, monkeypatch):
    """Only pytorch_model.bin present: refuse, and never unpickle (torch.load must not even be called)."""
    state = load_file(stories_copy / "model.safetensors")
    torch.save(state, stories_copy / "pytorch_model.bin")
    (stories_copy / "model.safetensors").unlink()

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader unpickled a checkpoint")

    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        load_model(stories_copy)


@pytest.mark.parametrize("keep", ["header_length", "half_header", "half_data"])
def test_truncated_safetensors(stories_copy, keep):
    file = stories_copy / "model.safetensors"
    data = file.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    cut = {"header_length": 5, "half_header": 8 + header_len // 2, "half_data": (8 + header_len + len(data)) // 2}[keep]
    file.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(stories_copy)


@pytest.mark.parametrize(
    "key, shape",
    [
        ("model.embed_tokens.weight", (512, 60)),  # wrong hidden size
        ("model.norm.weight", (32,)),  # too short
        ("model.layers.2.mlp.down_proj.weight", (64, 170)),
        ("model.layers.0.self_attn.q_proj.weight", (72, 64)),  # too many rows for its slice of the fused qkv_proj
        ("model.layers.1.self_attn.k_proj.weight", (24, 64)),  # too few rows
        ("model.layers.3.mlp.up_proj.weight", (180, 64)),
    ],
)
def test_wrong_tensor_shape(stories_copy, key, shape):
    """The error names the file and the checkpoint's own key (what the user can look up), never loads silently."""
    file = stories_copy / "model.safetensors"
    state = load_file(file)
    assert key in state and state[key].shape != shape
    state[key] = torch.randn(shape)
    save_file(state, str(file))
    with pytest.raises(ModelLoadError) as info:
        load_model(stories_copy)
    message = str(info.value)
    assert key in message and "model.safetensors" in message, message
