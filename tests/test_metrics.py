"""Prometheus metrics (bumblebot/core/metrics.py): "/metrics serves counters when enabled".

The exporter is real (``prometheus_client``'s HTTP server on 127.0.0.1) and is read with httpx.
The daemon is real too: ``metrics.listen`` in its config makes ``Daemon`` build one ``Metrics``,
give it to its parts' constructors and serve it, as ``bumblebot run`` does. The turns go through
the fake Telegram and OpenAI servers.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from typing import Any

import httpx
import pytest
from conftest import running, write_config
from fakes.openai_server import error, is_loop, text
from prometheus_client.parser import text_string_to_metric_families
from support import Gate, is_loop_with, judges_say_done, say

from bumblebot.core.errors import ConfigError, ModelError, ModelTimeout
from bumblebot.core.metrics import NO_METRICS, Metrics, NoMetrics, parse_listen
from bumblebot.core.settings import LLMSettings
from bumblebot.llm import LLM


def free_port() -> int:
    """A port free on 127.0.0.1 now (``metrics.listen`` does not take 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serving(tmp_path, llm, tg, **sections):
    """A config pointing at the fakes whose daemon serves metrics on a free local port."""
    return write_config(tmp_path, llm, tg, metrics={"listen": f"127.0.0.1:{free_port()}"}, **sections)


async def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` over HTTP: ``{(sample name, sorted labels): value}``."""
    assert metrics.address is not None
    host, port = metrics.address
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"http://{host}:{port}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
async def metrics():
    m = Metrics()
    await m.serve("127.0.0.1:0")
    yield m
    await m.stop()


async def test_metrics_serves_the_counters_of_real_turns(tmp_path, llm, tg):
    """Two turns in one chat, the second waiting in the inbox while the first is held."""
    judges_say_done(llm)
    held = Gate(say("hey!"))
    llm.push(held, when=is_loop)
    llm.push(say("sure, one more"), when=is_loop_with("one more thing"))
    config = serving(tmp_path, llm, tg, cognition={"classifier": False, "mid_turn_messages": "queue"})
    async with running(config) as d:
        metrics = d.metrics
        before = await scrape(metrics)
        tg.push_text("hi", chat_id=1)
        await asyncio.wait_for(held.entered.wait(), 5)
        tg.push_text("one more thing", chat_id=1)
        await d.engine.wait_until(lambda: d.engine.progress.accepted == 2)
        during = await scrape(metrics)
        held.release.set()
        await d.engine.wait_for_turns(2)
        after = await scrape(metrics)
    assert metrics.address is None  # stopped with the daemon
    assert tg.sent(1) == ["hey!", "sure, one more"]

    assert value(before, "bumblebot_turns_total", status="done") == 0.0
    assert value(before, "bumblebot_queue_depth") == 0.0
    assert value(during, "bumblebot_queue_depth") == 1.0  # "one more thing" waits for "hi"
    assert value(during, "bumblebot_model_requests_total", outcome="ok") == 0.0  # the first is held

    assert value(after, "bumblebot_turns_total", status="done") == 2.0
    assert value(after, "bumblebot_turns_total", status="failed") == 0.0
    assert value(after, "bumblebot_model_requests_total", outcome="ok") == 4.0  # each turn: its step and its check
    assert value(after, "bumblebot_model_requests_total", outcome="error") == 0.0
    assert value(after, "bumblebot_model_requests_total", outcome="timeout") == 0.0
    assert value(after, "bumblebot_model_request_seconds_count") == 4.0
    assert value(after, "bumblebot_model_request_seconds_sum") > 0.0
    assert value(after, "bumblebot_deliveries_total", outcome="sent") == 2.0
    assert value(after, "bumblebot_deliveries_total", outcome="failed") == 0.0
    assert value(after, "bumblebot_deliveries_total", outcome="queued") == 0.0
    assert value(after, "bumblebot_queue_depth") == 0.0


async def test_metrics_serve_tokens_by_type_model_and_kind_and_their_cost(tmp_path, llm, tg):
    judges_say_done(llm)
    usage = {"prompt_tokens": 1000, "completion_tokens": 50,
             "prompt_tokens_details": {"cached_tokens": 600}, "completion_tokens_details": {"reasoning_tokens": 20}}
    llm.push(say("hey!", usage=usage), when=is_loop)
    prices = {"reflex-model": {"input": 1.0, "cached_input": 0.25, "output": 4.0}}
    config = write_config(tmp_path, llm, tg, metrics={"listen": f"127.0.0.1:{free_port()}"}, llm={
        "base_url": llm.base_url, "model": "test-model", "reflex_model": "reflex-model", "prices": prices, "currency": "EUR",
    })
    async with running(config) as d:
        tg.push_text("hi", chat_id=1)
        await d.engine.wait_for_turns(1)
        samples = await scrape(d.metrics)
    tokens = "bumblebot_model_tokens_total"
    for kind_of_token, count in (("prompt", 1000), ("cached", 600), ("completion", 50), ("reasoning", 20)):
        assert value(samples, tokens, type=kind_of_token, model="reflex-model", kind="turn") == count
    judged = value(samples, tokens, type="prompt", model="reflex-model", kind="judge")
    assert judged > 0  # the completion check: counted apart, at what the endpoint reported
    judge_cost = (judged * 1.0 + value(samples, tokens, type="completion", model="reflex-model", kind="judge") * 4.0) / 1e6
    cost = "bumblebot_model_cost_total"
    turn_cost = (400 * 1.0 + 600 * 0.25 + 50 * 4.0) / 1e6
    assert abs(value(samples, cost, model="reflex-model", kind="turn", currency="EUR") - turn_cost) < 1e-12
    assert abs(value(samples, cost, model="reflex-model", kind="judge", currency="EUR") - judge_cost) < 1e-12
    assert not [k for k in samples if k[0].startswith("bumblebot_model_") and "conversation" in dict(k[1])]


async def test_failures_are_counted(tmp_path, llm, tg):
    """A refused request fails its turn (one honest note goes out); Telegram refusing that
    note for good is a failed delivery."""
    judges_say_done(llm)
    for _ in range(2):  # "required", then the "auto" it is retried with at once
        llm.push(error(400, "the model refuses"), when=is_loop)
    tg.fail_next("sendMessage", 403, {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"})
    async with running(serving(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=1)
        await d.engine.wait_for_turns(1)
        samples = await scrape(d.metrics)
    assert value(samples, "bumblebot_turns_total", status="failed") == 1.0
    assert value(samples, "bumblebot_turns_total", status="done") == 0.0
    assert value(samples, "bumblebot_model_requests_total", outcome="error") == 1.0
    assert value(samples, "bumblebot_model_requests_total", outcome="ok") == 0.0
    assert value(samples, "bumblebot_deliveries_total", outcome="failed") == 1.0
    assert value(samples, "bumblebot_deliveries_total", outcome="sent") == 0.0


async def test_model_outcomes_and_latency(llm):
    """ok, error and timeout, each timed; a cancelled request counts as none of them."""
    metrics = Metrics()
    client = LLM(
        LLMSettings(base_url=llm.base_url, model="m", timeout_s=0.3, max_retries=0),
        base_url=llm.base_url, api_key="sk-test-key-not-real-000000", metrics=metrics,
    )
    hang = Gate(text("never"))
    try:
        llm.push(text("fine"))
        await client.text([{"role": "user", "content": "a"}], max_tokens=8, temperature=0)
        llm.push(error(400, "no"))
        with pytest.raises(ModelError):
            await client.text([{"role": "user", "content": "b"}], max_tokens=8, temperature=0)
        llm.push(hang)
        with pytest.raises(ModelTimeout):
            await client.text([{"role": "user", "content": "c"}], max_tokens=8, temperature=0)
        llm.push(hang)
        cancelled = asyncio.create_task(client.text([{"role": "user", "content": "d"}], max_tokens=8, temperature=0))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    finally:
        hang.release.set()
        await client.aclose()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    }
    assert value(samples, "bumblebot_model_requests_total", outcome="ok") == 1.0
    assert value(samples, "bumblebot_model_requests_total", outcome="error") == 1.0
    assert value(samples, "bumblebot_model_requests_total", outcome="timeout") == 1.0
    assert value(samples, "bumblebot_model_request_seconds_count") == 3.0
    assert value(samples, "bumblebot_model_request_seconds_sum") >= 0.3  # the timeout waited


def test_requests_cut_at_their_budget_are_counted_by_how():
    from bumblebot.core.usage import Usage

    metrics = Metrics()
    cut = {"by": "deadline", "budget": 512, "elapsed_s": 31.0}
    metrics.model_usage("turn", Usage("http://x/v1", "m", prompt=10, completion=512, cut=cut), None, "USD")
    metrics.model_usage("judge", Usage("http://x/v1", "m", prompt=10, completion=64), None, "USD")
    assert b'bumblebot_model_cuts_total{by="deadline",model="m"} 1.0' in metrics.exposition()
    assert b'by="tokens"' not in metrics.exposition()


async def test_two_instances_keep_their_own_counts():
    """Each Metrics has its own registry: no clash, no shared values, nothing global."""
    import prometheus_client

    a, b = Metrics(), Metrics()
    a.turn_finished("done")
    assert b"bumblebot_turns_total{status=\"done\"} 1.0" in a.exposition()
    assert b"bumblebot_turns_total{status=\"done\"} 0.0" in b.exposition()
    assert b"bumblebot_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


async def test_exporter_lifecycle(metrics):
    assert metrics.address is not None and metrics.address[1] > 0  # port 0 took a free port
    with pytest.raises(RuntimeError, match="already started"):
        await metrics.serve("127.0.0.1:0")
    host, port = metrics.address
    await metrics.stop()
    await metrics.stop()  # idempotent
    assert metrics.address is None
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(f"http://{host}:{port}/metrics", timeout=2)
    with pytest.raises(RuntimeError, match="stopped"):
        await metrics.serve("127.0.0.1:0")


async def test_an_address_in_use_is_a_config_error_naming_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            await Metrics().serve(f"127.0.0.1:{port}")
    assert caught.value.key == "metrics.listen"
    assert f"127.0.0.1:{port}" in str(caught.value)
    with pytest.raises(ConfigError, match="host:port"):
        await Metrics().serve("localhost")


@pytest.mark.parametrize(
    ("listen", "parsed"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("localhost:9464", ("localhost", 9464)),
        ("[::1]:9464", ("::1", 9464)),
        (":9464", ("0.0.0.0", 9464)),
        (" 127.0.0.1:0 ", ("127.0.0.1", 0)),
    ],
)
def test_parse_listen(listen, parsed):
    assert parse_listen(listen) == parsed


@pytest.mark.parametrize("listen", ["9464", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "::1:9464", ""])
def test_parse_listen_refuses(listen):
    with pytest.raises(ValueError, match="host:port|brackets"):
        parse_listen(listen)


async def test_no_metrics_overrides_every_hook():
    """The default of every constructor: no registry, nothing counted, nothing served. A hook
    added to Metrics but not to NoMetrics would reach a registry NoMetrics does not have."""
    public = {
        name for name, member in inspect.getmembers(Metrics)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }
    overridden = {name for name in public if name in vars(NoMetrics)}
    assert public - overridden == {"address"}  # a property reading _server, which stays None
    assert isinstance(NO_METRICS, NoMetrics)
    NO_METRICS.turn_finished("done")
    NO_METRICS.delivery("sent")
    NO_METRICS.watch_queue(lambda: 1)
    with NO_METRICS.model_request():
        pass
    assert NO_METRICS.exposition() == b"" and NO_METRICS.address is None
    with pytest.raises(RuntimeError, match="metrics are off"):
        await NO_METRICS.serve("127.0.0.1:0")
    await NO_METRICS.stop()


async def test_metrics_are_off_by_default(tmp_path, llm, tg):
    """Without ``metrics.listen`` nothing is counted or served."""
    async with running(write_config(tmp_path, llm, tg)) as d:
        assert d.metrics is NO_METRICS and d.metrics.address is None


def test_a_worker_of_a_cluster_names_itself_in_its_metrics():
    assert b'target_info{worker="w2"} 1.0' in Metrics("w2").exposition()
    assert b"target_info" not in Metrics().exposition()  # alone: nothing to tell apart
