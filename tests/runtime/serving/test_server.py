"""The OpenAI-compatible server on a free loopback port: the official `openai` client and raw
HTTP, streaming and not; 32 concurrent streaming clients, some leaving mid-stream; bad requests
answered with a 400 while the others go on; a bound on requests answered with a 503."""

import asyncio
import functools
import json
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from hf_models import save_text_checkpoint  # noqa: E402
from mambastep.runtime.engine import Engine  # noqa: E402
from mambastep.runtime.serving.openai_api import create_app  # noqa: E402
from mambastep.runtime.request import SamplingParams  # noqa: E402
from mambastep.runtime.serving.loop import EngineLoop, EngineProcess  # noqa: E402
from mambastep.runtime.serving.text import TextEngine  # noqa: E402
from mambastep.runtime.serving.tokenizer import Tokenizer  # noqa: E402

NAME = "tiny"
SLOTS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve")
    save_text_checkpoint(path)
    return path


def text_engine(path, max_context=96):
    engine = Engine.from_pretrained(path, dtype=torch.float32, device="cpu", num_slots=SLOTS, max_context=max_context)
    return TextEngine(engine, Tokenizer.from_pretrained(path))


def engine_loop(kind, path, max_requests=None, max_context=96):
    """The engine in a thread of this process, or in a process of its own."""
    if kind == "thread":
        return EngineLoop(text_engine(path, max_context), max_requests=max_requests)
    build = functools.partial(TextEngine.load, str(path), dtype=torch.float32, device="cpu", num_slots=SLOTS,
                              max_context=max_context)
    return EngineProcess(build, max_requests=max_requests)


class Server:
    """uvicorn in a thread on a free port, over an engine loop of either kind."""

    def __init__(self, path, max_requests=None, max_context=96, kind="thread", listening=None, names=NAME):
        self.loop = engine_loop(kind, path, max_requests, max_context)
        config = uvicorn.Config(create_app(self.loop, names, listening=listening), host="127.0.0.1", port=0,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def idle(self, timeout=20.0) -> bool:
        """Wait until no request is open and every slot is free again."""
        end = time.time() + timeout
        while time.time() < end:
            if not self.loop.open_requests() and self.loop.free_slots() == SLOTS:
                return True
            time.sleep(0.02)
        return False

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(checkpoint, request):
    s = Server(checkpoint, kind=request.param)
    yield s
    s.stop()


def alone(path, prompt, max_tokens, stop=()):
    """The text the request gets alone on a fresh engine, greedy."""
    text = text_engine(path)
    return text.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), stop)[0]


