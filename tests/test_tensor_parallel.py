"""Tensor parallelism on CPU: two gloo processes (infer.parallel.spawn) against one process.

One two-rank session runs every scenario in turn (spawning costs seconds on these machines): paged forwards
of stories260K, tiny Llama-3s (GQA; one KV head, fewer than the ranks) and tiny DeepSeek-V2s (MLA with and
without q_lora_rank, MoE), then generation through the Engine plainly, with an MTP head, an EAGLE-3 head and a draft LM,
`infer.bench --tp 2` and `mtp_train.validate --tp 2` (their mains join the session's group as under torchrun),
and last a failure injected on rank 1. The tests compare what rank 0 recorded with the same work done here in
one process: logits within 1e-6 of the logit range, greedy tokens identical; the heads are fitted in the test, so
their shards draft (tau above 1.1 on these prompts of random tokens) and a broken one would show.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from infer.bench.cli import main as bench_main
from infer.cli import run_cli
from infer.engine import Engine, EngineConfig
from infer.generate import main as generate_main
from infer.kv_cache import PagePool, PageTable, build_page_metadata
from infer.loader import CheckpointTensor, load_model
from infer.model_runner import ModelRunner
from infer.models.deepseek_v2 import DeepseekV2ForCausalLM
from infer.models.llama import LlamaForCausalLM
from infer.models.mtp_head import load_head, save_head
from infer.parallel import (
    RemoteRankError, ShardingError, TPGroup, broadcast_step, fail, init_tp, parameter_bytes, receive_step,
    serve_forever, spawn, stop_workers,
)
from infer.prompts import VALIDATION_PROMPTS
from infer.sampling_params import SamplingParams
from mtp_train.validate import main as validate_main
from tests.test_deepseek_v2 import CONFIGS as DEEPSEEK_CONFIGS
from tests.test_deepseek_v2 import tiny_config as tiny_deepseek_config
from tests.test_eagle3 import eagle3_head
from tests.fitted_head import fit_head
from tests.test_llama import tiny_llama3_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REL_TOL = 1e-6  # of the logit range; measured 1.1e-7 (fp32 reduction order of the row-split layers)
STORY_END = 1  # stories260K ends a story with BOS
PROMPTS = [[1, 400, 301, 280], [1, 65, 300], [1, 259, 270, 290, 310, 330]]
# Parameters every rank holds whole; all others are split evenly at tp=2 in the configs the byte test checks.
REPLICATED = ("norm", "o_proj.bias", "down_proj.bias", "q_a_proj", "kv_a_proj_with_mqa", "mlp.gate.weight")


class InjectedFailure(ValueError):
    pass


def bench_args(stories: str, head_dir: str) -> list[str]:
    return ["--model", stories, "--spec", "mtp", "--draft", head_dir, "--num-draft-tokens", "2", "--batch-sizes", "2",
            "--max-new-tokens", "12", "--repeats", "1", "--arrivals", "2", "--json", "--device", "cpu"]


def validate_args(stories: str, head_dir: str, out: str, prompts: str) -> list[str]:
    return ["--target", stories, "--head", head_dir, "--prompts", prompts, "--num-draft-tokens", "1",
            "--max-new-tokens", "12", "--batch-size", "3", "--repeats", "1", "--temperatures", "0,1",
            "--recommend-for", "1,3", "--out", out, "--device", "cpu"]


def paged_logits(runner: ModelRunner, vocab: int, seed: int = 0) -> torch.Tensor:
    """Two sequences over 4-token pages: a packed prefill (7 and 3 tokens), a 3-token chunk beside a decode,
    then three decode steps; every step through ModelRunner.run. Returns all logits, [T, vocab]."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (13,), generator=gen), torch.randint(0, vocab, (7,), generator=gen)]
    q_lens = [(7, 3), (3, 1), (1, 1), (1, 1), (1, 1)]
    pool = PagePool(64, 4)
    tables, offsets, logits = [PageTable(pool), PageTable(pool)], [0, 0], []
    for lens in q_lens:
        for table, n in zip(tables, lens):
            table.extend(table.num_tokens + n)
        meta = build_page_metadata([t.pages for t in tables], list(lens), [t.num_tokens for t in tables], 4,
                                   torch.device("cpu"))
        ids = torch.cat([seq[off : off + n] for seq, off, n in zip(seqs, offsets, lens)])
        logits.append(runner.run(ids, meta).logits)
        offsets = [off + n for off, n in zip(offsets, lens)]
    return torch.cat(logits)


