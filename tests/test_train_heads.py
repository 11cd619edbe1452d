"""mtp_train heads and configs: counts at real shapes, the shared tensors, init, parity with the runtime, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from infer.attention import PackedCausalAttention, TorchAttention
from infer.kv_cache import build_page_metadata
from infer.models.mtp_head import (
    HeadLoadError, MTPHead, MTPHeadConfig, init_head_from_target, load_head, save_head, shared_tensors_sha256,
)
from mtp_train.data import PackedBatch
from data_tools.config import ConfigError
from mtp_train.config import compose_training
from mtp_train.heads import build_head
from mtp_train.memory_plan import parameter_counts
from mtp_train.target import TargetError, load_target
from mtp_train.trainer import param_groups
from mtp_train.unroll import STATS, LossWeights, UnrolledHead, unroll_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]

# (trainable, decoder layer, projection, frozen shared), mtp head
EXPECTED = {
    "stories260k": (284_992, 276_608, 8_192, 32_768),  # the head MLP 8x the target's (conf/recipe/stories260k.yaml)
    "llama3_2_1b": (69_216_256, 60_821_504, 8_388_608, 262_668_288),
    "llama3_1_8b": (251_678_720, 218_112_000, 33_554_432, 1_050_673_152),
    "llama3_1_70b": (989_896_704, 855_654_400, 134_217_728, 2_101_346_304),
    "deepseek_v2_lite": (89_401_856, 81_007_104, 8_388_608, 419_430_400),
}


@pytest.mark.parametrize("model", list(EXPECTED))
def test_every_model_config_composes_with_expected_counts(model):
    cfg = compose([f"model={model}", "trainer=zero3"])
    OmegaConf.to_container(cfg.trainer, resolve=True)  # per-size defaults resolve
    counts = parameter_counts(cfg)
    assert (counts["trainable"], counts["decoder_layer"], counts["projection"], counts["frozen_shared"]) == EXPECTED[model]
    eagle = parameter_counts(compose([f"model={model}", "head=eagle1"]))
    hidden = cfg.model.config.hidden_size
    # no enorm/hnorm/final_norm nor the layer's input norm, and a bias
    assert eagle["trainable"] == counts["trainable"] - 4 * hidden + hidden


def compose(overrides: list[str]):
    """The training config without features_dir, as memory_plan reads it."""
    return compose_training(overrides, complete=False)


def test_70b_head_matches_the_issue_figures():
    counts = parameter_counts(compose(["model=llama3_1_70b"]))
    assert round(counts["trainable"] / 1e9, 2) == 0.99 and round(counts["decoder_layer"] / 1e9, 2) == 0.86
    assert round(counts["projection"] / 1e9, 2) == 0.13 and round(counts["frozen_shared"] / 1e9, 1) == 2.1


def test_cfg_job_prints_the_composed_config():
    out = subprocess.run([sys.executable, "-m", "mtp_train.train", "model=llama3_1_70b", "trainer=zero3", "--cfg", "job"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.model.config.hidden_size == 8192 and cfg.trainer.zero_stage == 3 and cfg.head.architecture == "mtp"


def test_unknown_head_is_a_clear_error(stories_hf_dir):
    with pytest.raises(Exception, match="head/foo"):
        compose(["head=foo"])
    with pytest.raises(ConfigError, match="head.architecture must be one of mtp, eagle1, eagle3, block, got 'medusa'"):
        _cfg(stories_hf_dir, ["head.architecture=medusa"])


def _cfg(stories_hf_dir, overrides=()):
    return compose([f"model.path={stories_hf_dir}", *overrides])


@pytest.fixture(scope="module")
def target(stories_hf_dir):
    return load_target(_cfg(stories_hf_dir).model, torch.float32)


def test_shared_tensors_frozen_held_once_and_never_in_the_head(stories_hf_dir, target):
    head = build_head(target, _cfg(stories_hf_dir).head, str(stories_hf_dir))
    embed, lm_head = target.shared.embed_tokens.weight, target.shared.lm_head.weight
    assert lm_head is embed  # stories260K ties them: one tensor
    assert head.shared.embed_tokens.weight is embed and not embed.requires_grad
    ids = {id(p) for p in head.parameters()} | {id(p) for g in param_groups(head, 0.1) for p in g["params"]}
    assert id(embed) not in ids
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())
    # a few optimizer steps leave them bit-identical
    before = shared_tensors_sha256(embed, lm_head)
    model = UnrolledHead(head, target.norm_weight, target.eps, 2, LossWeights(ce=0.5, feature=0.3))
    opt = torch.optim.AdamW(param_groups(head, 0.1), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    batch = PackedBatch(torch.randint(0, 512, (20,), generator=g), torch.randn(20, 64, generator=g),
                        torch.ones(20, dtype=torch.bool), [12, 8], [0, 1])
    for _ in range(3):
        loss, _ = model(batch, torch.tensor([18.0, 16.0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert shared_tensors_sha256(embed, lm_head) == before == head.config.target["shared_tensors_sha256"]
    assert embed.grad is None


def test_chunked_sha_equals_the_runtime_identity(target, stories_model):
    from infer.models.mtp_head import shared_tensors_sha256 as runtime_sha  # noqa: PLC0415

    embed = target.shared.embed_tokens.weight
    assert shared_tensors_sha256(embed, embed, rows=7) == runtime_sha(stories_model.model.embed_tokens.weight,
                                                                      stories_model.lm_head.weight)


def test_init_from_target_last_layer_is_the_runtime_untrained_head(stories_hf_dir, target, stories_model):
    head = build_head(target, _cfg(stories_hf_dir, ["head.intermediate_size=null"]).head, str(stories_hf_dir))
    reference = init_head_from_target(stories_model, "stories260k")
    theirs = reference.state_dict()
    for key, value in head.state_dict().items():
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)
    random = build_head(target, _cfg(stories_hf_dir, ["head.init=random"]).head, str(stories_hf_dir))
    assert not torch.equal(random.layer.mlp.down_proj.weight, head.layer.mlp.down_proj.weight)


@pytest.mark.parametrize("arch", ["mtp", "eagle3"])
def test_a_wider_head_mlp_starts_as_the_target_layer_and_trains_its_new_units(stories_hf_dir, target, arch):
    """head.intermediate_size widens the target layer's MLP without changing the head's function (new units: drawn
    gate/up rows, zero down_proj columns), the new units get gradients, and the runtime builds the wider layer from
    the head's config. A control that draws the down_proj columns too changes the function."""
    from mtp_train.heads import widen_mlp  # noqa: PLC0415

    narrow = build_head(target, _cfg(stories_hf_dir, [f"head={arch}", "head.intermediate_size=null"]).head,
                        str(stories_hf_dir))
    wide = build_head(target, _cfg(stories_hf_dir, [f"head={arch}", "head.intermediate_size=400"]).head,
                      str(stories_hf_dir))
    assert wide.layer.mlp.gate_up_proj.weight.shape == (800, 64) and wide.layer.mlp.down_proj.weight.shape == (64, 400)
    assert wide.config.decoder_config().intermediate_size == 400
    g = torch.Generator().manual_seed(0)
    ids, lens, hidden = torch.randint(0, 512, (11,), generator=g), [6, 5], torch.randn(11, 64, generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])

    def logits(head):
        return head(ids, positions, PackedCausalAttention(lens), [None], hidden_states=hidden).logits

    torch.testing.assert_close(logits(wide), logits(narrow), rtol=1e-5, atol=1e-5)
    logits(wide).logsumexp(-1).sum().backward()
    assert wide.layer.mlp.down_proj.weight.grad[:, 172:].abs().sum() > 0  # the new units learn
    state = {k: v.clone() for k, v in narrow.layer.state_dict().items()}
    control = widen_mlp(state, 400, 0.02)
    control["mlp.down_proj.weight"][:, 172:] = 0.02  # a widening that is not function-preserving
    with torch.no_grad():
        wide.layer.mlp.down_proj.weight.copy_(control["mlp.down_proj.weight"])
    assert not torch.allclose(logits(wide), logits(narrow), rtol=1e-5, atol=1e-5)
    with pytest.raises(TargetError, match="narrower than the target layer's MLP"):
        widen_mlp(state, 100, 0.02)