def test_openai_client_completions_and_chat(server, checkpoint):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.completions.create(model=NAME, prompt="the cat", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == alone(checkpoint, "the cat", 12)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0 and r.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="the cat", max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(pieces) == r.choices[0].text
    messages = [{"role": "user", "content": "héllo 数据"}]
    c = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == alone(checkpoint, messages, 8)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    assert server.idle()


def test_a_stop_string_cuts_the_stream_and_frees_the_slot(server, checkpoint):
    """Text is the server side's work (in the process placement the engine only steps ids): a stop
    string ends the request there, and the engine lets its slot go."""
    whole = alone(checkpoint, "the cat", 16)
    stop = whole[len(whole) // 2 :][:2]  # text from the middle, sure to appear
    want = alone(checkpoint, "the cat", 16, stop=[stop])
    assert want == whole[: whole.find(stop)]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"prompt": "the cat", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        r = http.post("/v1/completions", json=body)
        assert r.json()["choices"][0]["text"] == want and r.json()["choices"][0]["finish_reason"] == "stop"
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            pieces = [json.loads(line[6:])["choices"][0] for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["text"] for c in pieces) == want and pieces[-1]["finish_reason"] == "stop"
        assert server.idle()
        steps = server.loop.steps  # the engine stops stepping it: far fewer steps than max_tokens
        r = http.post("/v1/completions", json={**body, "max_tokens": 80})
        assert r.json()["choices"][0]["text"] == want
    assert server.idle() and server.loop.steps - steps < 40


def test_raw_http_and_bad_requests(server, checkpoint):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").json()["status"] == "ok"
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                             "total_tokens": 7}
        r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
        bad = [
            (b"{ not json", "not valid JSON"),
            (json.dumps({"prompt": "x " * 200, "max_tokens": 4}), "leave no room to generate"),
            (json.dumps({"prompt": "x", "temperature": -1}), "temperature"),
            (json.dumps({"prompt": "x", "top_p": 0}), "top_p"),
            (json.dumps({"prompt": [1, 99999]}), "vocabulary"),
            (json.dumps({"prompt": {"a": 1}}), "prompt"),
            (json.dumps({"prompt": "x", "n": 0}), "n:"),
            (json.dumps({"prompt": "x", "stop": [""]}), "stop"),
        ]
        for body, match in bad:
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert match in r.json()["error"]["message"] and r.json()["error"]["type"]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert server.idle()


def test_concurrent_streams_with_disconnects(server, checkpoint):
    """32 clients at once over 6 slots; every third leaves after its first chunks. Survivors get
    their whole text, nothing is left holding a slot."""
    prompts = [f"the cat {i}" for i in range(32)]

    async def client(i, http):
        body = {"prompt": prompts[i], "max_tokens": 10, "temperature": 0, "stream": True, "ignore_eos": True}
        text = []
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if i % 3 == 0 and len(text) >= 2:
                    return None  # leave mid-stream
        return "".join(text)

    async def bad(http, body):
        r = await http.post("/v1/completions", json=body)
        return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            bad_requests = [bad(http, b) for b in ({"prompt": "x", "top_p": 2}, {"model": "other", "prompt": "x"},
                                                   {"prompt": [1, 10**6]}, {"prompt": "x " * 200})]
            return await asyncio.gather(*(client(i, http) for i in range(32)), *bad_requests)

    *got, = asyncio.run(main())
    got, statuses = got[:32], got[32:]
    assert statuses == [400, 404, 400, 400]
    for i, text in enumerate(got):
        if i % 3:
            assert text == alone(checkpoint, prompts[i], 10), i
    assert server.idle()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_past_the_bound_a_503(checkpoint, kind):
    s = Server(checkpoint, max_requests=1, max_context=8192, kind=kind)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as http:
            # thousands of steps: in flight for seconds, and the stream is left when the check is done
            body = {"prompt": "the cat", "max_tokens": 8000, "temperature": 0, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.iter_lines()  # kept: a dropped iterator closes the response
                next(lines)  # the first request is in flight
                r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
        assert s.idle()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200  # the bound counts only requests in flight
    finally:
        s.stop()


def test_bench_serve_measures_a_running_server(server, tmp_path, capsys):
    from mambastep.tools import cli

    out = tmp_path / "serve.json"
    assert cli.main(["bench", "serve", "--url", server.url, "--requests", "6", "--concurrency", "3", "--vocab", "256",
                     "--max-context", "64", "--quiet", "--json", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert stats["requests"] == 6 and stats["output_tokens_per_s"] > 0 and stats["itl_ms"]["p50"] > 0
    assert "inter-token latency" in capsys.readouterr().out
    assert server.idle()
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--url", "http://127.0.0.1:9", "--quiet"])
    assert "no server answers" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_closing_the_loop_ends_every_stream(checkpoint, kind):
    """Shutdown aborts what is in flight: each open stream ends with finish_reason "error" (no
    failure: the server chose it), and the HTTP side then answers 503s."""
    loop = engine_loop(kind, checkpoint, max_context=8192)

    async def main():
        greedy = SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True)
        streams = [await loop.submit("the cat", greedy) for _ in range(3)]
        await streams[0].next()
        loop.close()
        ends = []
        for st in streams:
            out = await st.next()
            while not out.finished:
                out = await st.next()
            ends.append(out.finish_reason)
        return ends

    assert asyncio.run(main()) == ["error"] * 3
    assert loop.closed and not loop.open_requests() and loop.failure is None
    if kind == "thread":
        assert not loop.text.engine.requests
    app = create_app(loop, NAME)  # a stopped loop: 503s, not tracebacks
    transport = httpx.ASGITransport(app=app)

    async def ask():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            return (await http.get("/health")).status_code, (await http.post("/v1/completions", json={"prompt": "x"}))

    health, r = asyncio.run(ask())
    assert health == 503 and r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(loop.submit("x", SamplingParams()))


def test_health_says_starting_until_every_api_process_listens(checkpoint):
    """With several HTTP server processes, a client that waits for /health must find them all
    taking connections: until the shared count reaches the loop's api_processes, 503 "starting"."""
    loop = EngineLoop(text_engine(checkpoint), max_requests=None)
    loop.api_processes = 2
    count = [1]
    transport = httpx.ASGITransport(app=create_app(loop, NAME, listening=lambda: count[0]))

    async def health():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            return await http.get("/health")

    try:
        r = asyncio.run(health())
        assert r.status_code == 503 and r.json() == {"status": "starting", "api_processes": 2, "listening": 1}
        count[0] = 2
        r = asyncio.run(health())
        assert r.status_code == 200 and r.json()["api_processes"] == 2
    finally:
        loop.close()


def test_bench_serve_against_a_starting_server_says_so(checkpoint, capsys):
    from mambastep.tools import cli

    s = Server(checkpoint, listening=lambda: 1)
    s.loop.api_processes = 2  # as if one of two API processes listened yet
    try:
        with pytest.raises(SystemExit):
            cli.main(["bench", "serve", "--url", s.url, "--quiet"])
        assert "the server is starting (1 of its 2 API processes listen)" in capsys.readouterr().err
    finally:
        s.stop()


def test_bench_serve_spreads_its_streams_over_client_processes(server, tmp_path):
    from mambastep.tools import cli

    out = tmp_path / "serve.json"
    t0 = time.perf_counter()
    assert cli.main(["bench", "serve", "--url", server.url, "--requests", "5", "--concurrency", "3", "--processes", "2",
                     "--vocab", "256", "--max-context", "64", "--quiet", "--json", str(out)]) == 0
    took = time.perf_counter() - t0
    stats = json.loads(out.read_text())
    # the clock spans the clients' requests, not their processes' start-up: every request lies
    # within it, and it is shorter than the command
    assert stats["latency_ms"]["p99"] / 1e3 <= stats["wall_s"] < took
    from mambastep.tools.run import workload

    assert stats["processes"] == 2 and stats["server_steps_per_s"] > 0
    assert stats["output_tokens"] == sum(n for _, n in workload(5, 256, 0, max_context=64))  # every request, whole
    assert server.idle()


def test_an_engine_process_that_cannot_start_says_why(tmp_path):
    build = functools.partial(TextEngine.load, str(tmp_path), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        EngineProcess(build)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_mid_stream_chunk_is_the_general_chunk(chat):
    """The mid-stream chunk is built around its text only; it must be the very bytes of the
    general one, whatever the text and the model's name."""
    from mambastep.runtime.serving.openai_api import _Chunks

    chunks = _Chunks("cmpl-1", "chat.completion" if chat else "text_completion", 7, 'a "model"\0 \\ é', chat)
    for text in ["", "the cat", 'quote " backslash \\ newline \n', "\0\x01\x1f", "héllo 数据 🙂"]:
        assert chunks.text(text) == chunks(text)
        body = json.loads(chunks.text(text)[len(b"data: "):])
        assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) == text


def test_an_attached_client_shares_the_engine_and_leaves_alone(checkpoint):
    """Two API processes' clients of one engine process (here in one process): each gets its own
    requests' whole text; one that leaves mid-request has its requests dropped and their slots
    freed, and the other goes on."""
    from mambastep.runtime.serving.loop import EngineClient

    build = functools.partial(TextEngine.load, str(checkpoint), dtype=torch.float32, device="cpu", num_slots=SLOTS,
                              max_context=8192)
    owner = EngineProcess(build, attach=1)
    other = EngineClient(owner.attached[0])
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def text(stream):
        pieces = []
        while not (out := await stream.next()).finished:
            pieces.append(out.text)
        return "".join(pieces) + out.text, out.finish_reason

    async def main():
        mine = [await owner.submit(f"the cat {i}", greedy) for i in range(2)]
        theirs = [await other.submit(f"the cat {i + 2}", greedy) for i in range(2)]
        return await asyncio.gather(*(text(s) for s in mine + theirs))

    try:
        got = asyncio.run(main())
        assert got == [(alone(checkpoint, f"the cat {i}", 10), "length") for i in range(4)]

        async def leave():
            long = SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True)
            stream = await other.submit("the cat", long)
            await stream.next()
            other.close()  # leaves mid-request: it ends here with "error", and frees its slot there
            while not (out := await stream.next()).finished:
                pass
            return out.finish_reason, await text(await owner.submit("the cat 0", greedy))

        assert asyncio.run(leave()) == ("error", (alone(checkpoint, "the cat 0", 10), "length"))
        assert other.closed and not owner.closed
        end = time.time() + 20
        while owner.free_slots() != SLOTS and time.time() < end:
            time.sleep(0.02)
        assert owner.free_slots() == SLOTS
    finally:
        owner.close()
    assert owner.closed


def test_the_counts_follow_a_client_that_leaves_an_idle_engine(checkpoint):
    """An API process that leaves (or dies) holding the only requests in flight: the engine drops
    them and, though it then has nothing to step, tells the other clients its counts, so their
    /health sees every slot free (the counts came only with steps, and stayed stale)."""
    from mambastep.runtime.serving.loop import EngineClient

    build = functools.partial(TextEngine.load, str(checkpoint), dtype=torch.float32, device="cpu", num_slots=SLOTS,
                              max_context=8192)
    owner = EngineProcess(build, attach=1)
    other = EngineClient(owner.attached[0])
    long = SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True)

    async def leave():
        streams = [await other.submit("the cat", long) for _ in range(3)]
        for stream in streams:
            await stream.next()
        other.close()

    try:
        asyncio.run(leave())
        end = time.time() + 20
        while owner.free_slots() != SLOTS and time.time() < end:
            time.sleep(0.02)
        assert owner.free_slots() == SLOTS
        assert owner.counts()[1:3] == (0, 0)  # nothing running or waiting
    finally:
        owner.close()


def test_the_bound_counts_every_api_process_together(checkpoint):
    """--max-requests with several API processes bounds them all: the engine process refuses an
    add past it whichever client sends it, though that client alone is under the bound."""
    from mambastep.runtime.serving.loop import EngineClient, Overloaded

    build = functools.partial(TextEngine.load, str(checkpoint), dtype=torch.float32, device="cpu", num_slots=SLOTS,
                              max_context=8192)
    owner = EngineProcess(build, max_requests=2, attach=1)
    other = EngineClient(owner.attached[0], max_requests=2)
    long = SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True)

    async def main():
        mine, theirs = await owner.submit("the cat", long), await other.submit("the cat", long)
        with pytest.raises(Overloaded, match="the bound"):
            await other.submit("x", SamplingParams(max_tokens=2))
        for client, stream in ((owner, mine), (other, theirs)):
            client.abort(stream.id)
            while not (await stream.next()).finished:
                pass
        stream = await other.submit("x", SamplingParams(max_tokens=2, ignore_eos=True))  # under the bound again
        while not (out := await stream.next()).finished:
            pass
        return out.finish_reason

    try:
        assert asyncio.run(main()) == "length"
    finally:
        other.close()
        owner.close()