def make_engine(model: torch.nn.Module) -> Engine:
    return Engine(model, None, [], EngineConfig(page_size=4, num_pages=256, max_num_seqs=4, backend="torch"))


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=20, stop_token_ids=(STORY_END,))


def generate(engine: Engine, kind: str, record: dict) -> None:
    requests = engine.generate(PROMPTS, greedy())
    record[f"{kind}/tokens"] = [r.output_ids for r in requests]
    if engine.spec_stats is not None:
        record[f"{kind}/verify_steps"] = engine.spec_stats.verify_steps
        record[f"{kind}/tau"] = engine.spec_stats.tau


def rank_session(folders: dict[str, str], stories: str, head_dir: str, eagle3_dir: str, out: str,
                 prompts: str) -> None:
    """One rank of the two-rank session: every rank builds the same models and runners in the same order;
    rank 0 runs the steps (and records them), rank 1 serves them."""
    torch.set_num_threads(1)
    tp = init_tp(2)
    record: dict = {}
    read_bytes = [0]
    read = CheckpointTensor.read

    def counting_read(self: CheckpointTensor) -> torch.Tensor:  # what this rank reads from safetensors
        tensor = read(self)
        read_bytes[0] += tensor.numel() * tensor.element_size()
        return tensor

    CheckpointTensor.read = counting_read
    base = torch.arange(24.0).view(2, 3, 4)
    view = (base * (tp.rank + 1)).transpose(0, 2)  # a non-contiguous view, summed in place
    tp.all_reduce(view)
    record["collectives"] = {"sum_by_gather": tp.sum_by_gather, "all_reduce": view.transpose(0, 2).clone(),
                             **{f"all_gather_{d}": tp.all_gather(base * (tp.rank + 1), d) for d in (0, 1, -1)}}
    models = {}
    for name, folder in {"stories": stories, **folders}.items():
        read_bytes[0] = 0
        models[name] = model = load_model(folder)
        record[f"{name}/param_bytes"], record[f"{name}/read_bytes"] = parameter_bytes(model), read_bytes[0]
        runner = ModelRunner(model, 64, 4, "torch")
        if tp.rank == 0:
            record[f"{name}/logits"] = paged_logits(runner, model.config.vocab_size)
            stop_workers()
        else:
            serve_forever()

    target = models["stories"]
    for kind in ("plain", "mtp", "eagle3", "draft"):
        engine = make_engine(target)
        if kind == "mtp":  # a saved whole head, cut to this rank's shard of its layer
            head = load_head(head_dir, target)
            engine.num_draft_tokens = 2
            engine.attach_drafter("mtp", head)
        if kind == "eagle3":  # a saved whole EAGLE-3 head (draft vocabulary of 256), cut to this rank's shard
            head = load_head(eagle3_dir, target)
            record["eagle3/param_bytes"] = parameter_bytes(head)
            engine.num_draft_tokens = 2
            engine.attach_drafter("eagle3", head)
        if kind == "draft" and tp.rank == 0:  # a whole draft LM on rank 0 only
            draft = load_model(stories, tp=TPGroup())
            record["draft/param_bytes"] = parameter_bytes(draft)
            engine.num_draft_tokens = 3
            engine.attach_drafter("draft", draft)
        if tp.rank == 0:
            generate(engine, kind, record)
            stop_workers()
        else:
            serve_forever()

    clis = {"bench": (bench_main, bench_args(stories, head_dir)),
            "validate": (validate_main, validate_args(stories, head_dir, str(Path(out) / "validate"), prompts))}
    for name, (cli, argv) in clis.items():  # rank 0 measures and reports; rank 1 serves until rank 0 returns
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            record[f"{name}/exit"] = cli(["--tp", "2", *argv])
        if tp.rank == 0:
            stop_workers()  # what tp_main does when the CLI's main returns
        record[f"{name}/stdout"] = stdout.getvalue()

    engine = make_engine(target)
    if tp.rank == 1:  # rank 1 fails in its second step, in the middle of the forward
        mlp, calls = target.model.layers[2].mlp, []

        def failing(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) > 1:
                raise InjectedFailure("injected failure in layer 2's MLP")
            return type(mlp).forward(mlp, x)

        mlp.forward = failing
    try:
        if tp.rank == 0:
            engine.generate(PROMPTS, greedy())
        else:
            serve_forever()
    except (RemoteRankError, InjectedFailure) as err:
        record["error"] = f"{type(err).__name__}: {err}"
        fail(err)
    torch.save(record, Path(out) / f"rank{tp.rank}.pt")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Random tiny models saved by transformers: Llama-3 with 2 KV heads and with 1, DeepSeek-V2 lite and v2."""
    torch.manual_seed(0)
    out = {}
    for name, reference in {
        "llama3_gqa": HFLlama(tiny_llama3_config()),
        "llama3_one_kv_head": HFLlama(tiny_llama3_config(num_key_value_heads=1)),
        "deepseek_lite": HFDeepseekV2(tiny_deepseek_config(**DEEPSEEK_CONFIGS["lite"])),
        "deepseek_v2": HFDeepseekV2(tiny_deepseek_config(**DEEPSEEK_CONFIGS["v2"])),
    }.items():
        with torch.no_grad():
            for pname, param in reference.named_parameters():
                if pname.endswith("bias") or "norm" in pname:  # transformers initialises these to 0 / 1
                    param.add_(torch.randn_like(param) * 0.1)
        out[name] = tmp_path_factory.mktemp(name)
        reference.save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def head_dir(stories_model, stories_engine, tmp_path_factory) -> Path:
    """An MTP head fitted in the test (tests/fitted_head.py): it drafts, so a broken shard of it shows."""
    return save_head(fit_head(stories_engine), tmp_path_factory.mktemp("h") / "head")


@pytest.fixture(scope="module")
def eagle3_dir(stories_model, stories_engine, tmp_path_factory) -> Path:
    """A fitted EAGLE-3 head with a draft vocabulary of 256."""
    return save_head(fit_head(stories_engine, eagle3_head(stories_model, draft_vocab=256)),
                     tmp_path_factory.mktemp("e3") / "head")


@pytest.fixture(scope="module")
def stories_engine(stories_hf_dir) -> Engine:
    return Engine.from_pretrained(stories_hf_dir, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_session")


@pytest.fixture(scope="module")
def validate_prompts(tmp_path_factory) -> Path:
    """Six held-out openings (two batches of the validation's 3): every rank path of a validation, a tenth of its
    collective forwards."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in VALIDATION_PROMPTS[:6]))
    return path


@pytest.fixture(scope="module")
def session(folders, stories_hf_dir, head_dir, eagle3_dir, session_dir, validate_prompts) -> tuple[dict, dict]:
    """(rank 0's record, rank 1's record) of the two-rank session."""
    out = session_dir
    spawn(rank_session, 2, {k: str(v) for k, v in folders.items()}, str(stories_hf_dir), str(head_dir),
          str(eagle3_dir), str(out), str(validate_prompts), timeout_s=240)
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")


def test_gloo_collectives_sum_and_gather_in_rank_order(session):
    """On gloo an all-reduce is an all-gather and a local sum (TPGroup.sum_by_gather), written into the tensor it
    was given, a view included; all_gather concatenates the ranks' tensors in rank order along any dim."""
    base = torch.arange(24.0).view(2, 3, 4)
    for record in session:
        collectives = record["collectives"]
        assert collectives["sum_by_gather"] is True
        assert torch.equal(collectives["all_reduce"], base * 3)
        for dim in (0, 1, -1):
            assert torch.equal(collectives[f"all_gather_{dim}"], torch.cat((base, base * 2), dim=dim))


@pytest.mark.parametrize("name", ["stories", "llama3_gqa", "llama3_one_kv_head", "deepseek_lite", "deepseek_v2"])
def test_two_ranks_give_the_logits_of_one(session, folders, stories_hf_dir, name):
    model = load_model(stories_hf_dir if name == "stories" else folders[name])
    reference = paged_logits(ModelRunner(model, 64, 4, "torch"), model.config.vocab_size)
    ours = session[0][f"{name}/logits"]
    assert ours.shape == reference.shape
    rel = ((ours - reference).abs().max() / (reference.max() - reference.min())).item()
    assert rel <= REL_TOL, f"max |diff| is {rel:.1e} of the logit range"
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("name", ["stories", "llama3_gqa", "deepseek_lite", "deepseek_v2"])
def test_each_rank_holds_and_reads_half_plus_the_replicated_parts(session, folders, stories_hf_dir, name):
    model = load_model(stories_hf_dir if name == "stories" else folders[name])
    whole = parameter_bytes(model)
    replicated = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if any(part in n for part in REPLICATED))
    assert 0 < replicated < whole / 4
    for record in session:
        assert record[f"{name}/param_bytes"] == (whole - replicated) // 2 + replicated
        assert record[f"{name}/read_bytes"] == record[f"{name}/param_bytes"]  # never a tensor it does not keep


