"""The OpenAI-compatible server against a live uvicorn server on 127.0.0.1 (a thread in this process),
driven by the real `openai` client, plus load-aware drafting.

The target is a tiny random Llama (hidden 32, 2 layers) with SmolLM2's real tokenizer (vocabulary
49,152), so chat templates and text work; everything runs in float32, where greedy output does not
depend on how requests were batched, so server output must equal offline `dcoco.LLM` output.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import OracleDrafter, random_prompts, tiny_model, tiny_target

from dcoco import LLM, SamplingParams
from dcoco.drafters.base import DraftInput, DraftOutput
from dcoco.drafters.ngram import NgramDrafter
from dcoco.engine import SpeculativeEngine
from dcoco.serve import LoadAwarePolicy
from dcoco.serve.app import create_app
from dcoco.serve.metrics import parse_prometheus
from dcoco.serve.server import ServerThread, build_engine
from dcoco.target import Target

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
CTX = 1024
CHATS = ["Write a haiku about rain.", "List three colors.", "What is 2 + 2?", "Say hello in French."]
TEXTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls split over 2 threads stall for a time slice each on a busy machine: use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from dcoco.models import default_model_dir

    d = tmp_path_factory.mktemp("tiny-tok")
    tiny_model(
        "llama",
        seed=1,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=CTX,
    ).save_pretrained(d)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(
        model=tiny_dir,
        dtype="float32",
        max_batch_size=8,
        speculative_config=NGRAM,
    )


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = build_engine(model=tiny_dir, dtype="float32", speculative_config=NGRAM, max_batch_size=8)
    with ServerThread(create_app(engine, "tiny", max_queue=64)) as srv:
        yield srv


def client(srv, cls=openai.OpenAI):
    return cls(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(srv) -> dict[str, float]:
    return parse_prometheus(httpx.get(srv.url + "/metrics").text)


def wait_idle(srv, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(srv.url + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"requests still in flight: {h}"
        time.sleep(0.05)


def ref(offline, prompts, chat: bool, max_tokens: int):
    return offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), chat=chat)


# -- OpenAI API -------------------------------------------------------------------------------------
def test_chat_and_completion_match_offline(server, offline):
    c = client(server)
    want = ref(offline, CHATS[:2], True, 20)
    for p, w in zip(CHATS[:2], want):
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=20, temperature=0
        )
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == w.text
        assert r.choices[0].finish_reason == w.finish_reason
        assert r.usage.prompt_tokens == len(w.prompt_token_ids)
        assert r.usage.completion_tokens == len(w.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    want = ref(offline, TEXTS[:2], False, 20)
    r = c.completions.create(model="tiny", prompt=TEXTS[:2], max_tokens=20, temperature=0)  # two prompts: two choices
    assert r.object == "text_completion"
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    ids = offline.target.encode(TEXTS[2], chat=False)  # token-id prompt
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref(offline, [ids], False, 12)[0].text
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_streaming_chat_and_completion(server, offline):
    c = client(server)
    w = ref(offline, [CHATS[2]], True, 24)[0]
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": CHATS[2]}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == w.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == w.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(w.token_ids)
    w = ref(offline, [TEXTS[3]], False, 24)[0]
    chunks = list(c.completions.create(model="tiny", prompt=TEXTS[3], max_tokens=24, temperature=0, stream=True))
    assert len(chunks) > 2  # really streamed, not one blob
    assert "".join(ch.choices[0].text for ch in chunks) == w.text
    assert chunks[-1].choices[0].finish_reason == w.finish_reason
    # raw SSE framing: data: {...} lines and a final data: [DONE]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": TEXTS[0], "max_tokens": 5, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    json.loads(events[0][6:])


def test_stop_strings_and_sampling(server, offline):
    c = client(server)
    full = ref(offline, [TEXTS[0]], False, 20)[0].text
    stop = full[5:8]
    cut = full[: full.find(stop)]
    r = c.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(
        c.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=20, temperature=0, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == cut  # the stop string never leaks into a stream
    # seeded sampling is reproducible; top_k rides as an extra field
    a = c.completions.create(
        model="tiny", prompt=TEXTS[1], max_tokens=10, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50}
    )
    b = c.completions.create(
        model="tiny", prompt=TEXTS[1], max_tokens=10, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50}
    )
    assert a.choices[0].text == b.choices[0].text


def test_16_concurrent_requests_equal_offline(server, offline):
    prompts = [CHATS[i % 4] + " " * (i // 4) + f"#{i}" for i in range(16)]
    want = ref(offline, prompts, True, 16)
    ac = client(server, openai.AsyncOpenAI)

    async def one(i: int) -> str:
        msgs = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            stream = await ac.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True
            )
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        r = await ac.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
        return r.choices[0].message.content

    async def all_of():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await ac.close()

    got = asyncio.run(all_of())
    assert got == [w.text for w in want]
    wait_idle(server)


# -- bad input --------------------------------------------------------------------------------------
def test_errors(server):

    def post(body, path="/v1/completions"):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return r.status_code, err

    assert post(b'{"model": "tiny", "prompt": ')[0] == 400  # malformed JSON
    status, err = post({"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    status, err = post({"model": "tiny", "prompt": "hi", "max_tokens": CTX})
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    status, err = post({"model": "tiny", "prompt": [5] * CTX, "max_tokens": 1})
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    long_chat = [{"role": "user", "content": "word " * (CTX + 10)}]
    status, err = post({"model": "tiny", "messages": long_chat}, "/v1/chat/completions")
    assert status == 400 and err["param"] == "messages"
    for bad, param in (
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 3}, "logprobs"),
    ):
        status, err = post({"model": "tiny", "prompt": "hi", **bad})
        assert (status, err["param"]) == (400, param), (bad, err)
    assert post({"model": "tiny", "prompt": [10**6]})[0] == 400  # token id outside the vocabulary
    assert post({"model": "tiny", "prompt": ""})[0] == 400
    assert post({"model": "tiny"})[0] == 400  # no prompt
    assert post({"model": "tiny", "messages": []}, "/v1/chat/completions")[0] == 400
    assert post({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions")[0] == 400
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=CTX + 5)
    assert (
        c.completions.create(model="tiny", prompt="still fine", max_tokens=2, temperature=0).usage.completion_tokens
        >= 1
    )
    wait_idle(server)


# -- slots, metrics -----------------------------------------------------------------------------------
def test_client_disconnect_frees_slot(server):
    before = metrics(server)
    body = {
        "model": "tiny",
        "prompt": "Count forever:",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(g.startswith("data: {") for g in got)
        assert httpx.get(server.url + "/health").json()["running"] == 1
    # the connection is closed mid-stream: the request is aborted and its slot freed
    wait_idle(server)
    after = metrics(server)
    abort = 'dcoco:request_success_total{finished_reason="abort"}'
    assert after[abort] == before[abort] + 1
    gen = "dcoco:generation_tokens_total"
    assert after[gen] - before[gen] < 900  # it stopped early
    # non-streaming: the client gives up (timeout) and the server cancels the request
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), timeout=0.3)
    wait_idle(server)
    assert metrics(server)[abort] == before[abort] + 2


def test_metrics_consistent_with_responses(server):
    wait_idle(server)
    before = metrics(server)
    c = client(server)
    usages = []
    for i, p in enumerate(TEXTS):
        usages.append(c.completions.create(model="tiny", prompt=p * 3, max_tokens=24 + i, temperature=0).usage)
    for p in CHATS[:2]:
        chunks = list(
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usages.append(chunks[-1].usage)
    after = metrics(server)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["dcoco:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert d["dcoco:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    done = sum(v for k, v in d.items() if k.startswith("dcoco:request_success_total"))
    assert (
        done
        == len(usages)
        == d["dcoco:e2e_request_latency_seconds_count"]
        == d["dcoco:time_to_first_token_seconds_count"]
    )
    acc, drafted = d["dcoco:spec_decode_num_accepted_tokens_total"], d["dcoco:spec_decode_num_draft_tokens_total"]
    assert 0 <= acc <= drafted and 0 < d["dcoco:spec_decode_num_drafts_total"] <= drafted
    per_pos = [v for k, v in d.items() if k.startswith("dcoco:spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(per_pos) == acc
    assert 'dcoco:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in after or acc == 0
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "dcoco:spec_decode_num_drafts",
        "dcoco:spec_decode_num_draft_tokens",
        "dcoco:spec_decode_num_accepted_tokens",
        "dcoco:time_to_first_token_seconds",
        "dcoco:e2e_request_latency_seconds",
        "dcoco:num_requests_running",
    ):
        assert f"# TYPE {name} " in text


def test_queue_full_gives_503(tiny_dir):
    engine = build_engine(model=tiny_dir, dtype="float32", speculative_config=NGRAM, max_batch_size=1)
    with ServerThread(create_app(engine, "tiny", max_queue=1)) as srv:
        long = {"model": "tiny", "prompt": "a", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        box = {}
        t1 = threading.Thread(
            target=lambda: box.setdefault("a", httpx.post(srv.url + "/v1/completions", json=long, timeout=60))
        )
        t1.start()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").json()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t2 = threading.Thread(
            target=lambda: box.setdefault(
                "b", httpx.post(srv.url + "/v1/completions", json=dict(long, max_tokens=3), timeout=60)
            )
        )
        t2.start()
        while httpx.get(srv.url + "/health").json()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(srv.url + "/v1/completions", json=dict(long, max_tokens=3))
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        t1.join()
        t2.join()
        assert box["a"].status_code == 200 and box["b"].status_code == 200


def test_tokens_in_flight_bound(tiny_dir):
    engine = build_engine(model=tiny_dir, dtype="float32", speculative_config=NGRAM, max_batch_size=8)
    with ServerThread(create_app(engine, "tiny", max_tokens_in_flight=300)) as srv:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        res = []
        threads = [
            threading.Thread(target=lambda: res.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=60)))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        most, queued = 0, 0
        while any(t.is_alive() for t in threads):
            load = httpx.get(srv.url + "/health").json()
            most, queued = max(most, load["running"]), max(queued, load["waiting"])
            time.sleep(0.02)
        assert [r.status_code for r in res] == [200] * 3
        # 3 x (1 + 120 + K + 1) tokens do not fit in 300, 2 do: two run and one waits
        assert most == 2 and queued >= 1, (most, queued)


class PoisonDrafter(NgramDrafter):
    """Crashes the batched step once a request whose prompt starts with POISON has run a few passes."""

    POISON = [777, 777, 777]

    def propose(self, inp: DraftInput) -> DraftOutput:
        for ids in inp.token_ids:
            if ids[:3] == self.POISON and len(ids) > 8:
                raise RuntimeError("drafter exploded")
        return super().propose(inp)


def test_one_failing_request_does_not_affect_others(tiny_dir, offline):
    target = Target.from_pretrained(tiny_dir, dtype="float32")
    engine = SpeculativeEngine(target, PoisonDrafter(), K, max_batch_size=8)
    good = [offline.target.encode(t, chat=False) for t in TEXTS]
    want = ref(offline, good, False, 16)
    with ServerThread(create_app(engine, "tiny")) as srv:
        ac = client(srv, openai.AsyncOpenAI)

        async def run():
            async def one(prompt):
                try:
                    r = await ac.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
                    return r.choices[0].text
                except openai.APIStatusError as e:
                    return e

            try:
                return await asyncio.gather(*(one(p) for p in [PoisonDrafter.POISON + [5, 6]] + good))
            finally:
                await ac.close()

        res = asyncio.run(run())
        assert isinstance(res[0], openai.InternalServerError) and "drafter exploded" in res[0].message
        assert res[1:] == [w.text for w in want]
        m = metrics(srv)
        assert m['dcoco:request_success_total{finished_reason="error"}'] == 1
        assert wait_idle(srv)["status"] == "ok"  # and the server keeps serving
        assert (
            client(srv).completions.create(model="tiny", prompt=good[0], max_tokens=16, temperature=0).choices[0].text
            == want[0].text
        )


def test_shutdown_drains_in_flight_requests(tiny_dir):
    engine = build_engine(model=tiny_dir, dtype="float32", speculative_config=NGRAM)
    srv = ServerThread(create_app(engine, "tiny")).start()
    body = {
        "model": "tiny",
        "prompt": "Drain me",
        "max_tokens": 150,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stopper = None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if stopper is None:  # first chunk arrived: ask the server to shut down
                stopper = threading.Thread(target=srv.stop)
                stopper.start()
    stopper.join(30)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 150
    assert not srv.thread.is_alive()
    assert not engine.has_unfinished


# -- load-aware drafting --------------------------------------------------------------------------------
def test_load_aware_policy_table():
    p = LoadAwarePolicy(token_budget=32)
    assert p.table(5, (1, 4, 6, 8, 16, 17, 32)) == [(1, 5), (4, 5), (6, 4), (8, 3), (16, 1), (17, 0), (32, 0)]
    assert LoadAwarePolicy(32, min_k=1)(64, 5) == 1 and p(1, 3) == 3
    with pytest.raises(ValueError):
        LoadAwarePolicy(0)


class TapCountingDrafter(OracleDrafter):
    """An oracle drafter that taps a layer and checks it has seen the features of every cached token."""

    tap_layers = (1,)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[int, int] = {}

    def propose(self, inp: DraftInput) -> DraftOutput:
        for rid, ids, f in zip(inp.request_ids, inp.token_ids, inp.new_features):
            self.seen[rid] = self.seen.get(rid, 0) + (0 if f is None else f.shape[0])
            assert self.seen[rid] == len(ids) - 1  # everything but the anchor is in the target's cache
        return super().propose(inp)


def test_load_aware_drafting_is_lossless():
    target = tiny_target("llama", seed=4)
    prompts = random_prompts(6, target.vocab_size, lengths=(3, 20, 9, 14, 6, 11), seed=2)
    sp = [SamplingParams(max_tokens=12 + 5 * i) for i in range(6)]  # requests leave one by one: k changes
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, vanilla)}
    ks = []

    def policy(b, k):
        ks.append(LoadAwarePolicy(token_budget=10)(b, k))  # batch 6: k = 0, ..., batch 1: k = 5
        return ks[-1]

    drafter = TapCountingDrafter(refs, target.vocab_size, error_rate=0.3)
    outs, stats = SpeculativeEngine(target, drafter, 5, draft_policy=policy).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    assert 0 in ks and max(ks) >= 3  # plain decoding at full load, long blocks once the batch thins out
    assert stats.acceptance_length > 1.0
    # sampling under the policy: each request's own RNG keeps it reproducible
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=10) for i in range(6)]
    a, _ = SpeculativeEngine(target, OracleDrafter(refs, target.vocab_size), 5, draft_policy=policy).generate(
        prompts, sps
    )
    b, _ = SpeculativeEngine(target, OracleDrafter(refs, target.vocab_size), 5, draft_policy=policy).generate(
        prompts, sps
    )
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


# -- CLI and load generator ------------------------------------------------------------------------------
def test_cli_serve_arguments(capsys):
    from dcoco.cli import build_parser, main

    args = build_parser().parse_args(
        [
            "serve",
            "--method",
            "ngram",
            "--port",
            "8123",
            "--load-aware",
            "--max-batch-size",
            "4",
            "--max-queue",
            "9",
            "--num-speculative-tokens",
            "3",
            "--dtype",
            "float32",
        ]
    )
    assert (args.command, args.port, args.load_aware, args.max_batch_size, args.max_queue) == (
        "serve",
        8123,
        True,
        4,
        9,
    )
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be 0-65535" in capsys.readouterr().err


def test_loadgen_smoke(server, tiny_dir, tmp_path):
    from dcoco.serve import loadgen

    out = tmp_path / "lg"
    rc = loadgen.main(
        [
            "--url",
            server.url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "3",
            "--max-tokens",
            "6",
            "--out",
            str(out),
            "--offline",
            "--model",
            tiny_dir,
            "--dtype",
            "float32",
            "--num-speculative-tokens",
            str(K),
            "--offline-variants",
            "fixed,load-aware",
            "--label",
            "test",
        ]
    )
    assert rc == 0
    res = json.loads((out / "loadgen.json").read_text())
    modes = {(r["mode"], r["concurrency"]) for r in res["rows"]}
    assert modes == {(m, c) for m in ("server", "offline-fixed", "offline-load-aware") for c in (1, 2)}
    assert all(r["errors"] == 0 and r["output_tokens"] > 0 for r in res["rows"])
    assert (out / "loadgen.png").stat().st_size > 1000
    assert "| server | 2 |" in (out / "loadgen.md").read_text()
    # a second (offline vanilla) run, then both combined into one sweep table and plot
    van = tmp_path / "van"
    assert (
        loadgen.main(
            [
                "--concurrency",
                "1,2",
                "--num-requests",
                "3",
                "--max-tokens",
                "6",
                "--out",
                str(van),
                "--offline",
                "--model",
                tiny_dir,
                "--dtype",
                "float32",
                "--offline-variants",
                "vanilla",
            ]
        )
        == 0
    )
    assert loadgen.main(["--compare", f"{out},{van}", "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "sweep.md").read_text()
    assert "| test (HTTP) |" in md and "| test (offline-load-aware) |" in md and "| vanilla (offline engine) |" in md
    row = next(l for l in md.splitlines() if l.startswith("| test (HTTP) |"))
    assert row.count("x") == 2  # a ratio to offline vanilla at C=1 and C=2
    assert (tmp_path / "cmp" / "sweep.png").stat().st_size > 1000