def test_the_checkpoint_sampling_defaults_fill_what_a_request_leaves_out(checkpoint, tmp_path):
    """generation_config.json's temperature (0 here: greedy) where a request names none, in place
    of OpenAI's 1; a request's own value wins."""
    import shutil

    shutil.copytree(checkpoint, tmp_path / "c")
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    s = Server(tmp_path / "c")
    try:
        texts = {}
        for label, extra in (("unset", {}), ("greedy", {"temperature": 0}), ("hot", {"temperature": 1.5})):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "the cat", "max_tokens": 12, "seed": 1,
                                                            "ignore_eos": True, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            texts[label] = r.json()["choices"][0]["text"]
        assert texts["unset"] == texts["greedy"] != texts["hot"]
    finally:
        s.stop()


def test_requests_are_checked_whole_before_admission_and_every_error_is_json(checkpoint):
    """The table's request rows: a bad stream_options is a 400 before the engine sees the request
    (it used to be a 500 after admission, the engine generating for nobody); a request with no
    max_tokens gets the rest of the context, one past it a 400; unknown routes, wrong methods,
    /v1/models/{id}, a lone surrogate, a body that is not JSON or too large: OpenAI-style JSON
    errors; with an API key, every route but /health asks for it."""
    loop = EngineLoop(text_engine(checkpoint, max_context=40))
    app = create_app(loop, NAME, api_key="sesame", max_body_bytes=2000)
    key = {"authorization": "Bearer sesame"}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=key, timeout=60) as http:
            out = {}
            for name, kw in {
                "stream_options": dict(json={"prompt": "the cat", "stream": True, "stream_options": 5}),
                "stream": dict(json={"prompt": "the cat", "stream": "yes"}),
                "past the context": dict(json={"prompt": "the cat", "max_tokens": 39}),
                "surrogate": dict(content=b'{"prompt": "\\ud800"}', headers={"content-type": "application/json"}),
                "text/plain": dict(content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}),
                "too large": dict(json={"prompt": "x" * 3000}),
            }.items():
                r = await http.post("/v1/completions", **kw)
                out[name] = r.status_code, r.json()["error"]
            assert loop.open_requests() == 0 and loop.text.engine.requests == {}
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "temperature": 0, "ignore_eos": True})
            out["no max_tokens"] = r.status_code, r.json()
            for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions"), ("DELETE", "/v1/models"),
                                 ("GET", "/v1/models/other"), ("GET", "/v1/models/" + NAME)):
                r = await http.request(method, path)
                out[f"{method} {path}"] = r.status_code, r.json()
            no_key = httpx.AsyncClient(transport=transport, base_url="http://x")
            out["no key"] = (await no_key.post("/v1/completions", json={"prompt": "x"})).status_code, None
            out["no key, models"] = (await no_key.get("/v1/models")).status_code, None
            out["no key, health"] = (await no_key.get("/health")).status_code, None
            return out

    try:
        out = asyncio.run(main())
    finally:
        loop.close()
    for name, param in (("stream_options", "stream_options"), ("stream", "stream"), ("past the context", "max_tokens")):
        assert out[name][0] == 400 and out[name][1]["param"] == param, out[name]
    assert "lone surrogate" in out["surrogate"][1]["message"] and out["surrogate"][0] == 400
    assert out["text/plain"][0] == 415 and out["too large"][0] == 413
    status, chat = out["no max_tokens"]
    assert status == 200 and chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["total_tokens"] == 40  # the whole context
    assert out["GET /v1/nothing"][0] == 404 and out["GET /v1/nothing"][1]["error"]["type"] == "not_found_error"
    assert out["GET /v1/completions"][0] == 405 and out["DELETE /v1/models"][0] == 405
    assert out["GET /v1/models/other"][0] == 404 and out["GET /v1/models/other"][1]["error"]["type"] == "model_not_found"
    assert out["GET /v1/models/" + NAME] == (200, {"id": NAME, "object": "model", "created": 0, "owned_by": "mambastep",
                                                   "max_model_len": 40})
    assert out["no key"][0] == 401 and out["no key, models"][0] == 401 and out["no key, health"][0] == 200