def test_one_kv_head_is_replicated_on_both_ranks(session, folders):
    """num_key_value_heads=1 < tp=2: each rank keeps the one KV head, so it holds more than half."""
    whole = parameter_bytes(load_model(folders["llama3_one_kv_head"]))
    assert session[0]["llama3_one_kv_head/param_bytes"] == session[1]["llama3_one_kv_head/param_bytes"]
    assert whole / 2 < session[0]["llama3_one_kv_head/param_bytes"] < 0.6 * whole


@pytest.mark.parametrize("kind", ["plain", "mtp", "eagle3", "draft"])
def test_engine_generates_the_tokens_of_one_rank(session, stories_model, head_dir, eagle3_dir, kind):
    engine = make_engine(stories_model)
    if kind == "mtp":
        engine.num_draft_tokens = 2
        engine.attach_drafter("mtp", load_head(head_dir, stories_model))
    if kind == "eagle3":  # the same drafts as one process: identical tau, from a head split over the ranks
        head = load_head(eagle3_dir, stories_model)
        engine.num_draft_tokens = 2
        engine.attach_drafter("eagle3", head)
        whole, fc = parameter_bytes(head), head.fc.weight.numel() * head.fc.weight.element_size()
        for rank in session:
            assert fc < rank["eagle3/param_bytes"] < 0.75 * whole
    if kind == "draft":
        engine.num_draft_tokens = 3
        engine.attach_drafter("draft", stories_model)
    record: dict = {}
    generate(engine, kind, record)
    assert session[0][f"{kind}/tokens"] == record[f"{kind}/tokens"]
    assert all(len(tokens) == 20 for tokens in record[f"{kind}/tokens"])  # long enough to mean something
    if kind != "plain":
        assert session[0][f"{kind}/verify_steps"] > 0
        assert session[0][f"{kind}/tau"] == record[f"{kind}/tau"] > 1.1  # fitted heads draft: a broken shard would show
    if kind == "draft":  # the draft LM is whole, on rank 0
        assert session[0]["draft/param_bytes"] == parameter_bytes(stories_model)
        assert session[0]["draft/tau"] > 3


