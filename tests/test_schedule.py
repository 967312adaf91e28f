"""Reading ``when`` and computing due times (bumblebot/runtime/schedule.py): pure functions, a fixed clock."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from bumblebot.core.events import ChatRef, Platform
from bumblebot.core.settings import AutonomySettings
from bumblebot.runtime.schedule import WhenError, describe, next_due, parse_when

LISBON = ZoneInfo("Europe/Lisbon")
BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2026, 12, 1, 18, 0, tzinfo=LISBON).timestamp()


@pytest.mark.parametrize(
    ("text", "kind", "due_in"),
    [
        ("in 3 seconds", "once", 3),
        ("in 90 minutes", "once", 5400),
        ("In 1 Day", "once", 86400),
        ("in 2 weeks", "once", 14 * 86400),
        ("every 2 hours", "every", 7200),
        ("every 1 day", "every", 86400),
    ],
)
def test_relative_times(text, kind, due_in):
    when = parse_when(text, LISBON, NOW)
    assert (when.kind, when.first_due - NOW) == (kind, due_in)


def test_an_iso_time_with_its_offset_and_one_without_read_in_the_zone():
    assert parse_when("2026-12-24T18:00+01:00", LISBON, NOW).first_due == datetime(2026, 12, 24, 17, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    assert parse_when("2026-12-24 18:00", LISBON, NOW).first_due == datetime(2026, 12, 24, 18, 0, tzinfo=LISBON).timestamp()
    assert parse_when("2026-12-24T18:00Z", LISBON, NOW).kind == "once"


def test_cron_is_read_in_the_entity_zone_and_keeps_its_hour_across_daylight_saving():
    march = datetime(2026, 3, 28, 8, 0, tzinfo=BERLIN).timestamp()  # the clocks go forward on the 29th
    when = parse_when("0 9 * * *", BERLIN, march)
    first = datetime.fromtimestamp(when.first_due, BERLIN)
    second = datetime.fromtimestamp(next_due("cron", when.spec, BERLIN, when.first_due), BERLIN)
    assert (first.day, first.hour, second.day, second.hour) == (28, 9, 29, 9)
    assert second.timestamp() - first.timestamp() == 23 * 3600  # one hour less that day
    assert describe("cron", "0 9 * * *") == "cron 0 9 * * *"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tomorrow", "cannot read 'tomorrow' as a time"),
        ("in 5 parsecs", "unknown unit 'parsecs'"),
        ("every 10 seconds", "at most every 60 seconds"),
        ("61 * * * *", "not a valid 5-field cron expression"),
        ("2020-01-01T10:00+00:00", "is in the past"),
        ("in 0 minutes", "not in the future"),
        ("in 9999999 days", "years ahead"),
        ("", "when is empty"),
        ("x" * 500, "too long"),
    ],
)
def test_bad_when_says_why_and_how_to_write_it(text, says):
    with pytest.raises(WhenError, match=says):
        parse_when(text, LISBON, NOW)


def test_the_minimum_repeat_is_configurable():
    assert parse_when("every 2 seconds", LISBON, NOW, min_interval_s=1).first_due == NOW + 2
    assert parse_when("* * * * *", LISBON, NOW).kind == "cron"  # every minute: the default minimum
    with pytest.raises(WhenError, match="repeats more often"):
        parse_when("* * * * *", LISBON, NOW, min_interval_s=120)


def test_a_missed_recurring_task_counts_its_next_time_from_when_it_fired():
    assert next_due("every", "3600", LISBON, NOW + 10_000) == NOW + 10_000 + 3600
    assert next_due("once", "x", LISBON, NOW) is None


@pytest.mark.parametrize(("hour", "minute", "quiet"), [(23, 0, True), (7, 59, True), (8, 0, False), (12, 0, False), (22, 0, True)])
def test_quiet_hours_cross_midnight(hour, minute, quiet):
    assert AutonomySettings(quiet_hours="22:00-08:00").quiet(hour, minute) is quiet
    assert AutonomySettings().quiet(hour, minute) is False


def test_quiet_hours_must_be_a_span():
    with pytest.raises(ValueError, match="HH:MM-HH:MM"):
        AutonomySettings(quiet_hours="after ten")


@pytest.mark.parametrize("key", ["telegram:123", "telegram:-100200:7", "discord:1:2", "console:local:ana"])
def test_a_conversation_key_reads_back_as_its_chat(key):
    assert ChatRef.from_key(key).key == key


def test_the_terminal_key_reads_back_as_the_terminal_chat_not_a_thread():
    # The terminal's chat id holds a colon; reading "local" as the chat and the user as a
    # thread made the title and the pause land on a second, phantom conversation.
    assert ChatRef.from_key("console:local:root") == ChatRef(Platform.CONSOLE, "local:root")
    assert ChatRef.from_key("telegram:-100200:7") == ChatRef(Platform.TELEGRAM, "-100200", "7")


def test_a_key_of_no_platform_is_refused():
    with pytest.raises(ValueError):
        ChatRef.from_key("irc:#chan")
    assert ChatRef.from_key("telegram:5") == ChatRef(Platform.TELEGRAM, "5")


def test_a_time_in_the_repeated_autumn_hour_runs_once_that_night():
    """Regression: 30 2 * * * in Berlin fired at 02:30+02:00 and again at 02:30+01:00 on 2026-10-25."""
    first = datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN).timestamp()  # the first 02:30 (summer time)
    following = datetime.fromtimestamp(next_due("cron", "30 2 * * *", BERLIN, first), BERLIN)
    assert (following.day, following.hour, following.minute) == (26, 2, 30)