def test_the_openai_client_raises_the_status_and_body_of_each_error(server):
    """The official client's APIStatusError for a server error status, with the JSON body."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.status_code == 404 and "not served here" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="the cat", max_tokens=10**6)
    assert e.value.status_code == 400 and "max_tokens" in e.value.message


def test_a_huge_prompt_is_refused_before_it_is_tokenized_and_stalls_no_stream(server):
    """A prompt too long for the context whatever its tokens is a 400 at once (it used to be
    tokenized on the event loop, stalling every stream for seconds); a long one that might fit is
    tokenized in a worker thread while streams go on."""
    huge = "the cat " * 2_000_000  # 16 MB of text
    long = "the cat " * 1000  # past the inline limit: checked (or tokenized) in a worker thread

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            arrivals = []

            async def stream():
                body = {"prompt": "the cat", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())

            task = asyncio.create_task(stream())
            while len(arrivals) < 3:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            refused = await http.post("/v1/completions", json={"prompt": huge, "max_tokens": 4})
            waited = time.monotonic() - t0
            fits = await http.post("/v1/completions", json={"prompt": long, "max_tokens": 2})
            await task
            return refused, waited, fits, max(b - a for a, b in zip(arrivals, arrivals[1:]))

    refused, waited, fits, gap = asyncio.run(main())
    assert refused.status_code == 400 and "cannot fit in the context" in refused.json()["error"]["message"]
    assert fits.status_code == 400 and "context" in fits.json()["error"]["message"]  # far past 96 tokens either way
    assert waited < 10 and gap < 3.0  # the stream went on while the huge body was read and refused (was 12-19 s)
    assert server.idle()


def test_every_response_carries_a_request_id_and_is_logged_once(checkpoint, caplog):
    import logging

    loop = EngineLoop(text_engine(checkpoint))
    app = create_app(loop, NAME, access_log=True)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            mine = await http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2},
                                   headers={"x-request-id": "abc-123"})
            other = await http.get("/nowhere")
            version = await http.get("/version")
            return mine, other, version

    try:
        with caplog.at_level(logging.INFO, logger="mambastep.access"):
            mine, other, version = asyncio.run(main())
    finally:
        loop.close()
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "abc-123"
    assert other.status_code == 404 and len(other.headers["x-request-id"]) == 32
    assert version.json()["version"]
    lines = [r.getMessage() for r in caplog.records if r.name == "mambastep.access"]
    assert len(lines) == 3 and '"POST /v1/completions" 200' in lines[0] and lines[0].endswith("id=abc-123")


def test_metrics_count_each_request_once_by_outcome_and_a_deadline_ends_a_long_one(checkpoint):
    """/metrics in Prometheus's text format: requests by outcome (finished, rejected, timed out),
    tokens, latency histograms, the engine's slots and steps; --request-timeout ends a request
    that runs past it with a 504 (streamed: an error event) and frees its slot."""
    from prometheus_client.parser import text_string_to_metric_families

    loop = EngineLoop(text_engine(checkpoint, max_context=2048))
    app = create_app(loop, NAME, request_timeout=1.0)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as http:
            ok = await http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "ignore_eos": True})
            bad = await http.post("/v1/completions", json={"prompt": "the cat", "top_p": 5})
            slow = await http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2000, "ignore_eos": True})
            events = []
            async with http.stream("POST", "/v1/completions", json={"prompt": "the cat", "max_tokens": 2000,
                                                                     "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            return ok, bad, slow, events

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            return (await http.get("/metrics")).text

    try:
        ok, bad, slow, events = asyncio.run(main())
        end = time.time() + 10  # the aborts reach the engine between its steps
        while (loop.open_requests() or loop.free_slots() != SLOTS) and time.time() < end:
            time.sleep(0.02)
        assert loop.open_requests() == 0 and loop.free_slots() == SLOTS
        text = asyncio.run(scrape())
    finally:
        loop.close()
    assert ok.status_code == 200 and bad.status_code == 400
    assert slow.status_code == 504 and slow.json()["error"]["type"] == "timeout"
    assert "error" in json.loads(events[-1]) and "[DONE]" not in events
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    count = lambda outcome: samples[("mambastep_requests_total", (("outcome", outcome),))]  # noqa: E731
    assert (count("length"), count("rejected"), count("timeout"), count("error")) == (1, 1, 2, 0)
    assert samples[("mambastep_generation_tokens_total", ())] >= 3
    assert samples[("mambastep_time_to_first_token_seconds_count", ())] == 3
    assert samples[("mambastep_request_latency_seconds_count", ())] == 1
    assert samples[("mambastep_slots_free", ())] == SLOTS and samples[("mambastep_requests_open", ())] == 0
    assert samples[("mambastep_engine_steps", ())] > 0


def test_a_prefix_cache_behind_the_server_restores_and_counts_in_metrics(checkpoint):
    """An engine in its own process with a prefix cache: a conversation's second turn restores
    its first turn's prompt, answers as a fresh engine does, and /metrics counts the hit."""
    from prometheus_client.parser import text_string_to_metric_families

    build = functools.partial(TextEngine.load, str(checkpoint), dtype=torch.float32, device="cpu", num_slots=SLOTS,
                              max_context=96, prefix_cache_slots=2)
    loop = EngineProcess(build)
    app = create_app(loop, NAME)
    first = "the quick brown fox jumps over the lazy dog, the cat sat on the mat"
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60) as http:
            one = (await http.post("/v1/completions", json={"prompt": first, **body})).json()["choices"][0]["text"]
            second = first + one + " and more"
            two = (await http.post("/v1/completions", json={"prompt": second, **body})).json()["choices"][0]["text"]
            return one, second, two, (await http.get("/metrics")).text

    try:
        one, second, two, text = asyncio.run(main())
    finally:
        loop.close()
    assert one == alone(checkpoint, first, 6) and two == alone(checkpoint, second, 6)
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["mambastep_prefix_cache_hits"] >= 1 and samples["mambastep_prefix_cache_tokens_restored"] >= 8
    assert samples["mambastep_prefix_cache_bytes"] > 0


