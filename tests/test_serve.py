"""infer.serve on stories260K through the real `openai` client: greedy completions equal infer.generate's (plain and
with a fitted MTP head), streamed text equals the whole text, 64 concurrent streams and a client that leaves give
every KV page back, bad requests get a 400 naming their field, /metrics parses, and a request the engine fails on
fails alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer.engine import Engine
from infer.generate import main as generate_main
from infer.models.mtp_head import save_head
from infer.prompts import VALIDATION_PROMPTS
from infer.sampling_params import SamplingParams
from infer.serve.server import build_parser, build_served, serving
from tests.fitted_head import fit_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "stories260K"
PROMPTS = VALIDATION_PROMPTS[:4]
RECOMMENDED_K = {"1": 3, "2": 2, "8": 0}  # batch sizes 8 and up decode plainly


@pytest.fixture(scope="module")
def head_dir(stories_hf_dir, tmp_path_factory):
    engine = Engine.from_pretrained(stories_hf_dir)
    head = fit_head(engine, steps=20)
    head.config.recommended_k = dict(RECOMMENDED_K)
    return save_head(head, tmp_path_factory.mktemp("serve") / "head")


def start(stack: contextlib.ExitStack, hf_dir, *flags: str):
    args = build_parser().parse_args(["--model", str(hf_dir), "--served-model-name", MODEL, "--device", "cpu",
                                      "--num-pages", "1024", *flags])
    served = build_served(args)
    url = stack.enter_context(serving(served))
    return served, url


@pytest.fixture(scope="module")
def servers(stories_hf_dir, head_dir):
    """{"plain": (served, url), "mtp": (served, url)}: two servers, in this process, on free loopback ports."""
    with contextlib.ExitStack() as stack:
        yield {"plain": start(stack, stories_hf_dir),
               "mtp": start(stack, stories_hf_dir, "--spec", "mtp", "--draft", str(head_dir))}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def all_pages_free(served, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    pool = served.engine.pool
    while pool.num_free != pool.num_pages and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool.num_free == pool.num_pages and not served.engine.has_unfinished()


def generate_json(capsys, hf_dir, *flags: str) -> list[dict]:
    argv = ["--model", str(hf_dir), "--device", "cpu", "--max-new-tokens", "24", "--json", *flags]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    capsys.readouterr()
    assert generate_main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("kind", ["plain", "mtp"])
def test_greedy_completions_equal_infer_generate_token_for_token(servers, kind, capsys, stories_hf_dir, head_dir,
                                                                 stories_tokenizer):
    served, url = servers[kind]
    flags = ("--spec", "mtp", "--draft", str(head_dir)) if kind == "mtp" else ()
    expected = generate_json(capsys, stories_hf_dir, *flags)
    spec_steps = served.engine.spec_stats.verify_steps if kind == "mtp" else 0
    got = [client(url).completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in PROMPTS]
    assert [c.choices[0].text for c in got] == [e["text"] for e in expected]
    assert [stories_tokenizer.encode(p + c.choices[0].text)[len(stories_tokenizer.encode(p)):]
            for p, c in zip(PROMPTS, got)] == [e["token_ids"] for e in expected]
    assert [c.usage.completion_tokens for c in got] == [e["num_new_tokens"] for e in expected]
    assert len(set(e["text"] for e in expected)) == len(PROMPTS)  # control: the prompts do not all read alike
    if kind == "mtp":  # requests one at a time: batch 1, K 3 from the head's recommended_k
        assert served.engine.spec_stats.verify_steps > spec_steps
        assert expected[0]["spec"]["verify_steps"] > 0
    assert all_pages_free(served)


def test_streamed_text_equals_the_whole_text(servers):
    served, url = servers["plain"]
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0.9, seed=5, n=2, stop=[" and"])
    whole = client(url).completions.create(**kwargs)
    chunks = list(client(url).completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # control: seeds seed + i give each choice its own tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(len(c.choices) for c in chunks[:-1]) > 4  # it did stream, in several chunks
    _, spec_url = servers["mtp"]  # a verify step's several tokens come in one chunk
    for prompt in PROMPTS[:3]:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        streamed = "".join(c.choices[0].text for c in client(spec_url).completions.create(stream=True, **kwargs))
        assert streamed == client(spec_url).completions.create(**kwargs).choices[0].text


def test_64_concurrent_streams_all_complete_and_free_every_page(servers, stories_model, stories_tokenizer):
    """On the MTP server, whose K changes with the batch (3 at 1, 2 at 2-7, plain from 8): the texts are the
    plain engine's greedy ones."""
    served, url = servers["mtp"]
    expected = [r.text for r in Engine(stories_model, stories_tokenizer, [2]).generate(
        VALIDATION_PROMPTS[:32], SamplingParams(max_new_tokens=16))]
    busiest = []

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            busiest.append(served.engine.pool.num_pages - served.engine.pool.num_free)
            await asyncio.sleep(0.005)

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(model=MODEL, prompt=VALIDATION_PROMPTS[i % 32], max_tokens=16,
                                                  temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100))) as ac:
            results = await asyncio.gather(*(one(ac, i) for i in range(64)))
        done.set()
        await watcher
        return results

    results = asyncio.run(run())
    assert all(reason in ("stop", "length") and text for text, reason in results)
    assert [text for text, _ in results] == [expected[i % 32] for i in range(64)]
    assert max(busiest) > 0  # control: the requests held pages while they ran
    assert all_pages_free(served)


