"""The fake OpenAI and Telegram servers, exercised with the real clients over 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import warnings
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import telegram
import telegram.warnings
from fakes.openai_server import (
    FakeOpenAI,
    error,
    is_aux,
    is_loop,
    mentions,
    sequence_violation,
    text,
    tool_calls,
)
from fakes.telegram_server import FakeTelegram, bad_request_body, retry_after_body
from telegram.ext import ApplicationBuilder, CommandHandler, ContextTypes, MessageHandler, filters

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look something up",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "hello"}]


def _call(call_id: str) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def client(llm: FakeOpenAI) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key="sk-test", max_retries=0) as c:
        yield c


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def bot(tg: FakeTelegram) -> AsyncIterator[telegram.Bot]:
    async with telegram.Bot(tg.token, base_url=tg.base_url, base_file_url=tg.base_file_url) as b:
        yield b


# ---- FakeOpenAI ----------------------------------------------------------------------------

async def test_tool_call_reply_is_a_parsed_completion(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(tool_calls(("lookup", {"q": "bees"}), ("lookup", {"q": "wasps"}, "call_fixed")))
    completion = await client.chat.completions.create(model="test-model", messages=USER,
                                                      tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["lookup", "lookup"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"q": "bees"}, {"q": "wasps"}]
    assert calls[0].id.startswith("call_") and calls[1].id == "call_fixed"
    assert completion.model == "test-model"
    assert completion.usage.prompt_tokens == (len(json.dumps(USER)) + len(json.dumps(TOOLS))) // 4  # tools count
    assert llm.requests[0]["tools"] == TOOLS
    assert llm.request_log[0].headers["Authorization"] == "Bearer sk-test"
    assert llm.request_log[0].status == 200


async def test_text_reply_and_model_list(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(text("plain answer"))
    completion = await client.chat.completions.create(model="reflex-model", messages=USER)
    assert completion.choices[0].message.content == "plain answer"
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"
    assert [m.id async for m in client.models.list()] == ["test-model", "reflex-model"]


async def test_injected_error_then_unscripted_request(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(error(500, "boom"))
    with pytest.raises(openai.InternalServerError, match="boom"):
        await client.chat.completions.create(model="test-model", messages=USER)
    with pytest.raises(openai.InternalServerError, match="unscripted request"):
        await client.chat.completions.create(model="test-model", messages=USER)
    assert len(llm.unscripted) == 1
    assert [r.status for r in llm.request_log] == [500, 500]


async def test_default_and_callable_replies(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(lambda request: text(f"you said {request['messages'][-1]['content']}"))
    llm.default = lambda request: text("fallback")
    first = await client.chat.completions.create(model="test-model", messages=USER)
    second = await client.chat.completions.create(model="test-model", messages=USER)
    assert first.choices[0].message.content == "you said hello"
    assert second.choices[0].message.content == "fallback"
    assert llm.unscripted == []


async def test_when_predicates_pick_the_matching_reply(llm: FakeOpenAI,
                                                       client: openai.AsyncOpenAI):
    llm.push(text("about cats"), when=mentions("cats"))  # queue order decides among matches
    llm.push(text("summary"), when=is_aux)
    llm.push(tool_calls(("lookup", {})), when=is_loop)
    loop = await client.chat.completions.create(model="test-model", messages=USER, tools=TOOLS)
    cats = await client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": [{"type": "text",
                                                                    "text": "cats?"}]}])
    aux = await client.chat.completions.create(model="test-model", messages=USER)
    assert loop.choices[0].message.tool_calls[0].function.name == "lookup"
    assert cats.choices[0].message.content == "about cats"
    assert aux.choices[0].message.content == "summary"
    assert llm.pending == 0


async def test_tool_choice_required_is_rejected_without_consuming_script(
        client: openai.AsyncOpenAI, llm: FakeOpenAI):
    llm.reject_tool_choice_required = 400
    llm.push(text("ok"))
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        await client.chat.completions.create(model="test-model", messages=USER, tools=TOOLS,
                                             tool_choice="required")
    assert len(llm.rejected) == 1
    auto = await client.chat.completions.create(model="test-model", messages=USER, tools=TOOLS,
                                                tool_choice="auto")
    assert auto.choices[0].message.content == "ok"


async def test_null_content_is_a_violation(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(text("never sent"))
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": "result"}]
    with pytest.raises(openai.BadRequestError, match="null content"):
        await client.chat.completions.create(model="test-model", messages=messages)
    assert [reason for reason, _ in llm.violations] == ["a message has null content"]
    messages[1]["content"] = ""
    completion = await client.chat.completions.create(model="test-model", messages=messages)
    assert completion.choices[0].message.content == "never sent"


async def test_invalid_sequence_is_a_bad_request(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    orphan = [*USER, {"role": "tool", "tool_call_id": "c9", "content": "stray"}]
    with pytest.raises(openai.BadRequestError, match="tool message does not follow"):
        await client.chat.completions.create(model="test-model", messages=orphan)
    assert len(llm.violations) == 1 and llm.requests == [llm.violations[0][1]]


ASSISTANT_2 = {"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("b")]}


def _result(call_id: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": call_id, "content": "r"}


@pytest.mark.parametrize(("messages", "problem"), [
    ([*USER, ASSISTANT_2, _result("b"), _result("a"), {"role": "user", "content": "x"}], None),
    ([*USER, ASSISTANT_2, _result("a")], "['b'] have no tool message"),
    ([*USER, ASSISTANT_2, _result("a"), _result("a"), _result("b")], "second result"),
    ([*USER, ASSISTANT_2, _result("a"), _result("c")], "'c' is not among"),
    ([*USER, ASSISTANT_2, _result("a"), USER[0], _result("b")], "['b'] have no tool message"),
    ([*USER, ASSISTANT_2, _result("a"), _result("b"), USER[0], _result("b")],
     "messages[5]: tool message does not follow"),
    ([_result("a"), *USER], "messages[0]: tool message does not follow"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("a")]}, _result("a")],
     "duplicate tool call ids"),
])
def test_sequence_violation(messages: list[dict[str, object]], problem: str | None):
    reason = sequence_violation(messages)
    assert reason == problem if problem is None else problem in (reason or "")


async def test_delayed_reply_is_overtaken(llm: FakeOpenAI, client: openai.AsyncOpenAI):
    llm.push(text("slow", delay=0.5), when=mentions("slow"))
    llm.push(text("fast"), when=mentions("fast"))
    slow = asyncio.create_task(client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "slow"}]))
    await llm.wait_for_requests(1)
    fast = await client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "fast"}])
    assert fast.choices[0].message.content == "fast"
    assert not slow.done()
    assert (await slow).choices[0].message.content == "slow"


async def test_wait_for_requests_times_out_clearly(llm: FakeOpenAI):
    with pytest.raises(AssertionError, match="expected 1 requests within 0.05s, got 0"):
        await llm.wait_for_requests(1, timeout=0.05)


# ---- FakeTelegram --------------------------------------------------------------------------

async def test_get_me(bot: telegram.Bot):
    me = await bot.get_me()
    assert (me.id, me.is_bot, me.username, me.first_name) == (4242, True, "fake_bot", "FakeBot")


async def test_get_updates_offset_confirms_and_drops(tg: FakeTelegram, bot: telegram.Bot):
    first, second = tg.push_text("one"), tg.push_text("two", chat_id=1002)
    updates = await bot.get_updates(timeout=0)
    assert [u.message.text for u in updates] == ["one", "two"]
    assert [u.update_id for u in updates] == [first["update_id"], second["update_id"]]
    assert (await bot.get_updates(timeout=0, limit=1))[0].message.text == "one"  # still pending
    assert await bot.get_updates(offset=second["update_id"] + 1, timeout=0) == ()
    assert tg.confirmed_offset == second["update_id"] + 1
    assert await bot.get_updates(timeout=0) == ()


async def test_long_poll_wakes_on_push(tg: FakeTelegram, bot: telegram.Bot):
    poll = asyncio.create_task(bot.get_updates(timeout=10))
    await tg.wait_for("getUpdates")
    assert not poll.done()
    tg.push_text("late news")
    updates = await asyncio.wait_for(poll, timeout=5)
    assert [u.message.text for u in updates] == ["late news"]


async def test_send_message_is_recorded(tg: FakeTelegram, bot: telegram.Bot):
    message = await bot.send_message(chat_id=1001, text="42")
    assert (message.chat.id, message.text, message.from_user.id) == (1001, "42", 4242)
    second = await bot.send_message(chat_id=-5, text="*hi*", parse_mode="MarkdownV2")
    assert second.message_id == message.message_id + 1 and second.chat.type == "supergroup"
    assert tg.sent() == ["42", "*hi*"] and tg.sent(chat_id=1001) == ["42"]
    call = (await tg.wait_for("sendMessage", predicate=lambda p: p["chat_id"] == -5))[0]
    assert call.params["parse_mode"] == "MarkdownV2"
    assert call.content_type == "application/x-www-form-urlencoded"


async def test_text_rules_are_enforced(bot: telegram.Bot):
    with pytest.raises(telegram.error.BadRequest, match="(?i)message text is empty"):
        await bot.send_message(chat_id=1001, text=" \n ")
    with pytest.raises(telegram.error.BadRequest, match="(?i)message text is empty"):
        await bot.send_message(chat_id=1001, text="<b></b>", parse_mode="HTML")
    await bot.send_message(chat_id=1001, text="😀" * 2048)  # 4096 UTF-16 code units
    with pytest.raises(telegram.error.BadRequest, match="(?i)message is too long"):
        await bot.send_message(chat_id=1001, text="😀" * 2048 + "x")


async def test_edit_rules(bot: telegram.Bot):
    sent = await bot.send_message(chat_id=1001, text="draft")
    edited = await bot.edit_message_text("final", chat_id=1001, message_id=sent.message_id)
    assert edited.text == "final" and edited.edit_date is not None
    with pytest.raises(telegram.error.BadRequest, match="(?i)message is not modified"):
        await bot.edit_message_text("final", chat_id=1001, message_id=sent.message_id)
    with pytest.raises(telegram.error.BadRequest, match="(?i)message to edit not found"):
        await bot.edit_message_text("x", chat_id=1001, message_id=999)
    assert await bot.delete_message(chat_id=1001, message_id=sent.message_id) is True


async def test_fail_next_retry_after(tg: FakeTelegram, bot: telegram.Bot,
                                     monkeypatch: pytest.MonkeyPatch):
    tg.fail_next("sendMessage", 429, retry_after_body(3), times=2)
    tg.fail_next("sendChatAction", 400, bad_request_body("chat not found"))
    monkeypatch.delenv("PTB_TIMEDELTA", raising=False)  # conftest sets it; test the int form too
    # PTB 22.8 reads RetryAfter.retry_after inside RetryAfter.__init__, so without
    # PTB_TIMEDELTA even *constructing* the error emits PTBDeprecationWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", telegram.warnings.PTBDeprecationWarning)
        with pytest.raises(telegram.error.RetryAfter) as caught:
            await bot.send_message(chat_id=1001, text="hi")
        assert caught.value.retry_after == 3
    monkeypatch.setenv("PTB_TIMEDELTA", "true")
    with pytest.raises(telegram.error.RetryAfter) as caught:
        await bot.send_message(chat_id=1001, text="hi")
    assert caught.value.retry_after == dt.timedelta(seconds=3)
    with pytest.raises(telegram.error.BadRequest, match="(?i)chat not found"):
        await bot.send_chat_action(chat_id=1001, action="typing")
    assert (await bot.send_message(chat_id=1001, text="hi")).text == "hi"
    assert await bot.send_chat_action(chat_id=1001, action="typing") is True


async def test_command_push_carries_bot_command_entity(tg: FakeTelegram, bot: telegram.Bot):
    tg.push_text("/start@fake_bot now", chat_id=-100, user_id=7, chat_type="group")
    (update,) = await bot.get_updates(timeout=0)
    (entity,) = update.message.entities
    assert entity.type == telegram.MessageEntity.BOT_COMMAND
    assert update.message.parse_entity(entity) == "/start@fake_bot"
    assert (update.message.chat.type, update.message.from_user.id) == ("group", 7)


async def test_commands_roundtrip_and_validation(bot: telegram.Bot):
    assert await bot.set_my_commands([("start", "Start talking"), ("forget", "Forget me")])
    assert [c.command for c in await bot.get_my_commands()] == ["start", "forget"]
    with pytest.raises(telegram.error.BadRequest, match="(?i)bot_command_invalid"):
        await bot.set_my_commands([("Bad-Name", "nope")])
    assert await bot.delete_my_commands()
    assert await bot.get_my_commands() == ()


async def test_raw_http_errors(tg: FakeTelegram):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{tg.base_url}{tg.token}/noSuchMethod") as response:
            assert response.status == 404
            assert (await response.json())["description"] == "Not Found: method not found"
        async with http.post(f"{tg.base_url}9:WRONG/getMe") as response:
            assert response.status == 401
            assert await response.json() == {"ok": False, "error_code": 401,
                                             "description": "Unauthorized"}
        async with http.post(f"{tg.base_url}{tg.token}/sendMessage",
                             json={"chat_id": 1001, "text": "json body"}) as response:
            assert (await response.json())["result"]["text"] == "json body"
    assert tg.sent() == ["json body"]


async def test_wait_for_timeout_lists_calls(tg: FakeTelegram, bot: telegram.Bot):
    # The bot fixture's initialize() called getMe once
    with pytest.raises(AssertionError, match=r"sendMessage.*\{'getMe': 1\}"):
        await tg.wait_for("sendMessage", timeout=0.05)


async def test_application_handlers_reply_through_the_fake(tg: FakeTelegram):
    async def start(update: telegram.Update, _: ContextTypes.DEFAULT_TYPE) -> None:
        await update.message.reply_text("welcome")

    async def echo(update: telegram.Update, _: ContextTypes.DEFAULT_TYPE) -> None:
        await update.message.reply_text(f"echo: {update.message.text}")

    app = (ApplicationBuilder().token(tg.token).base_url(tg.base_url)
           .base_file_url(tg.base_file_url).build())
    app.add_handler(CommandHandler("start", start))
    app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, echo))
    async with app:
        await app.start()
        await app.updater.start_polling(poll_interval=0.0, timeout=1)
        tg.push_text("/start")
        last = tg.push_text("hi there")
        await tg.wait_for("sendMessage", n=2)
        await app.updater.stop()
        await app.stop()
    assert tg.sent(chat_id=1001) == ["welcome", "echo: hi there"]
    assert [c.method for c in tg.calls[:2]] == ["getMe", "deleteWebhook"]
    assert tg.confirmed_offset == last["update_id"] + 1 and tg.updates == []


async def test_subprocess_client_reaches_the_server(llm: FakeOpenAI):
    llm.push(text("from another process"))
    script = (
        "import json, sys, urllib.request\n"
        "messages = [{'role': 'user', 'content': 'hi'}]\n"
        "body = json.dumps({'model': 'test-model', 'messages': messages})\n"
        "req = urllib.request.Request(sys.argv[1] + '/chat/completions', body.encode(),\n"
        "                             {'Content-Type': 'application/json'})\n"
        "print(json.load(urllib.request.urlopen(req))['choices'][0]['message']['content'])\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, llm.base_url, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await asyncio.wait_for(process.communicate(), timeout=10)
    assert process.returncode == 0 and stdout.decode().strip() == "from another process"
