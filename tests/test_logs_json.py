"""``log_format: json`` (bumblebot/core/logs.py): one JSON object per record per line, with
the conversation and turn when known, redacted like the text output; logs to a file."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from datetime import UTC, datetime

import pytest
from conftest import running, write_config
from fakes.openai_server import error, is_loop
from support import judges_say_done

from bumblebot.core.logs import bind, bound, setup_logging

SECRET = "hunter2-secret-value"
log = logging.getLogger("bumblebot.test")


@pytest.fixture(autouse=True)
def close_handlers():
    """Close what setup_logging installed (conftest puts the old handlers back; a file
    handler left open would warn, and warnings are errors)."""
    yield
    for handler in list(logging.getLogger().handlers):
        if getattr(handler, "_bumblebot", False):
            logging.getLogger().removeHandler(handler)
            handler.close()


def json_setup(level: str = "INFO") -> io.StringIO:
    stream = io.StringIO()
    setup_logging(level, [SECRET], stream=stream, fmt="json")
    return stream


def records(stream: io.StringIO) -> list[dict]:
    lines = stream.getvalue().splitlines()
    return [json.loads(line) for line in lines]  # every line is one whole object


def test_each_record_is_one_json_object_with_the_fields():
    stream = json_setup()
    log.info("first line\nsecond line of %s", "the same record")
    log.warning("another")
    first, second = records(stream)
    assert list(first) == ["time", "level", "logger", "message"]  # nothing bound: no ids
    assert first["level"] == "INFO" and first["logger"] == "bumblebot.test"
    assert first["message"] == "first line\nsecond line of the same record"
    assert second["level"] == "WARNING" and second["message"] == "another"
    assert first["time"].endswith("Z")
    stamp = datetime.fromisoformat(first["time"])  # Python 3.11 reads the Z
    assert stamp.tzinfo is not None and stamp.utcoffset().total_seconds() == 0
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 60


async def test_bound_conversation_and_turn_are_in_each_record_even_in_tasks_and_threads():
    stream = json_setup()
    with bind(conversation="telegram:42"):
        log.info("routing")
        with bind(turn=7):  # the conversation stays bound
            log.info("in the turn")
            await asyncio.create_task(_log_later("in a task it started"))
            await asyncio.to_thread(log.info, "in a worker thread")
            assert bound() == {"conversation": "telegram:42", "turn": 7}
        log.info("after the turn")
    log.info("outside")
    by_message = {r["message"]: r for r in records(stream)}
    assert by_message["routing"]["conversation"] == "telegram:42" and "turn" not in by_message["routing"]
    for message in ("in the turn", "in a task it started", "in a worker thread"):
        assert (by_message[message]["conversation"], by_message[message]["turn"]) == ("telegram:42", 7), message
    assert "turn" not in by_message["after the turn"]
    assert "conversation" not in by_message["outside"] and "turn" not in by_message["outside"]
    assert bound() == {}


async def _log_later(message: str) -> None:
    await asyncio.sleep(0)
    log.info(message)


def test_ids_given_with_extra_win_over_bound_ones():
    stream = json_setup()
    with bind(conversation="telegram:1", turn=1):
        log.info("moved", extra={"conversation": "telegram:2"})
    (record,) = records(stream)
    assert record["conversation"] == "telegram:2" and record["turn"] == 1


def test_secrets_are_redacted_in_messages_ids_and_tracebacks():
    stream = json_setup()
    token = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq"
    with bind(conversation=f"x:{SECRET}"):
        log.info("key %s and url https://api.telegram.org/bot%s/getMe", SECRET, token)
        try:
            raise RuntimeError(f"failed with {SECRET} and sk-proj-abcdefghijklmnop1234 inside")
        except RuntimeError:
            log.exception("boom")
    out = stream.getvalue()
    assert SECRET not in out and "AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq" not in out
    assert "sk-proj-abcdefghijklmnop1234" not in out
    info, boom = records(stream)
    assert info["message"] == "key [REDACTED] and url https://api.telegram.org/bot[REDACTED]/getMe"
    assert info["conversation"] == "x:[REDACTED]"
    assert boom["message"] == "boom" and boom["level"] == "ERROR"
    assert boom["exception"].startswith("Traceback (most recent call last):")
    assert "RuntimeError: failed with [REDACTED] and [REDACTED] inside" in boom["exception"]


def test_exception_and_stack_info_are_included():
    stream = json_setup()
    try:
        {}["missing"]
    except KeyError:
        log.warning("lookup failed", exc_info=True)
    log.info("where am I", stack_info=True)
    failed, where = records(stream)
    assert "KeyError: 'missing'" in failed["exception"]
    assert "test_exception_and_stack_info_are_included" in where["stack"]
    assert "exception" not in where


def test_logs_go_to_a_file_and_not_to_stderr(tmp_path, capfd):
    path = tmp_path / "data" / "bumblebot.log"  # its directory does not exist yet
    setup_logging("INFO", [SECRET], fmt="json", file=path)
    log.info("into the file with %s", SECRET)
    setup_logging("INFO", [SECRET], file=path)  # replaces (and closes) the first handler
    log.info("as text now")
    first, second = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(first)["message"] == "into the file with [REDACTED]"
    assert second.endswith("INFO bumblebot.test: as text now")
    out, err = capfd.readouterr()
    assert "into the file" not in err + out and "as text now" not in err + out
    handlers = [h for h in logging.getLogger().handlers if getattr(h, "_bumblebot", False)]
    assert len(handlers) == 1  # one bumblebot handler at a time


def test_text_stays_the_default_and_an_unknown_format_is_refused():
    stream = io.StringIO()
    setup_logging("INFO", [SECRET], stream=stream)
    with bind(conversation="telegram:1", turn=3):
        log.info("plain %s", SECRET)
    assert stream.getvalue().rstrip().endswith("INFO bumblebot.test: plain [REDACTED]")
    with pytest.raises(ValueError, match="'text' or 'json'"):
        setup_logging("INFO", [], stream=stream, fmt="yaml")  # type: ignore[arg-type]


async def test_a_real_turn_logs_its_conversation_and_turn(tmp_path, llm, tg):
    """The daemon's own records of a turn carry its ids (TurnRunner binds them)."""
    stream = json_setup()
    judges_say_done(llm)
    for _ in range(2):  # "required", then "auto": the model refuses, so the turn fails
        llm.push(error(400, "the model refuses"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        (turn,) = await d.store.recent_turns()
    failed = [r for r in records(stream) if r["logger"] == "bumblebot.runtime.runner" and "failed" in r["message"]]
    assert failed, stream.getvalue()
    assert failed[0]["conversation"] == "telegram:1" and failed[0]["turn"] == turn["turn_id"]
    assert failed[0]["level"] == "WARNING"
    unbound = [r for r in records(stream) if r["logger"].startswith("adapters.")]
    assert unbound and all("turn" not in r for r in unbound)  # the adapter's records are outside any turn