def test_an_error_on_one_rank_reaches_the_other(session):
    rank0, rank1 = session
    assert rank1["error"] == "InjectedFailure: injected failure in layer 2's MLP"
    assert rank0["error"] == "RemoteRankError: rank 1: InjectedFailure: injected failure in layer 2's MLP"


def test_bench_cli_with_tp_matches_one_process(session, stories_hf_dir, head_dir, capsys):
    """`infer.bench --tp 2 --spec mtp`: rank 0 prints the rows one process prints (same tau and acceptance per K,
    the stream of arrivals included); rank 1 prints nothing."""
    rank0, rank1 = session
    assert rank0["bench/exit"] == rank1["bench/exit"] == 0 and rank1["bench/stdout"] == ""
    two = json.loads(rank0["bench/stdout"])
    assert bench_main(bench_args(str(stories_hf_dir), str(head_dir))) == 0
    one = json.loads(capsys.readouterr().out)
    assert (two["tp"], one["tp"]) == (2, 1)
    measured = lambda result: [(r["k"], r["tau"], r["acceptance_per_position"]) for r in result["rows"]]  # noqa: E731
    assert measured(two) == measured(one) and [k for k, *_ in measured(one)] == [2]
    assert two["arrivals"]["tau"] == one["arrivals"]["tau"] and two["arrivals"]["speculated_share"] > 0
    for result in (one, two):  # the speculative engine got the plain run's arrival times: its latency is compared
        arrivals = result["arrivals"]
        spec, plain = arrivals["spec_latency_ms"], arrivals["plain_latency_ms"]  # each rounded to 0.01 ms
        assert plain > 0.01 and (spec - 0.005) / (plain + 0.005) - 5e-4 <= arrivals["latency_ratio"] \
            <= (spec + 0.005) / (plain - 0.005) + 5e-4  # the ratio rounded to 0.001
    # K is recommended from each run's own forward timings, which two processes and one need not share: the same
    # rows are recommended for and checked at the same K, and each recommends that K or plain decoding
    chosen = lambda result: [(r["temperature"], r["batch_size"], r["checked_k"]) for r in result["recommendations"]]  # noqa: E731
    assert chosen(two) == chosen(one) == [(0.0, 2, 2)]
    assert all(r["recommended_k"] in (0, 2) for result in (one, two) for r in result["recommendations"])
    for result in (one, two):  # a CPU row splits the fastest runs' steps into forwards and host work
        assert all(r[name] > 0 for r in result["rows"] for name in ("plain_host_ms", "spec_forward_ms", "spec_host_ms"))