def test_a_body_sent_too_slowly_is_a_408(checkpoint):
    loop = EngineLoop(text_engine(checkpoint))
    app = create_app(loop, NAME, body_timeout=0.3)

    async def trickle():
        yield b'{"prompt": '
        await asyncio.sleep(2)
        yield b'"x"}'

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            return await http.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"})

    try:
        t0 = time.time()
        r = asyncio.run(main())
    finally:
        loop.close()
    assert r.status_code == 408 and "did not arrive within 0.3 s" in r.json()["error"]["message"]
    assert time.time() - t0 < 1.9


def test_openai_parameters_not_done_yet_are_refused_by_name_unless_they_ask_for_nothing(server):
    """suffix, tools and the rest: a 400 naming the parameter where it asks for
    something, accepted at the value that asks for nothing; a field no endpoint knows (chat's
    top_logprobs in a completion) is refused, as OpenAI refuses it. None is silently ignored."""
    asks = {"suffix": "!", "response_format": {"type": "json_object"}, "top_logprobs": 2,
            "bogus": 1}
    nothing = {"logprobs": None, "echo": False, "presence_penalty": 0.0, "frequency_penalty": 0,
               "repetition_penalty": 1.0, "logit_bias": {}, "best_of": 1, "user": "me", "tools": None}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, value in asks.items():
            r = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2, name: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        r = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2, **nothing})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert server.idle()