@pytest.mark.parametrize("arch", ["mtp", "eagle3"])
def test_autocast_trains_the_fp32_objective_with_bf16_matmuls_and_fp32_attention(stories_hf_dir, target, arch,
                                                                                 monkeypatch):
    """trainer.autocast: the unrolled loss and its gradients are the fp32 ones within bf16's precision (and not
    bit-equal: the linear layers did run in bf16), while every attention call reads fp32. A control whose chain
    attention runs in bf16 is seen by the same spy."""
    import mtp_train.unroll as unroll  # noqa: PLC0415
    from mtp_train.ttt import ChainAttention  # noqa: PLC0415

    overrides = [f"head={arch}", "trainer.dtype=float32", "trainer.autocast=true"]
    head = build_head(target, _cfg(stories_hf_dir, overrides).head, str(stories_hf_dir))
    g = torch.Generator().manual_seed(0)
    lens = [24, 16]
    aux = torch.randn(40, 3, 64, generator=g) if arch == "eagle3" else None
    batch = PackedBatch(torch.randint(0, 512, (40,), generator=g), torch.randn(40, 64, generator=g),
                        torch.ones(40, dtype=torch.bool), lens, [0, 1], aux)
    params = [p for p in head.parameters() if p.requires_grad]
    attention_dtypes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: attention_dtypes.append(q.dtype) or sdpa(q, *a, **k))

    def loss_and_grad(autocast: bool) -> tuple[float, torch.Tensor]:
        model = UnrolledHead(head, target.norm_weight, target.eps, 3, LossWeights(ce=1.0, tv=1.0), autocast=autocast)
        loss, _ = model(batch, torch.tensor([38.0, 36.0, 34.0]))
        return loss.item(), torch.cat([grad.flatten() for grad in torch.autograd.grad(loss, params)])

    loss32, grad32 = loss_and_grad(False)
    attention_dtypes.clear()
    loss16, grad16 = loss_and_grad(True)
    assert len(attention_dtypes) == 2 * 3 and set(attention_dtypes) == {torch.float32}  # records x steps
    assert loss16 != loss32 and abs(loss16 - loss32) < 2**-8 * loss32  # bf16's unit roundoff (eagle3: 2.5e-3)
    assert grad16.dtype == torch.float32 and torch.nn.functional.cosine_similarity(grad16, grad32, 0) > 0.999
    attention_dtypes.clear()
    monkeypatch.setattr(unroll, "ChainAttention", lambda dtype: ChainAttention(torch.bfloat16))  # control
    loss_and_grad(True)
    assert torch.bfloat16 in attention_dtypes