def test_validate_cli_with_tp_matches_one_process(session, session_dir, stories_hf_dir, head_dir, validate_prompts,
                                                  tmp_path, capsys):
    """`mtp_train.validate --tp 2`: the report of one process (acceptance, tau, the trainer's replay recomputed by
    collective forwards on rank 0's sequences, a K recommended per batch size); only rank 0 writes it."""
    rank0, rank1 = session
    assert rank0["validate/exit"] == rank1["validate/exit"] == 0 and rank1["validate/stdout"] == ""
    two = json.loads((session_dir / "validate" / "report.json").read_text())
    assert validate_main(validate_args(str(stories_hf_dir), str(head_dir), str(tmp_path), str(validate_prompts))) == 0
    one = json.loads((tmp_path / "report.json").read_text())
    assert (two["tp"], one["tp"]) == (2, 1)
    measured = lambda report: [(r["temperature"], r["tau"], r["conditional_acceptance"],  # noqa: E731
                                r["accepted_length_histogram"]) for r in report["runs"]]
    assert measured(two) == measured(one) and len(measured(one)) == 2
    assert two["trainer_replay"]["positions"] == one["trainer_replay"]["positions"] > 0
    assert two["trainer_replay"]["kl"] == pytest.approx(one["trainer_replay"]["kl"], rel=1e-4, abs=1e-4)
    assert two["trainer_replay"]["top1"] == one["trainer_replay"]["top1"]
    assert sorted(two["recommended_k"]["by_batch_size"]) == sorted(one["recommended_k"]["by_batch_size"]) == ["1", "3"]


def test_generate_cli_under_torchrun_matches_one_process(stories_hf_dir, capfd):
    """`torchrun --nproc_per_node 2 -m infer.generate --tp 2`, with a draft LM (rank 0 only), prints what one
    process prints; rank 1 prints nothing."""
    argv = ["--model", str(stories_hf_dir), "--prompt", "Once upon a time", "--max-new-tokens", "24", "--json",
            "--spec", "draft", "--draft", str(stories_hf_dir), "--num-draft-tokens", "3", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "infer.generate", "--tp", "2", *argv], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (two_ranks,) = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    capfd.readouterr()
    assert run_cli(lambda: generate_main(argv)) == 0
    (one_rank,) = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.strip()]
    assert two_ranks["token_ids"] == one_rank["token_ids"] and len(one_rank["token_ids"]) == 24
    assert two_ranks["spec"]["tau"] == one_rank["spec"]["tau"] > 3


# --- without processes -----------------------------------------------------------------------------------------