def test_a_client_that_disconnects_mid_stream_frees_its_pages(servers):
    served, url = servers["plain"]
    aborted = served.loop.stats.finished.get("abort", 0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        held = served.engine.pool.num_pages - served.engine.pool.num_free
    assert held > 0  # control: it was running when the client left
    assert all_pages_free(served)
    assert served.loop.stats.finished.get("abort", 0) == aborted + 1


BAD_REQUESTS = [
    ({"model": "gpt-4", "prompt": "Hi"}, "model"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": [1] * 600}, "prompt"),  # the context is 512
    ({"model": MODEL, "prompt": "Hi", "logprobs": 2}, "logprobs"),
    ({"model": MODEL, "prompt": "Hi", "frobnicate": True}, "frobnicate"),
    ({"model": MODEL, "prompt": "Hi", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": [1, 99999]}, "prompt"),
]


def test_bad_requests_get_a_400_naming_the_field_and_the_server_keeps_serving(servers):
    served, url = servers["plain"]
    with httpx.Client(timeout=30) as http:
        for body, field in BAD_REQUESTS:
            response = http.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == field, (body, response.json())
        response = http.post(f"{url}/v1/completions", content=b'{"model": "x", "prompt": ',
                             headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "body"
        assert "malformed JSON" in response.json()["error"]["message"]
        chat = http.post(f"{url}/v1/chat/completions",
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert "chat template" in chat.json()["error"]["message"]
        good = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2  # control
        assert http.get(f"{url}/health").status_code == 200
        assert http.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL


def test_chat_uses_the_models_chat_template(servers, stories_tokenizer):
    served, url = servers["plain"]
    served.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        chat = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                                   max_tokens=12, temperature=0)
    finally:
        served.tokenizer.chat_template = None
    ids = stories_tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    text = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text
    assert chat.choices[0].message.content == text and text


def test_a_full_queue_answers_429_with_retry_after(servers):
    served, url = servers["plain"]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    served.loop.max_waiting = 0
    try:
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    finally:
        served.loop.max_waiting = 256
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200  # control


def test_metrics_parse_and_show_speculation(servers):
    served, url = servers["mtp"]
    client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    value = {name: f.samples[0].value for name, f in families.items() if f.samples}
    assert value["infer_kv_pages_total"] == 1024 and value["infer_kv_pages_used"] == 0
    assert value["infer_num_requests_running"] == 0 and value["infer_generation_tokens"] >= 16
    assert value["infer_spec_tau"] > 1.0 and value["infer_spec_num_draft_tokens"] == 3
    positions = [s.labels["position"] for s in families["infer_spec_conditional_acceptance"].samples]
    assert positions == ["1", "2", "3"]
    plain = {f.name for f in text_string_to_metric_families(httpx.get(f"{servers['plain'][1]}/metrics").text)}
    assert "infer_spec_tau" not in plain and "infer_kv_pages_used" in plain  # control


def test_per_batch_k_decodes_large_batches_plainly(stories_model, stories_tokenizer, head_dir):
    """The head's recommended K per batch size: 0 at batch 8 decodes plainly, K at batch 1 speculates."""
    from infer.models.mtp_head import load_head, read_head_config  # noqa: PLC0415

    engine = Engine(stories_model, stories_tokenizer, [2])
    engine.num_draft_tokens = 3
    engine.attach_drafter("mtp", load_head(head_dir, stories_model))
    engine.draft_k_for_batch = read_head_config(head_dir).num_draft_tokens_for
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.generate(VALIDATION_PROMPTS[:8], params)
    assert engine.spec_stats.verify_steps == 0 and engine.spec_stats.plain_decodes > 0
    engine.generate(VALIDATION_PROMPTS[:1], params)
    assert engine.spec_stats.verify_steps > 0  # control


def test_a_request_the_engine_fails_on_fails_alone(servers):
    served, url = servers["plain"]
    poison = served.tokenizer.encode(PROMPTS[3])
    output = served.engine.output
    original = output.append
    raised = []

    def append(request, token, settle=False):
        if request.prompt_ids == poison and len(request.output_ids) == 3:
            raised.append(request.request_id)
            raise RuntimeError("injected failure")
        return original(request, token, settle)

    alone = [client(url).completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in PROMPTS[:3]]
    output.append = append
    try:
        async def run():
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as ac:
                return await asyncio.gather(
                    *(ac.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS),
                    return_exceptions=True)

        results = asyncio.run(run())
    finally:
        del output.append
    assert isinstance(results[3], openai.InternalServerError) and "injected failure" in str(results[3])
    assert [r.choices[0].text for r in results[:3]] == alone
    assert len(raised) >= 2  # in the batch, then again alone
    assert all_pages_free(served)
    assert client(url).completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4).choices  # still serving


def test_bench_serve_summary_shares_a_chunks_gap_among_its_tokens():
    """A verify step's 3 tokens in one chunk 30 ms after the first: 3 inter-token latencies of 10 ms (the chunk gap
    itself is 30 ms); tpot spreads the rest of the request over its tokens after the first."""
    from infer.bench_serve import summarize  # noqa: PLC0415

    spec = {"sent": 0.0, "ttft": 0.1, "end": 0.13, "tokens": 4, "arrivals": [(0.1, 1), (0.13, 4)]}
    plain = {"sent": 0.0, "ttft": 0.1, "end": 0.16, "tokens": 4, "arrivals": [(0.1, 1), (0.12, 2), (0.14, 3),
                                                                            (0.16, 4)]}
    s = summarize([spec, {"error": "HTTP 400"}])
    assert s["itl_ms"]["median"] == pytest.approx(10.0) and s["itl_chunk_ms"]["median"] == pytest.approx(30.0)
    assert s["tpot_ms"]["median"] == pytest.approx(10.0) and s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["completed"] == 1 and s["errors"] == ["HTTP 400"]
    assert s["tokens_per_s"] == pytest.approx(4 / 0.13, abs=0.01)
    assert summarize([plain])["itl_ms"]["median"] == pytest.approx(20.0)  # control: one token a chunk