@pytest.mark.parametrize("arch", ["mtp", "eagle1"])
def test_exported_head_serves_the_trained_function(tmp_path, stories_hf_dir, target, stories_model, arch):
    cfg = _cfg(stories_hf_dir, [f"head={arch}"])
    head = build_head(target, cfg.head, str(stories_hf_dir))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained"
    save_head(head, tmp_path / "head")
    served = load_head(tmp_path / "head", stories_model)
    assert served.shared.embed_tokens is stories_model.model.embed_tokens  # the runtime's own tensors, no copy
    g = torch.Generator().manual_seed(1)
    ids, hidden, lens = torch.randint(0, 512, (11,), generator=g), torch.randn(11, 64, generator=g), [6, 5]
    positions = torch.cat([torch.arange(n) for n in lens])
    ours = head(ids, positions, PackedCausalAttention(lens), [None], hidden_states=hidden)
    theirs = served(ids, positions, PackedCausalAttention(lens), [None], hidden_states=hidden)
    torch.testing.assert_close(ours.logits, theirs.logits)
    # and the serving path over the paged cache computes the same
    caches = served.allocate_kv_cache(4, 8, torch.float32, torch.device("cpu"))
    meta = build_page_metadata([[0], [1]], lens, lens, 8, torch.device("cpu"))
    attn = TorchAttention()
    attn.plan(meta)
    paged = served(ids, positions, attn, caches, hidden_states=hidden)
    torch.testing.assert_close(paged.logits, ours.logits, rtol=1e-5, atol=1e-5)