class _Wire:
    """A two-rank group's broadcasts in one process: rank 0's are recorded, rank 1's receive them in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def end(self, rank: int) -> "_WireEnd":
        return _WireEnd(self, rank)


class _WireEnd:
    size, device = 2, torch.device("cpu")

    def __init__(self, wire: _Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            self.wire.sent.append(x.clone())
        else:
            x.copy_(self.wire.sent.pop(0))  # a wrong size or dtype on the receiving side fails here
        return x


@pytest.mark.parametrize("tokens, broadcasts", [(3, 1), (2000, 2)])
def test_a_step_reaches_the_other_ranks_whole_in_one_broadcast_when_small(tokens, broadcasts):
    """A decode step's ids, metadata and model inputs ride in the header's broadcast; a 2,000-token prefill's (some
    140 KB with its hidden states) follow in a second. The other rank rebuilds every tensor and int bit for bit."""
    q_lens = [1, 1, 1] if tokens == 3 else [tokens]
    kv_lens = [5, 9, 17] if tokens == 3 else [tokens]
    pages = [[i * 8 + p for p in range(-(-kv // 4))] for i, kv in enumerate(kv_lens)]
    meta = build_page_metadata(pages, q_lens, kv_lens, 4, torch.device("cpu"))
    ids = torch.arange(sum(q_lens)) % 512
    rows = torch.tensor([sum(q_lens) - 1])
    hidden = torch.randn(sum(q_lens), 8)
    wire = _Wire()
    broadcast_step(wire.end(0), 7, ids, meta, rows, {"hidden_states": hidden, "aux_layers": (1, 2, 3)})
    assert len(wire.sent) == broadcasts
    runner_id, got_ids, got_meta, got_rows, inputs = receive_step(wire.end(1))
    assert not wire.sent and runner_id == 7
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows) and torch.equal(inputs["hidden_states"], hidden)
    assert inputs["aux_layers"] == (1, 2, 3)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "positions", "slot_mapping",
                 "cache_rows"):
        assert torch.equal(getattr(got_meta, name), getattr(meta, name)), name
        assert getattr(got_meta, name).dtype == getattr(meta, name).dtype, name
    assert (got_meta.page_size, got_meta.max_q_len, got_meta.max_kv_len) == (4, max(q_lens), max(kv_lens))
    stop_workers(wire.end(0))
    assert len(wire.sent) == 1 and receive_step(wire.end(1)) is None


def test_shapes_that_do_not_split_name_the_field_and_the_choices():
    stories_like = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=1,
                               num_attention_heads=8, num_key_value_heads=4)
    with torch.device("meta"):
        with pytest.raises(ShardingError, match=r"^vocab_size=512 does not split over tp=3 ranks: choose tp in \[1, 2, 4\]$"):
            LlamaForCausalLM(stories_like, TPGroup(rank=0, size=3))
        with pytest.raises(ShardingError, match=r"^intermediate_size=172 .* tp=8 ranks: choose tp in \[1, 2, 4\]$"):
            LlamaForCausalLM(stories_like, TPGroup(rank=0, size=8))
        six_heads = tiny_llama3_config(vocab_size=96, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
        with pytest.raises(ShardingError, match=r"^num_key_value_heads=3 .* tp=2 ranks: choose tp in \[1, 3, 6\]$"):
            LlamaForCausalLM(six_heads, TPGroup(rank=0, size=2))  # ranks may replicate them, 2 cannot split them
        with pytest.raises(ShardingError, match=r"num_attention_heads=4 .* tp=8 .*choose tp in \[1, 2, 4\]"):
            DeepseekV2ForCausalLM(tiny_deepseek_config(), TPGroup(rank=0, size=8))
        model = LlamaForCausalLM(tiny_llama3_config(num_attention_heads=8, num_key_value_heads=2), TPGroup(3, 4))
    assert model.attention_dims() == dict(num_heads=2, num_kv_heads=1, head_dim=16, mla_dims=None)  # KV replicated


def test_tp_needs_as_many_processes(monkeypatch, stories_hf_dir, head_dir, validate_prompts, tmp_path, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ShardingError, match=r"--tp 2 needs 2 processes: .*torchrun --nproc_per_node 2"):
        init_tp(2)
    with pytest.raises(ShardingError, match=r"^precompute.tp=2 needs a multiple of 2 processes: .* \(WORLD_SIZE is 1\)$"):
        init_tp(2, replicas=True, option="precompute.tp=2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for cli, argv in ((bench_main, bench_args(str(stories_hf_dir), str(head_dir))),
                      (validate_main, validate_args(str(stories_hf_dir), str(head_dir), str(tmp_path),
                                                    str(validate_prompts)))):
        assert run_cli(lambda: cli(["--tp", "2", *argv])) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "error: --tp 2 needs 2 processes: run it as `torchrun --nproc_per_node 2 ...` (WORLD_SIZE is 3)"]