def engine_logprobs(path, prompt_ids, params):
    """(tokens, TokenLogprobs) of the request alone on a fresh engine."""
    engine = text_engine(path).engine
    rid = engine.add_request(prompt_ids, params)
    tokens, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.id == rid:
                tokens += o.new_tokens
                lps += o.logprobs
    return tokens, lps


def test_logprobs_in_both_shapes_streamed_or_not(server, checkpoint):
    """The official client reads each endpoint's logprobs; they are the engine's own, token by
    token, and a stream carries the same as a plain response."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tok = Tokenizer.from_pretrained(checkpoint)
    kw = dict(model=NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    tokens, ref = engine_logprobs(checkpoint, tok.encode("the cat"),
                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    r = client.completions.create(prompt="the cat", logprobs=3, **kw)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref], abs=1e-5)
    for top, x, t in zip(lp.top_logprobs, ref, lp.tokens):
        expected = {tok.decode([i], skip_special_tokens=False): v for i, v in x.top}
        assert set(top) == set(expected) | {t} and len(top) <= 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(prompt="the cat", logprobs=3, stream=True, **kw):
        for k in streamed:
            streamed[k] += getattr(chunk.choices[0].logprobs, k)
    assert streamed == {k: getattr(lp, k) for k in streamed}
    c = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
                                       **kw)
    content = c.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)  # greedy: the top token
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    streamed = [e for ch in client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                                           top_logprobs=2, stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    assert plain.choices[0].logprobs is None
    assert server.idle()


def test_penalties_and_logit_bias_are_the_engines(server, checkpoint):
    """Each parameter reaches the engine: the text equals the engine's with the same
    SamplingParams, and a -100 bias on the greedy token changes it; bad values are a 400."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tok = Tokenizer.from_pretrained(checkpoint)
    ids = tok.encode("the cat")
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    plain, _ = engine_logprobs(checkpoint, ids, SamplingParams(**base, logprobs=0))
    for fields in ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"repetition_penalty": 1.4},
                   {"logit_bias": {plain[0]: -100}}):
        body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
        r = client.completions.create(model=NAME, prompt="the cat", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, **body})
        want, _ = engine_logprobs(checkpoint, ids, SamplingParams(**base, **fields, logprobs=0))
        assert r.choices[0].text == tok.decode(want), fields
    assert want[0] != plain[0]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, param in (({"presence_penalty": 5}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
                            ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"3": 500}}, "logit_bias"),
                            ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"min_tokens": 50}, "min_tokens"),
                            ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                            ({"logprobs": 2, "echo": True}, "logprobs")):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        for body, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                            ({"logprobs": True, "top_logprobs": 30}, "top_logprobs")):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                        **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert server.idle()


