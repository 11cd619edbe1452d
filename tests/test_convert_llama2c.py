"""data_tools.convert_llama2c on the real stories260K files.

Weights and config are checked against an independent conversion (hf-reference/); the tokenizer against a
transcription of llama2.c's `encode()` written here from run.c, reading tok512.bin directly; the model
against its known greedy story.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data_tools import convert_llama2c as conv

ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"  # ../shared/assets from the repo root
LLAMA2C = ASSETS / "stories260K" / "llama2c"
REFERENCE = ASSETS / "stories260K" / "hf-reference"
CHECKPOINT, TOKENIZER = LLAMA2C / "stories260K.bin", LLAMA2C / "tok512.bin"

pytestmark = pytest.mark.skipif(not LLAMA2C.is_dir(), reason=f"shared assets not found at {ASSETS}")

EDGE_STRINGS = [
    "",
    " ",
    "   ",
    "a",
    "Once upon a time",
    "double  spaces  here",
    "  leading spaces",
    "trailing spaces  ",
    " the her there she he",
    "line one\nline two\n\n  indented\n",
    "tabs\tand\r\nCRLF",
    "naïve café, jalapeño, Ärger über Öl",
    "Привет, мир! Как дела?",
    "日本語のテキストと中文",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "™ – dashes — “quotes” ‘single’ … €5",
    "\u00a0non-breaking\u200ahair space",
    "literal <s> and </s> and <unk> and <0x41>",
    "x = [1, 2, 3]  # ~ | \\ ` ^ {}",
]


# ---------------------------------------------------------------------------------------------------------------
# llama2.c's encode(tokenizer, text, bos=1, eos=0), transcribed from run.c onto bytes as the C code sees them


def read_llama2c_tokenizer(path: Path, vocab_size: int = 512) -> tuple[list[bytes], list[float]]:
    """run.c build_tokenizer: int32 max_token_length, then per token f32 score, int32 length, bytes."""
    data, offset = path.read_bytes(), 4
    vocab, scores = [], []
    for _ in range(vocab_size):
        score, length = struct.unpack_from("<fi", data, offset)
        vocab.append(data[offset + 8 : offset + 8 + length])
        scores.append(score)
        offset += 8 + length
    return vocab, scores


def llama2c_encode(text: str, vocab: list[bytes], scores: list[float]) -> list[int]:
    """BOS, dummy-prefix " " (only for non-empty text), one token per UTF-8 code point or its bytes + 3,
    then repeatedly merge the leftmost adjacent pair whose concatenation has the highest score."""
    lookup = {piece: i for i, piece in enumerate(vocab)}
    raw = text.encode("utf-8")
    tokens = [1] + ([lookup[b" "]] if raw else [])
    start = 0
    for end in range(1, len(raw) + 1):
        if end < len(raw) and raw[end] & 0xC0 == 0x80 and end - start < 4:
            continue  # still inside one code point
        point = raw[start:end]
        tokens.extend([lookup[point]] if point in lookup else [byte + 3 for byte in point])
        start = end

    def pair_score(i: int) -> float:
        merged = lookup.get(vocab[tokens[i]] + vocab[tokens[i + 1]])
        return -math.inf if merged is None else scores[merged]

    pair_scores = [pair_score(i) for i in range(len(tokens) - 1)]
    while pair_scores and max(pair_scores) > -math.inf:
        best = pair_scores.index(max(pair_scores))  # leftmost of the best, as run.c's strict `>` scan
        tokens[best : best + 2] = [lookup[vocab[tokens[best]] + vocab[tokens[best + 1]]]]
        del pair_scores[best]
        for i in (best - 1, best):
            if 0 <= i < len(tokens) - 1:
                pair_scores[i] = pair_score(i)
    return tokens


# ---------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return conv.convert_llama2c(CHECKPOINT, TOKENIZER, tmp_path_factory.mktemp("convert") / "stories260K")


@pytest.fixture(scope="module")
def tokenizer(converted: Path):
    return AutoTokenizer.from_pretrained(converted)


@pytest.fixture(scope="module")
def llama2c_vocab() -> tuple[list[bytes], list[float]]:
    return read_llama2c_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """Every MT-Bench turn, 60 GSM8K questions and answers, and hand-made edge cases."""
    with (ASSETS / "eval" / "mt_bench_question.jsonl").open() as lines:
        texts = [turn for line in lines for turn in json.loads(line)["turns"]]
    with (ASSETS / "eval" / "gsm8k_test.jsonl").open() as lines:
        for line in itertools.islice(lines, 60):
            record = json.loads(line)
            texts += [record["question"], record["answer"]]
    return texts + EDGE_STRINGS


def write_llama2c_checkpoint(path: Path, header: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A random llama2.c v0 file with true RoPE tables; returns its arrays by llama2.c name."""
    shared = header[5] > 0
    cfg = conv.Llama2cConfig(*header[:5], abs(header[5]), header[6], shared)
    generator = torch.Generator().manual_seed(seed)
    arrays = {name: torch.randn(shape, generator=generator) for name, shape in cfg.tensor_shapes()}
    inv_freq = 10000.0 ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    arrays["freq_cis_real"], arrays["freq_cis_imag"] = angles.cos().float(), angles.sin().float()
    body = b"".join(arrays[name].numpy().tobytes() for name, _ in cfg.tensor_shapes())
    path.write_bytes(struct.pack("<7i", *header) + body)
    return arrays


