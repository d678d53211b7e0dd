"""`mambastep serve`: the command starts a server a stock client talks to, and checks its
arguments first."""

import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from mambastep.tools import cli  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("engine", [["--engine", "thread"], ["--api-processes", "1"], [],
                                    ["--api-processes", "1", "--speculative", "3"],
                                    ["--api-processes", "1", "--speculative", "2", "--draft-model", "tiny-hybrid"],
                                    ["--api-processes", "1", "--speculative", "2", "--mtp"]],
                         ids=["engine-thread", "engine-process", "two-api-processes (the default)", "speculative",
                              "a draft model (built in the engine's process)", "the preset's MTP layers drafting"])
def test_serve_a_preset_over_http(engine):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mambastep.tools.cli", "serve", "--preset", "tiny-hybrid",
                             "--device", "cpu", "--port", str(port), "--name", "tiny", *engine],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not come up: " + proc.stdout.read1().decode(errors="replace"))
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "héllo"}],
                                                           "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        if not engine:
            # each request a connection of its own: the kernel spreads them over both processes,
            # and each answers from the one engine the same tokens
            body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            pids, texts = set(), set()
            for _ in range(24):
                with httpx.Client(base_url=url, timeout=30) as http:
                    health = http.get("/health").json()
                    assert health["api_processes"] == 2
                    pids.add(health["pid"])
                with httpx.Client(base_url=url, timeout=30) as http:
                    texts.add(http.post("/v1/completions", json=body).json()["choices"][0]["text"])
            assert len(pids) == 2 and len(texts) == 1
            # /metrics from either process sums both: 24 finished by length, 2 more by stop or length before
            from prometheus_client.parser import text_string_to_metric_families

            for _ in range(6):
                with httpx.Client(base_url=url, timeout=30) as http:
                    text = http.get("/metrics").text
                done = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                           if s.name == "mambastep_requests_total" and s.labels["outcome"] in ("stop", "length"))
                assert done == 26
    finally:
        proc.terminate()
        assert proc.wait(20) == 0 or proc.returncode == -15


def test_a_port_in_use_is_named_before_the_engine_is_built(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            cli.main(["serve", "--device", "cpu", "--model", "/nonexistent", "--port", str(port)])
    # the checkpoint is not even read: the port is the first thing taken
    assert exit_.value.code == 2 and f"--port {port}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--preset", "tiny-hybrid", "--port", "70000"], "--port"),
    (["--preset", "tiny-hybrid", "--max-requests", "0"], "--max-requests"),
    (["--preset", "tiny-hybrid", "--api-processes", "0"], "--api-processes: must be at least 1"),
    (["--preset", "tiny-hybrid", "--engine", "thread", "--api-processes", "2"], "--engine process"),
    (["--preset", "tiny-hybrid", "--speculative", "2", "--pipelined"], "--speculative reads each step's tokens"),
    (["--preset", "tiny-hybrid", "--draft-model", "tiny-hybrid"], "--draft-model drafts for --speculative K"),
    (["--model", "/nonexistent"], "config.json: not found"),
    (["--model", "/nonexistent", "--engine", "thread"], "config.json: not found"),
    ([], "one of the arguments --model --preset is required"),
])
def test_serve_checks_its_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--device", "cpu", *argv])
    assert exit_.value.code == 2 and match in capsys.readouterr().err