def test_a_batch_of_prompts_is_a_choice_each_with_echo_and_stop_token_ids(server, checkpoint):
    """A list of prompts (strings or token ids) in /v1/completions: one choice each, in order,
    each the text its prompt gets alone, streamed or not; echo puts each prompt first;
    stop_token_ids end a request at that token."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompts = ["the cat", "héllo wörld"]
    kw = dict(model=NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [alone(checkpoint, p, 6) for p in prompts]
    assert r.usage.completion_tokens == 12
    streamed = ["", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in r.choices]
    echoed = client.completions.create(prompt=prompts, echo=True, **kw)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, r.choices)]
    ids = Tokenizer.from_pretrained(checkpoint).encode("the cat")
    drawn = text_engine(checkpoint).engine.generate([ids], SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True))[0]
    r = client.completions.create(prompt=[ids, ids], **{**kw, "extra_body": {"ignore_eos": True,
                                                                              "stop_token_ids": [drawn[2]]}})
    stop_at = drawn.index(drawn[2]) + 1
    assert all(c.finish_reason == "stop" for c in r.choices) and r.usage.completion_tokens == 2 * stop_at
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, param in (({"prompt": ["x", 5]}, "prompt"), ({"prompt": []}, "prompt"),
                            ({"prompt": "x", "echo": 1}, "echo"), ({"prompt": "x", "stop_token_ids": "3"},
                                                                    "stop_token_ids")):
            r = http.post("/v1/completions", json={"max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert server.idle()


def test_chat_content_as_text_parts_or_an_assistants_null(server, checkpoint):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = dict(model=NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    parts = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "数据"}]}]
    plain = [{"role": "user", "content": "héllo\n数据"}]
    assert (client.chat.completions.create(messages=parts, **kw).choices[0].message.content
            == alone(checkpoint, plain, 5))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "again"}]
    want = alone(checkpoint, [{**m, "content": m["content"] or ""} for m in turns], 5)
    assert client.chat.completions.create(messages=turns, **kw).choices[0].message.content == want
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for content in ([{"type": "image_url", "image_url": {"url": "x"}}], None, 5):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (content, r.text)
    assert server.idle()


def test_tokenize_and_detokenize(server, checkpoint):
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "héllo"}]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/tokenize", json={"prompt": "the cat sat"}).json()
        assert r["tokens"] == tokenizer.encode("the cat sat") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 96
        assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == tokenizer.encode_chat(messages)
        with_bos = http.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
        assert with_bos == tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=True)
        assert http.post("/tokenize", json={"prompt": "the cat sat", "add_special_tokens": False}).json()["tokens"] \
            == tokenizer.encode("the cat sat", add_special_tokens=False)
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "the cat sat"
        for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"text": "x"}, "text"),
                                  ("/detokenize", {"tokens": [1, 10**9]}, "tokens")):
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_several_served_names(checkpoint):
    """--served-model-name a b: either is the model's name; the response names the one asked for."""
    s = Server(checkpoint, names=["tiny-a", "tiny-b"])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["tiny-a", "tiny-b"]
        assert client.completions.create(model="tiny-b", prompt="x", max_tokens=2).model == "tiny-b"
        assert client.models.retrieve("tiny-a").id == "tiny-a"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=NAME, prompt="x", max_tokens=2)
    finally:
        s.stop()