# ---------------------------------------------------------------------------------------------------------------
# weights, config, generation


def test_weights_equal_the_reference_conversion(converted: Path) -> None:
    ours = load_file(converted / "model.safetensors")
    reference = load_file(REFERENCE / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


def test_config_matches_the_reference(converted: Path) -> None:
    ours = LlamaConfig.from_pretrained(converted).to_dict()
    reference = LlamaConfig.from_pretrained(REFERENCE).to_dict()
    assert ours == reference
    raw = json.loads((converted / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["tie_word_embeddings"] is True
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["max_position_embeddings"], raw["head_dim"]) == (1, 2, 512, 8)
    assert (raw["rope_theta"], raw["rms_norm_eps"], raw["torch_dtype"]) == (10000.0, 1e-5, "float32")


def test_generation_config_stops_on_bos(converted: Path) -> None:
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"], generation["do_sample"]) == (1, 1, False)


def test_greedy_story_from_bos(converted: Path, tokenizer) -> None:
    model = LlamaForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([[1]]), max_new_tokens=40)
    text = tokenizer.decode(ids[0], skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily."), text


def test_unshared_classifier_gets_an_untied_lm_head(tmp_path: Path) -> None:
    header = [16, 24, 2, 4, 2, -512, 8]  # negative vocab_size: wcls follows the RoPE tables
    arrays = write_llama2c_checkpoint(tmp_path / "unshared.bin", header)
    out = conv.convert_llama2c(tmp_path / "unshared.bin", TOKENIZER, tmp_path / "hf")
    state = load_file(out / "model.safetensors")
    assert torch.equal(state["lm_head.weight"], arrays["wcls"])
    assert torch.equal(state["model.embed_tokens.weight"], arrays["token_embedding"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, arrays["wcls"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_rotary_rows_move_from_interleaved_pairs_to_halves(tmp_path: Path) -> None:
    arrays = write_llama2c_checkpoint(tmp_path / "tiny.bin", [16, 24, 1, 4, 2, 512, 8])
    state = load_file(conv.convert_llama2c(tmp_path / "tiny.bin", TOKENIZER, tmp_path / "hf") / "model.safetensors")
    head_dim = 4
    for hf_name, name, n_heads in (("q_proj", "wq", 4), ("k_proj", "wk", 2)):
        ours, theirs = state[f"model.layers.0.self_attn.{hf_name}.weight"], arrays[name][0]
        for head, j in itertools.product(range(n_heads), range(head_dim // 2)):
            base = head * head_dim
            assert torch.equal(ours[base + j], theirs[base + 2 * j])  # x of pair j
            assert torch.equal(ours[base + head_dim // 2 + j], theirs[base + 2 * j + 1])  # y of pair j


def test_safetensors_metadata_names_the_source(converted: Path) -> None:
    with safe_open(converted / "model.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt" and "stories260K.bin" in metadata["source"]
    assert metadata["source_sha256"].startswith("b0a507e7ad0f")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer


def test_transcription_matches_known_llama2c_ids(llama2c_vocab) -> None:
    """Pins the reference encoder itself; ids checked against llama2.c's C encode() compiled from run.c."""
    assert llama2c_encode("", *llama2c_vocab) == [1]
    assert llama2c_encode("Hello world", *llama2c_vocab) == [1, 346, 306, 414, 263, 304, 341]
    two_spaces = [1, 410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419, 410]
    assert llama2c_encode("  two  spaces ", *llama2c_vocab) == two_spaces
    assert llama2c_encode("a\nb", *llama2c_vocab) == [1, 261, 13, 430]


def test_encodes_exactly_like_llama2c(tokenizer, llama2c_vocab, corpus: list[str]) -> None:
    assert len(corpus) > 250
    for text, ids in zip(corpus, tokenizer(corpus)["input_ids"]):
        assert ids == llama2c_encode(text, *llama2c_vocab), text


def test_encodes_every_short_string_over_the_multi_split_letters(tokenizer, llama2c_vocab) -> None:
    """' the', ' he', ' her', 'her' each have several splits and 'her' sits inside the better-scored ' her':
    the cases where a merge list could part from llama2.c's score-greedy choice. All strings up to 6 chars."""
    texts = ["".join(chars) for n in range(1, 7) for chars in itertools.product(" hert", repeat=n)]
    for text, ids in zip(texts, tokenizer(texts)["input_ids"]):
        assert ids == llama2c_encode(text, *llama2c_vocab), repr(text)


def test_encodes_random_piece_soup_like_llama2c(tokenizer, llama2c_vocab) -> None:
    vocab, _ = llama2c_vocab
    pieces = [piece.decode() for piece in vocab[259:]] + ["\n", "😀", "ß"]
    rng = random.Random(0)
    texts = ["".join(rng.choices(pieces, k=rng.randint(1, 12))) for _ in range(2000)]
    for text, ids in zip(texts, tokenizer(texts)["input_ids"]):
        assert ids == llama2c_encode(text, *llama2c_vocab), repr(text)


def test_decode_round_trips(tokenizer, corpus: list[str]) -> None:
    for text in corpus:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_tokenizer_files(converted: Path, tokenizer) -> None:
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["add_bos_token"] is True
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)
    assert tokenizer.convert_ids_to_tokens([259, 13, 100]) == ["\u2581t", "<0x0A>", "<0x61>"]


# ---------------------------------------------------------------------------------------------------------------
# command line


def run_main(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str]:
    code = conv.main([str(arg) for arg in argv])
    return code, capsys.readouterr().err


def test_cli_writes_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_main(capsys, "--checkpoint", CHECKPOINT, "--tokenizer", TOKENIZER, "--out", tmp_path / "hf")
    assert (code, err) == (0, "")
    names = {path.name for path in (tmp_path / "hf").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]  # no staging dir left behind


def test_help_explains_every_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        conv.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--tokenizer", "--out", "--force"):
        assert flag in out


def truncated_copy(source: Path, size: int, path: Path) -> Path:
    path.write_bytes(source.read_bytes()[:size])
    return path


def versioned_checkpoint(path: Path) -> Path:
    path.write_bytes(struct.pack("<2i", 0x616B3432, 1) + bytes(256))  # llama2.c export.py version 1 header
    return path


def vocab_300_checkpoint(path: Path) -> Path:
    write_llama2c_checkpoint(path, [16, 24, 1, 4, 2, 300, 8])
    return path


def wrong_rope_checkpoint(path: Path) -> Path:
    data = bytearray(CHECKPOINT.read_bytes())
    data[-8:] = struct.pack("<2f", 0.5, 0.5)  # the end of freq_cis_imag (the classifier is shared)
    path.write_bytes(data)
    return path


def occupied_dir(path: Path) -> Path:
    path.mkdir()
    (path / "keep.txt").write_text("precious")
    return path


BAD_INPUTS = {  # case -> (flag, makes the bad value in a tmp dir, text the one-line error must contain)
    "missing checkpoint": ("--checkpoint", lambda tmp: tmp / "nope.bin", "nope.bin"),
    "missing tokenizer": ("--tokenizer", lambda tmp: tmp / "nope_tok.bin", "nope_tok.bin"),
    "truncated checkpoint": ("--checkpoint", lambda tmp: truncated_copy(CHECKPOINT, 5000, tmp / "cut.bin"), "cut.bin"),
    "safetensors as checkpoint": ("--checkpoint", lambda tmp: REFERENCE / "model.safetensors", "model.safetensors"),
    "versioned checkpoint": ("--checkpoint", lambda tmp: versioned_checkpoint(tmp / "v1.bin"), "v1.bin"),
    "vocab size mismatch": ("--checkpoint", lambda tmp: vocab_300_checkpoint(tmp / "v300.bin"), "vocab_size 300"),
    "truncated tokenizer": ("--tokenizer", lambda tmp: truncated_copy(TOKENIZER, 3000, tmp / "tok.bin"), "tok.bin"),
    "wrong rope tables": ("--checkpoint", lambda tmp: wrong_rope_checkpoint(tmp / "theta.bin"), "theta.bin"),
    "non-empty out": ("--out", lambda tmp: occupied_dir(tmp / "occupied"), "occupied"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_exit_2_with_one_line_naming_the_culprit(case: str, tmp_path: Path, capsys) -> None:
    flag, make_bad_value, needle = BAD_INPUTS[case]
    args = {"--checkpoint": CHECKPOINT, "--tokenizer": TOKENIZER, "--out": tmp_path / "out"}
    args[flag] = make_bad_value(tmp_path)
    code, err = run_main(capsys, *itertools.chain.from_iterable(args.items()))
    assert code == 2
    assert needle in err and flag in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging dir left


def test_force_replaces_a_non_empty_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _ = run_main(capsys, "--checkpoint", CHECKPOINT, "--tokenizer", TOKENIZER, "--out", out, "--force")
    assert code == 0 and not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]


def test_a_crash_mid_write_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args, **kwargs) -> None:
        raise RuntimeError("disk full")

    old = tmp_path / "hf"
    old.mkdir()
    (old / "keep.txt").write_text("old")
    monkeypatch.setattr(conv, "save_file", crash)
    with pytest.raises(RuntimeError):
        conv.convert_llama2c(CHECKPOINT, TOKENIZER, tmp_path / "new")
    with pytest.raises(RuntimeError):
        conv.convert_llama2c(CHECKPOINT, TOKENIZER, old, force=True)
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]
    assert [path.name for path in old.iterdir()] == ["keep.txt"]


def test_a_failed_swap_puts_the_old_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "hf"
    old.mkdir()
    (old / "keep.txt").write_text("old")
    real_rename = conv.os.rename

    def rename(src, dst) -> None:
        if Path(src).name.startswith(".hf.tmp-"):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(conv.os, "rename", rename)
    with pytest.raises(OSError):
        conv.convert_llama2c(CHECKPOINT, TOKENIZER, old, force=True)
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]
    assert [path.name for path in old.iterdir()] == ["keep.txt"]