def test_head_refuses_another_target(tmp_path, stories_hf_dir, target, stories_model):
    save_head(build_head(target, _cfg(stories_hf_dir).head, str(stories_hf_dir)), tmp_path / "head")
    other = type(stories_model)(stories_model.config)
    other.load_state_dict(stories_model.state_dict())
    with torch.no_grad():
        other.model.embed_tokens.weight[0] += 1
    with pytest.raises(HeadLoadError, match="trained against 'stories260k'"):
        load_head(tmp_path / "head", other)


def test_unroll_plan_feeds_each_step_its_own_outputs():
    steps = unroll_plan([4, 3], 3)
    assert [s.seq_lens for s in steps] == [[3, 2], [2, 1], [1]]
    # step 0: tokens t_{i+1}, hidden h_i; step 1: tokens t_{i+2}, hidden = step 0's output at i
    assert steps[0].token_index.tolist() == [1, 2, 3, 5, 6] and steps[0].prev_index.tolist() == [0, 1, 2, 4, 5]
    assert steps[1].token_index.tolist() == [2, 3, 6] and steps[1].prev_index.tolist() == [0, 1, 3]
    assert steps[1].positions.tolist() == [1, 2, 1]
    assert steps[2].token_index.tolist() == [3] and steps[2].prev_index.tolist() == [0]


def test_deepseek_head_trains_the_served_mla_function():
    decoder = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                   rms_norm_eps=1e-6, max_position_embeddings=64, n_routed_experts=4)
    torch.manual_seed(0)
    head = MTPHead(MTPHeadConfig(hidden_size=32, vocab_size=50, decoder=decoder, decoder_type="deepseek_v2"))
    embed, lm_head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)
    from infer.models.mtp_head import SharedTargetWeights  # noqa: PLC0415

    head.attach(SharedTargetWeights(embed, lm_head))
    lens = [5, 7]
    ids, hidden = torch.randint(0, 50, (12,)), torch.randn(12, 32)
    positions = torch.cat([torch.arange(n) for n in lens])
    trained = head(ids, positions, PackedCausalAttention(lens), [(None, None)], hidden_states=hidden)
    caches = head.allocate_kv_cache(4, 8, torch.float32, torch.device("cpu"))
    meta = build_page_metadata([[0], [1]], lens, lens, 8, torch.device("cpu"))
    attn = TorchAttention()
    attn.plan(meta)
    served = head(ids, positions, attn, caches, hidden_states=hidden)
    torch.testing.assert_close(trained.logits, served.logits, rtol=1e-5, atol=1e-5)