def test_n_choices_each_equal_their_seed_alone(server, checkpoint):
    """n choices of a prompt (of each prompt in a batch), streamed or not: choice j of a prompt
    is its text alone with seed + j, the prompt counted once in the usage; n past the engine's
    slots is a 400 naming n."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = dict(model=NAME, max_tokens=6, temperature=1.0, seed=50, extra_body={"ignore_eos": True})
    text = text_engine(checkpoint)
    want = {p: [text.generate([p], SamplingParams(temperature=1.0, seed=50 + j, max_tokens=6, ignore_eos=True))[0]
                for j in range(3)] for p in ("the cat", "a dog")}
    r = client.completions.create(prompt=["the cat", "a dog"], n=3, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == want["the cat"] + want["a dog"]
    prompt_tokens = sum(len(Tokenizer.from_pretrained(checkpoint).encode(p)) for p in want)
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 36
    streamed = [""] * 3
    for chunk in client.completions.create(prompt="the cat", n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want["the cat"]
    messages = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(messages=messages, n=2, **kw)
    chat_want = [text.generate([messages], SamplingParams(temperature=1.0, seed=50 + j, max_tokens=6,
                                                          ignore_eos=True))[0] for j in range(2)]
    assert [ch.message.content for ch in c.choices] == chat_want
    roles, streamed = [], ["", ""]
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **kw):
        for ch in chunk.choices:
            roles += [ch.index] if ch.delta.role else []
            streamed[ch.index] += ch.delta.content or ""
    assert sorted(roles) == [0, 1] and streamed == chat_want
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for n in (SLOTS + 1, 0, "2"):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert server.idle()


def test_best_of_answers_the_n_most_likely_of_its_choices(server, checkpoint):
    """best_of 4, n 2: the two of the four seeds' texts (each as alone with seed + j) whose
    tokens have the highest cumulative log-probability, best first; all four billed; with a
    stream, or below n, a 400 naming best_of."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tok = Tokenizer.from_pretrained(checkpoint)
    ids = tok.encode("the cat")
    drawn = []
    for j in range(4):
        tokens, lps = engine_logprobs(checkpoint, ids, SamplingParams(temperature=1.0, seed=70 + j, max_tokens=6,
                                                                      ignore_eos=True, logprobs=0))
        drawn.append((sum(x.logprob for x in lps), tok.decode(tokens)))
    best = [text for _, text in sorted(drawn, reverse=True)[:2]]
    r = client.completions.create(model=NAME, prompt="the cat", max_tokens=6, temperature=1.0, seed=70, n=2,
                                  best_of=4, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == best and [c.index for c in r.choices] == [0, 1]
    assert all(c.logprobs is None for c in r.choices) and r.usage.completion_tokens == 24
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body in ({"best_of": 3, "stream": True}, {"best_of": 1, "n": 2}, {"best_of": "2"}):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", (body, r.text)
    assert server.idle()