def test_deepseek_target_head_init_and_training_step(tmp_path):
    """A tiny DeepSeek-V2 target saved by transformers: the head's MLA attention comes from its last layer, its
    dense MLP from the first (dense) layer, and an unrolled training step runs and moves only the head."""
    from transformers import DeepseekV2Config  # noqa: PLC0415
    from transformers import DeepseekV2ForCausalLM as HFDeepseekV2  # noqa: PLC0415

    from infer.loader import load_model  # noqa: PLC0415

    torch.manual_seed(0)
    config = DeepseekV2Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              max_position_embeddings=128)
    HFDeepseekV2(config).save_pretrained(tmp_path)
    cfg = compose([f"model.path={tmp_path}", "model.name=tiny_dsv2", "head.intermediate_size=null"])
    target = load_target(cfg.model, torch.float32)
    head = build_head(target, cfg.head, str(tmp_path))
    reference = load_model(tmp_path)
    for name, value in head.layer.state_dict().items():
        source = reference.model.layers[0 if name.startswith("mlp.") else 2].state_dict()[name]
        torch.testing.assert_close(value, source, rtol=0, atol=0, msg=name)
    moe = build_head(target, compose([f"model.path={tmp_path}", "head.mlp=moe", "head.intermediate_size=null"]).head,
                     str(tmp_path))
    last = reference.model.layers[2].state_dict()  # head.mlp=moe: the whole last layer, router and experts too
    assert sorted(moe.layer.state_dict()) == sorted(last) and "mlp.experts.3.down_proj.weight" in last
    for name, value in moe.layer.state_dict().items():
        torch.testing.assert_close(value, last[name], rtol=0, atol=0, msg=name)
    # a wider dense MLP (separate gate/up layout): the target's units first, the new ones silent
    wide = build_head(target, compose([f"model.path={tmp_path}", "head.intermediate_size=64"]).head, str(tmp_path))
    for name in ("gate_proj", "up_proj"):
        torch.testing.assert_close(getattr(wide.layer.mlp, name).weight[:48], getattr(head.layer.mlp, name).weight)
    assert wide.layer.mlp.down_proj.weight.shape == (32, 64) and not wide.layer.mlp.down_proj.weight[:, 48:].any()
    with pytest.raises(HeadLoadError, match="an MoE head keeps the target's experts"):
        build_head(target, compose([f"model.path={tmp_path}", "head.mlp=moe", "head.intermediate_size=64"]).head,
                   str(tmp_path))
    # head.init=random: every tensor drawn, the router too (infer builds it uninitialised: garbage or NaN)
    random = build_head(target, compose([f"model.path={tmp_path}", "head.mlp=moe", "head.init=random",
                                         "head.intermediate_size=null"]).head, str(tmp_path))
    assert all(bool(p.isfinite().all()) for p in random.parameters())
    assert 0.015 < random.layer.mlp.gate.weight.std().item() < 0.025  # N(0, initializer_range 0.02)
    with pytest.raises(ConfigError, match="head.mlp must be one of dense, moe"):
        compose([f"model.path={tmp_path}", "head.mlp=sparse"])
    model = UnrolledHead(head, target.norm_weight, target.eps, 2, LossWeights(ce=0.1, chunk_tokens=5))
    batch = PackedBatch(torch.randint(0, 96, (15,)), torch.randn(15, 32), torch.ones(15, dtype=torch.bool), [9, 6], [0, 1])
    before = head.layer.self_attn.kv_b_proj.weight.clone()
    loss, stats = model(batch, torch.tensor([13.0, 11.0]))
    loss.backward()
    torch.optim.SGD(head.parameters(), lr=0.1).step()
    assert torch.isfinite(loss) and stats.shape == (2, len(STATS))
    assert not torch.equal(before, head.layer.self_attn.kv_b_proj.weight)
    assert target.shared.embed_tokens.weight.grad is None


@pytest.mark.parametrize("override,message", [
    ("trainer.zero_stage=4", "trainer.zero_stage must be one of 1, 2, 3, got 4"),
    ("trainer.dtype=float16", "trainer.dtype must be one of bfloat16, float32, got 'float16'"),
    ("trainer.lr=-1", "trainer.lr must be >= 0.0, got -1.0"),
    ("trainer.max_steps=lots", "trainer.max_steps=lots: Value 'lots' of type 'str' could not be converted to Integer"),
    ("trainer.autocast=true", "trainer.autocast .* needs trainer.dtype=float32, got bfloat16"),
    ("trainer.seq_len=4", r"trainer.seq_len=4 cuts every record shorter than loss.unroll_steps \+ 1 = 5 tokens"),
])
def test_bad_trainer_values_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        compose([override])


def test_deepspeed_config_and_schedule():
    from mtp_train.distributed import deepspeed_config  # noqa: PLC0415
    from mtp_train.trainer import warmup_cosine  # noqa: PLC0415

    ds = deepspeed_config(compose(["trainer=zero3", "trainer.dtype=float32", "trainer.grad_accum=4"]).trainer)
    assert ds["zero_optimization"]["stage"] == 3 and not ds["bf16"]["enabled"]
    assert ds["gradient_accumulation_steps"] == 4 and ds["optimizer"]["params"]["torch_adam"]  # no FusedAdam JIT
    factor = warmup_cosine(warmup=10, total=110, min_ratio=0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1) and factor(500) == pytest.approx(0.1)
