"""The agent loop (bumblebot/cognition/loop.py): what the model says reaches the user as said, and the
model decides when its turn is over.

Each case replays its failing input through the real python-telegram-bot and openai clients
against the fakes: a French promise the completion check once never saw, a joke cut after its
first line, a correction dropped as a repeat, a JSON answer dropped as "a call", character
references decoded, a looping turn that went silent after "checking", a say lost to a crash.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from conftest import running, write_config
from fakes.openai_server import (
    FakeOpenAI,
    Reply,
    error,
    is_aux,
    is_last_chance,
    is_loop,
    text,
    tool_calls,
)
from support import (
    Gate,
    contents,
    is_adequacy_judge,
    is_grounding_judge,
    judges_say_done,
    loop_requests,
    say,
    tool_result,
    until,
)

from bumblebot.cognition.notes import LOOPING_MESSAGE, SUPERSEDED_NOTE
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message
from bumblebot.store import Store


def streaming(tmp_path, llm, tg, **sections):
    return write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2}, **sections)


def written_slowly(reply: Reply) -> Reply:
    """A streamed reply whose says arrive a few characters at a time, over a second or so."""
    reply.stream_chars, reply.stream_delay = 4, 0.03
    return reply


def preview_calls(tg: Any) -> list[tuple[str, str | None]]:
    return [(c.method, c.params.get("text")) for c in tg.calls if c.method in ("sendMessage", "editMessageText", "deleteMessage")]


async def finished(d: Any, n: int = 1) -> dict[str, Any]:
    await d.engine.wait_for_turns(n)
    return (await d.store.recent_turns())[0]["trace"]


# -- the model decides when its turn ends --------------------------------------------------------


async def test_a_french_promise_gets_its_check_and_its_work(tmp_path, llm, tg):
    """"ajoute du lait à ma liste de courses", answered with a promise and end_turn: the check
    once ran only when an English pattern matched a promise, so nothing was ever added."""
    llm.push(say("D'accord, je vais l'ajouter à ta liste !"), when=is_loop)
    llm.push(text("CONTINUE: rien n'a été ajouté à la liste"), when=is_adequacy_judge)
    llm.push(
        tool_calls(("append_file", {"path": "courses.md", "content": "- lait\n"}), ("say", {"text": "C'est ajouté : lait."}),
                   ("end_turn", {})),
        when=lambda r: is_loop(r) and "was not done yet" in contents(r),
    )
    llm.push(text("DONE: the list holds lait"), when=is_grounding_judge)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("ajoute du lait à ma liste de courses", chat_id=301)
        trace = await finished(d)
        workspace = d.settings.workspace
    assert (workspace / "courses.md").read_text() == "- lait\n"
    assert tg.sent(301) == ["D'accord, je vais l'ajouter à ta liste !", "C'est ajouté : lait."]
    assert trace["route"] == "reflex" and [g["judge"] for g in trace["gate"]] == ["adequacy", "grounding"]
    [judge] = [r for r in llm.requests if is_adequacy_judge(r)]
    assert "ajoute du lait" in contents(judge) and "je vais l'ajouter" in contents(judge)
    nudge = loop_requests(llm)[1]["messages"][-1]["content"]
    assert "append_file" in nudge and "run_command" not in nudge  # only tools this turn offers
    assert not llm.unscripted


async def test_a_joke_announced_without_end_turn_arrives(tmp_path, llm, tg):
    """"tell me a joke": "Sure, here's one:" without end_turn ended the turn, and the joke never came."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Sure, here's one:"})), when=is_loop)
    llm.push(say("Why did the bee get married? Because he found his honey."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("tell me a joke", chat_id=302)
        trace = await finished(d)
    assert tg.sent(302) == ["Sure, here's one:", "Why did the bee get married? Because he found his honey."]
    assert trace["stop_reason"] == "end_turn" and len(loop_requests(llm)) == 2


async def test_eight_fun_facts_one_message_each_all_arrive(tmp_path, llm, tg):
    """Three arrived and the turn ended, though the model never ended it."""
    judges_say_done(llm)
    facts = [f"Fun fact {i}: bees have {i + 4} ways to say hello." for i in range(8)]
    for fact in facts[:-1]:
        llm.push(tool_calls(("say", {"text": fact})), when=is_loop)
    llm.push(say(facts[-1]), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "debounce_s": 0, "max_messages_per_turn": 8})
    async with running(config) as d:
        tg.push_text("tell me eight fun facts, one message each", chat_id=303)
        trace = await finished(d)
    assert tg.sent(303) == facts
    assert trace["stop_reason"] == "end_turn" and trace["cuts"] == []


async def test_past_the_message_cap_the_model_is_told_and_ends_its_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    facts = [f"Fun fact {i}." for i in range(6)]
    llm.push(tool_calls(*[("say", {"text": f}) for f in facts]), when=is_loop)
    llm.push(tool_calls(("end_turn", {})), when=lambda r: is_loop(r) and "the most it may" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("tell me six fun facts, one message each", chat_id=304)
        trace = await finished(d)
    assert tg.sent(304) == facts[:4]
    results = tool_result(loop_requests(llm)[1], "say")
    assert [bool(r.get("dropped")) for r in results] == [False] * 4 + [True] * 2
    assert [c["rule"] for c in trace["cuts"]] == ["message_cap", "message_cap"]
    assert trace["stop_reason"] == "end_turn"


# -- a person who has seen nothing: the next step is a say ----------------------------------------

NAMED_SAY = {"type": "function", "function": {"name": "say"}}


async def test_a_turn_ended_without_a_word_names_say_for_its_next_step(tmp_path, llm, tg):
    """SmolLM2-135M answered "what is the capital of France?" with end_turn three times, each
    sent back by the check, and the person's first words came from the last try without tools:
    four requests on a slow server, 105 s."""
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    llm.push(say("Paris."), when=lambda r: is_loop(r) and r.get("tool_choice") == NAMED_SAY)
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what is the capital of France?", chat_id=321)
        trace = await finished(d)
    assert tg.sent(321) == ["Paris."]
    first, second = loop_requests(llm)
    assert first["tool_choice"] != NAMED_SAY and second["tool_choice"] == NAMED_SAY
    assert [s["tool_choice"] for s in trace["steps"]] == ["required", "say"]
    assert trace["stop_reason"] == "end_turn" and not [r for r in llm.requests if is_last_chance(r)]


async def test_a_person_waiting_past_first_words_s_gets_a_say_next(tmp_path, llm, tg):
    """A slow server and a model that keeps calling tools: nothing reached the person for
    minutes. Past cognition.first_words_s the next step is a say; once words are out, the
    steps after it choose freely again."""
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "debounce_s": 0, "first_words_s": 0.5})
    workspace_files(config, {"a.txt": "a\n"})
    slow = tool_calls(("read_file", {"path": "a.txt"}))
    slow.delay = 0.6  # the first step alone outlasts first_words_s
    llm.push(slow, when=is_loop)
    llm.push(tool_calls(("say", {"text": "Still reading, one moment."})),
             when=lambda r: is_loop(r) and r.get("tool_choice") == NAMED_SAY)
    llm.push(say("a.txt says: a"), when=lambda r: is_loop(r) and r.get("tool_choice") != NAMED_SAY)
    async with running(config) as d:
        tg.push_text("what does a.txt say?", chat_id=322)
        trace = await finished(d)
    assert tg.sent(322) == ["Still reading, one moment.", "a.txt says: a"]
    assert [s["tool_choice"] for s in trace["steps"]] == ["required", "say", "required"]


async def test_a_quick_turn_is_never_told_to_say(tmp_path, llm, tg):
    """The deadline is a bound, not a target: a step that calls a tool first on a fast
    endpoint is followed by steps the model chooses."""
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    workspace_files(config, {"a.txt": "a\n"})
    llm.push(tool_calls(("read_file", {"path": "a.txt"})), when=is_loop)
    llm.push(say("a.txt says: a"), when=is_loop)
    async with running(config) as d:
        tg.push_text("what does a.txt say?", chat_id=323)
        trace = await finished(d)
    assert tg.sent(323) == ["a.txt says: a"]
    assert all(r["tool_choice"] == "required" for r in loop_requests(llm))
    assert len(trace["steps"]) == 2


async def test_an_endpoint_refusing_a_named_tool_choice_gets_its_usual_one(tmp_path, tg):
    """A server that takes only "auto", "none" or "required": the request goes again at once
    with its usual choice, and no named one is sent again (remembered in the store)."""
    async with FakeOpenAI(reject_named_tool_choice=400) as llm:
        llm.push(tool_calls(("end_turn", {})), when=is_loop)
        llm.push(say("Paris."), when=is_loop)
        llm.push(tool_calls(("end_turn", {})), when=is_loop)
        llm.push(say("Rome."), when=is_loop)
        judges_say_done(llm)
        async with running(write_config(tmp_path, llm, tg)) as d:
            tg.push_text("what is the capital of France?", chat_id=324)
            await d.engine.wait_for_turns(1)
            tg.push_text("and of Italy?", chat_id=324)
            await d.engine.wait_for_turns(2)
            remembered = await d.store.get_kv(f"llm.named_choice:{llm.base_url}")
        assert tg.sent(324) == ["Paris.", "Rome."]
        assert [r.get("tool_choice") for r in llm.rejected] == [NAMED_SAY]
        assert "HTTP 400" in json.loads(remembered)["reason"]


async def test_one_passing_500_on_a_named_request_does_not_turn_naming_off(tmp_path, llm, tg):
    """An endpoint that had taken a named tool_choice failed one with a 500: named choices were
    turned off for a day."""
    judges_say_done(llm)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    llm.push(say("Paris."), when=lambda r: is_loop(r) and r.get("tool_choice") == NAMED_SAY)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    llm.push(error(500, "upstream hiccup"), when=lambda r: is_loop(r) and r.get("tool_choice") == NAMED_SAY)
    llm.push(say("Rome."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("capital of France?", chat_id=325)
        await d.engine.wait_for_turns(1)
        tg.push_text("and of Italy?", chat_id=325)
        await d.engine.wait_for_turns(2)
        remembered = await d.store.get_kv(f"llm.named_choice:{llm.base_url}")
    assert tg.sent(325) == ["Paris.", "Rome."]
    assert remembered is None


async def test_tool_choice_auto_in_the_config_never_names_a_tool(tmp_path, llm, tg):
    """"llm.tool_choice: auto" means never forced, yet the say was named."""
    judges_say_done(llm)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    llm.push(say("Paris."), when=is_loop)
    config = write_config(tmp_path, llm, tg, llm={"base_url": llm.base_url, "model": "test-model",
                                                   "reflex_model": "reflex-model", "max_retries": 0,
                                                   "timeout_s": 10, "tool_choice": "auto"})
    async with running(config) as d:
        tg.push_text("capital of France?", chat_id=326)
        await finished(d)
    assert tg.sent(326) == ["Paris."]
    assert [r.get("tool_choice") for r in loop_requests(llm)] == ["auto", "auto"]


# -- delivery: as the model wrote it -------------------------------------------------------------


async def test_a_corrected_near_identical_message_arrives(tmp_path, llm, tg):
    """The correction was dropped as a repeat and the model told it had already said it."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The plan: buy milk, eggs and bread."})), when=is_loop)
    llm.push(say("The plan: buy milk, eggs and rice."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what's the plan?", chat_id=305)
        trace = await finished(d)
    assert tg.sent(305) == ["The plan: buy milk, eggs and bread.", "The plan: buy milk, eggs and rice."]
    assert tool_result(loop_requests(llm)[1], "say") == [{"delivered": True, "queued": False}]
    assert trace["cuts"] == []


async def test_an_exact_repeat_is_sent_once_and_the_model_told(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The plan: buy milk."})), when=is_loop)
    llm.push(say("the plan:   BUY milk."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what's the plan?", chat_id=306)
        trace = await finished(d)
    assert tg.sent(306) == ["The plan: buy milk."]
    assert [c["rule"] for c in trace["cuts"]] == ["exact_repeat"]
    [(result,)] = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT content FROM messages WHERE role='tool' AND name='say' ORDER BY id DESC LIMIT 1").fetchall()
    assert "already said this" in json.loads(result)["note"]


async def test_a_json_answer_arrives_unchanged(tmp_path, llm, tg):
    """The say `{"name": "Bob", "age": 3}` was dropped as "a tool call written as text", and
    the check then asked for a visible reply that never came."""
    judges_say_done(llm)
    answer = '{"name": "Bob", "age": 3}'
    llm.push(say(answer), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("give me a JSON object for a person named Bob aged 3", chat_id=307)
        trace = await finished(d)
    assert tg.sent(307) == [answer]
    assert trace["cuts"] == [] and trace["stop_reason"] == "end_turn"


async def test_a_call_written_as_text_naming_an_offered_tool_is_not_delivered(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": '{"name": "read_file", "arguments": {"path": "notes.md"}}'})), when=is_loop)
    llm.push(say("Your notes are empty."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what's in my notes?", chat_id=308)
        trace = await finished(d)
    assert tg.sent(308) == ["Your notes are empty."]
    assert [c["rule"] for c in trace["cuts"]] == ["call_as_text"]


async def test_character_references_arrive_as_written(tmp_path, llm, tg):
    """"write &amp;amp; to show &amp;" arrived as "write & to show &"."""
    judges_say_done(llm)
    explanation = "In HTML, write &amp;amp; to show &amp; and `&lt;` for <. I&#39;m sure."
    llm.push(say(explanation), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how do I show an ampersand in HTML?", chat_id=309)
        await finished(d)
    assert tg.sent(309) == ["In HTML, write &amp;amp; to show &amp; and &lt; for <. I&#39;m sure."]  # the code span is an entity, not text


async def test_engine_notes_echoed_by_a_weak_model_are_removed_and_traced(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "missing.md"})), when=is_loop)
    llm.push(
        say("[Same turn] Tool results are ready; failed: read_file. The file does not exist yet."),
        when=lambda r: is_loop(r) and "Tool results are ready; failed: read_file." in contents(r),
    )
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("read missing.md", chat_id=310)
        trace = await finished(d)
    assert tg.sent(310) == ["The file does not exist yet."]
    assert [c["rule"] for c in trace["cuts"]] == ["engine_echo"]


# -- a turn that stops at a limit ---------------------------------------------------------------


def looping_model(request: dict[str, Any]) -> Reply:
    """``[say("checking"), read_file(same file)]`` for ever."""
    if is_last_chance(request):
        return error(500, "no closing words from this model")
    if is_aux(request):
        return text("DONE: fine")
    return tool_calls(("say", {"text": "checking"}), ("read_file", {"path": "plan.md"}))


async def test_a_looping_turn_ends_with_an_honest_message_and_no_preview_flicker(tmp_path, llm, tg):
    """The user saw "checking" and then nothing, and three previews of the dropped "checking"
    flashed up and vanished."""
    llm.default = looping_model
    async with running(streaming(tmp_path, llm, tg)) as d:
        tg.push_text("check my plan please", chat_id=311)
        trace = await finished(d)
    assert tg.shown(311) == ["checking", LOOPING_MESSAGE]
    assert not any(c.method == "deleteMessage" for c in tg.calls)  # nothing flashed up and went
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 2
    assert trace["stop_reason"] == "looping" and trace["told"] == "note"


async def test_a_model_talking_on_past_the_message_cap_stops_at_its_first_refused_step(tmp_path, llm, tg):
    """SmolLM2-135M answered "hi" with four messages, then three more steps of says that could
    not be delivered (each a minute on a busy one-slot server) before the turn ended."""
    judges_say_done(llm)
    for i in range(4):
        llm.push(tool_calls(("say", {"text": f"Hello number {i}!"})), when=is_loop)
    for i in range(3):
        llm.push(tool_calls(("say", {"text": f"And more {i}!"})), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=330)
        trace = await finished(d)
    assert tg.sent(330) == [f"Hello number {i}!" for i in range(4)]
    assert trace["stop_reason"] == "looping" and len(trace["steps"]) == 5
    assert [c["rule"] for c in trace["cuts"]] == ["message_cap"]
    assert llm.pending == 2  # two of the refused says never asked for


async def test_a_thought_at_the_message_cap_does_not_end_a_turn_with_work_left(tmp_path, llm, tg):
    """Four progress messages, then a step that only thinks before the work: the turn ended as
    looping there, and the file was never written."""
    judges_say_done(llm)
    for i in range(4):
        llm.push(tool_calls(("say", {"text": f"Progress {i}"})), when=is_loop)
    llm.push(tool_calls(("think", {"thought": "now write the file"})), when=is_loop)
    llm.push(tool_calls(("write_file", {"path": "notes.txt", "content": "hello"})), when=is_loop)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        tg.push_text("write notes.txt saying hello, and tell me how it goes", chat_id=331)
        trace = await finished(d)
        workspace = d.settings.workspace
    assert (workspace / "notes.txt").read_text() == "hello", trace["stop_reason"]
    assert trace["stop_reason"] == "end_turn"


async def test_closing_words_come_from_the_model_in_the_user_s_language(tmp_path, llm, tg):
    def model(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return text("Je me suis arrêté : je tournais en rond sur plan.md. Redis-moi si je dois continuer.")
        return looping_model(request)

    llm.default = model
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("vérifie mon plan s'il te plaît", chat_id=312)
        trace = await finished(d)
    assert tg.sent(312) == ["checking", "Je me suis arrêté : je tournais en rond sur plan.md. Redis-moi si je dois continuer."]
    assert trace["told"] == "model"
    [closing] = [r for r in llm.requests if is_last_chance(r)]
    assert "tools" not in closing and "language they wrote in" in contents(closing)


async def test_a_scheduled_turn_that_stops_at_a_limit_stays_silent(tmp_path, llm, tg):
    llm.default = lambda r: tool_calls(("think", {"thought": "hmm"})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        chat = ChatRef(Platform.TELEGRAM, "313")
        await d.engine.submit(Inbound(chat, "task:1:0", "313", "Ann", "[Scheduled task] check the plan",
                                      ChatKind.PRIVATE, source="automation"))
        trace = await finished(d)
    assert tg.sent(313) == [] and (trace["stop_reason"], trace["stop_flags"]) == ("looping", ["silent"])
    assert not [r for r in llm.requests if is_last_chance(r)]


# -- a crash between recording a say and delivering it ---------------------------------------------


async def test_a_say_recorded_before_a_crash_is_delivered_as_recorded_once(tmp_path, llm, tg):
    """The resumed turn told the model the say was "interrupted before it was sent", and a
    model that never repeats itself left the user unanswered."""
    chat = ChatRef(Platform.TELEGRAM, "314")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "314", "Ann", "what's 2+2?", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        state = {"route": "reflex", "route_reason": "brief", "resumes": 0, "active": True}
        turn_id = await store.begin_turn(
            conversation.id, conversation.session, [journal_id], Message(role="user", content="what's 2+2?"), state
        )
        step = Message(role="assistant", content="", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "It is 4."}'}},
            {"id": "c2", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}},
        ])
        await store.record(conversation.id, conversation.session, turn_id, [step], state=state)
        # the crash: the step is recorded, its say never reached the outbox

    def never_repeats(request: dict[str, Any]) -> Reply:
        return tool_calls(("end_turn", {})) if is_loop(request) else text("DONE: answered")

    llm.default = never_repeats
    async with running(write_config(tmp_path, llm, tg)) as d:
        await d.engine.wait_for_turns(1)
        status = await d.store._all("SELECT status FROM journal")
    assert tg.sent(314) == ["It is 4."]
    assert [tuple(r) for r in status] == [("done",)]
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT content FROM messages WHERE role='tool' AND tool_call_id='c1'").fetchall()
    assert [json.loads(r[0]) for r in rows] == [{"delivered": True, "queued": False}]  # history shows it delivered
    assert loop_requests(llm) == []  # the recorded end_turn went to the check, which accepted it


# -- regressions, each with its failing input ----------------------------------------------------


async def test_a_message_sent_while_a_turn_is_at_its_cap_gets_its_own_turn(tmp_path, llm, tg):
    """Taken into a turn that could say no more, "also, what's 2+2?" was never answered."""
    judges_say_done(llm)
    first = Gate(tool_calls(*[("say", {"text": f"Fact {i}."}) for i in range(4)], ("read_file", {"path": "x.md"})))
    llm.push(first, when=is_loop)
    llm.push(tool_calls(("end_turn", {})), when=lambda r: is_loop(r) and "Fact 3." in contents(r) and "2+2" not in contents(r))
    llm.push(say("2+2 is 4."), when=lambda r: is_loop(r) and "what's 2+2" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("four facts please", chat_id=401)
        await first.entered.wait()
        tg.push_text("also, what's 2+2?", chat_id=401)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        first.release.set()
        await d.engine.wait_for_turns(2)
        capped = (await d.store.recent_turns())[-1]["trace"]
    assert tg.sent(401) == [f"Fact {i}." for i in range(4)] + ["2+2 is 4."]
    assert not llm.unscripted
    # it could say no more: it ended with the message waiting, the model not asked again
    assert capped["stop_reason"] == "message_waiting"
    assert len([r for r in loop_requests(llm) if "2+2" not in contents(r)]) == 1


def four_facts() -> Reply:
    """A step that says four messages: a turn at its message cap (4)."""
    return tool_calls(*[("say", {"text": f"Fact {i}."}) for i in range(4)])


FOUR_SAYS_AND_A_LOOK = tool_calls(*[("say", {"text": f"Line {i}."}) for i in range(4)], ("list_directory", {"path": "."}))


async def test_a_message_ends_a_capped_turn_after_the_step_in_flight(tmp_path, llm, tg):
    """SmolLM2-135M at its cap kept calling list_directory, one slow step after another, while
    "good night" waited for the turn to end: it got no answer within 600 s. The step in flight
    when the message came is work the model decided on: it runs, and the turn ends there."""
    judges_say_done(llm)
    llm.push(four_facts(), when=is_loop)
    save = Gate(tool_calls(("write_file", {"path": "facts.md", "content": "facts\n"})))
    llm.push(save, when=lambda r: is_loop(r) and "thanks" not in contents(r))
    llm.push(say("You're welcome!"), when=lambda r: is_loop(r) and "thanks" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("tell me four facts and save them to facts.md", chat_id=404)
        await save.entered.wait()
        tg.push_text("thanks!", chat_id=404)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        save.release.set()
        await d.engine.wait_for_turns(2)
        turns = await d.store.recent_turns()
        workspace = d.settings.workspace
    assert (workspace / "facts.md").read_text() == "facts\n"
    assert tg.sent(404) == [f"Fact {i}." for i in range(4)] + ["You're welcome!"]
    assert turns[-1]["trace"]["stop_reason"] == "message_waiting" and len(turns[-1]["trace"]["steps"]) == 2
    # the next turn is told the previous one ended before the model ended it
    [answer] = [r for r in loop_requests(llm) if "thanks" in contents(r)]
    assert SUPERSEDED_NOTE in contents(answer)
    assert not llm.unscripted


async def test_a_paused_chat_s_capped_turn_finishes_though_a_message_waits(tmp_path, llm, tg):
    """Paused, "the turn running now finishes": a message that waits for the resume ended it
    at its cap, and the log it was writing was never written."""
    judges_say_done(llm)
    llm.push(four_facts(), when=is_loop)
    work = Gate(tool_calls(("write_file", {"path": "log.md", "content": "done\n"})))
    llm.push(work, when=is_loop)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("four facts, then log it", chat_id=407)
        await work.entered.wait()
        await d.engine.operate(ChatRef(Platform.TELEGRAM, "407"), "pause")
        tg.push_text("hello?", chat_id=407)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        work.release.set()
        await d.engine.wait_for_turns(1)
        turns = await d.store.recent_turns()
        workspace = d.settings.workspace
    assert (workspace / "log.md").read_text() == "done\n"
    assert turns[-1]["trace"]["stop_reason"] == "end_turn"


async def test_a_capped_turn_s_cut_step_is_not_asked_again_while_a_message_waits(tmp_path, llm, tg):
    """At the cap, a reflex step cut at its budget was asked again with the deliberate one
    (2,048 tokens) while "good night" waited for it."""
    judges_say_done(llm)
    llm.push(four_facts(), when=is_loop)
    cut = Gate(text("and one more thing about", finish_reason="length"))
    llm.push(cut, when=lambda r: is_loop(r) and "good night" not in contents(r))
    llm.push(say("Good night!"), when=lambda r: is_loop(r) and "good night" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi, four facts", chat_id=408)
        await cut.entered.wait()
        tg.push_text("good night", chat_id=408)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        cut.release.set()
        await d.engine.wait_for_turns(2)
        turns = await d.store.recent_turns()
    assert tg.sent(408) == [f"Fact {i}." for i in range(4)] + ["Good night!"]
    assert turns[-1]["trace"]["route"] == "reflex" and turns[-1]["trace"]["stop_reason"] == "message_waiting"
    assert len([r for r in loop_requests(llm) if "good night" not in contents(r)]) == 2
    assert len(turns[-1]["trace"]["steps"]) == 2  # the cut step was answered: the trace keeps it
    assert not llm.unscripted


async def test_a_message_ends_a_capped_turn_whose_request_waits_for_the_slot(tmp_path, llm, tg):
    """On a one-slot endpoint the capped turn's next request queued behind another chat's,
    and the message that came meanwhile waited for both."""
    judges_say_done(llm)
    first, other = Gate(FOUR_SAYS_AND_A_LOOK), Gate(say("Hello there."))
    llm.push(first, when=lambda r: is_loop(r) and "four things" in contents(r))
    llm.push(other, when=lambda r: is_loop(r) and "hello" in contents(r))
    llm.push(say("Good night!"), when=lambda r: is_loop(r) and "good night" in contents(r))
    config = write_config(tmp_path, llm, tg, llm={"max_concurrent_requests": 1})
    async with running(config) as d:
        endpoint = d.llm.primary
        tg.push_text("tell me four things", chat_id=405)
        await first.entered.wait()
        tg.push_text("hello", chat_id=406)
        await until(lambda: endpoint.waiting == 1)
        first.release.set()
        await other.entered.wait()  # the other chat holds the one slot...
        await until(lambda: endpoint.waiting == 1)  # ...and the capped turn's next step waits for it
        tg.push_text("good night", chat_id=405)
        await d.engine.wait_for_turns(1)  # the capped turn ended, its request never sent
        other.release.set()
        await d.engine.wait_for_turns(3)
        turns = await d.store.recent_turns()
    assert tg.sent(405) == [f"Line {i}." for i in range(4)] + ["Good night!"]
    assert [t["trace"]["stop_reason"] for t in turns][::-1] == ["message_waiting", "end_turn", "end_turn"]
    chat_405 = [r for r in loop_requests(llm) if "four things" in contents(r)]
    assert len([r for r in chat_405 if "good night" not in contents(r)]) == 1
    assert not llm.unscripted


async def capped_turn_waiting_for_the_slot(d: Any, llm: Any, tg: Any, chat: int, other_chat: int) -> Gate:
    """A turn of ``chat`` at its cap whose next request waits for the one slot, which a turn
    of ``other_chat`` holds until the returned gate is released."""
    first, other = Gate(FOUR_SAYS_AND_A_LOOK), Gate(say("Hello there."))
    llm.push(first, when=lambda r: is_loop(r) and "four things" in contents(r))
    llm.push(other, when=lambda r: is_loop(r) and "hello" in contents(r))
    endpoint = d.llm.primary
    tg.push_text("tell me four things", chat_id=chat)
    await first.entered.wait()
    tg.push_text("hello", chat_id=other_chat)
    await until(lambda: endpoint.waiting == 1)
    first.release.set()
    await other.entered.wait()
    await until(lambda: endpoint.waiting == 1)
    return other


async def test_stop_of_a_capped_turn_waiting_for_the_slot_leaves_the_slot_to_others(tmp_path, llm, tg):
    """/stop while the capped turn's request waited for the one slot: the slot went to that
    request's dead place, and the endpoint answered no chat again."""
    judges_say_done(llm)
    llm.push(say("Later answer."), when=lambda r: is_loop(r) and "anyone there" in contents(r))
    async with running(write_config(tmp_path, llm, tg, llm={"max_concurrent_requests": 1})) as d:
        other = await capped_turn_waiting_for_the_slot(d, llm, tg, 409, 410)
        tg.push_text("/stop", chat_id=409)
        await d.engine.wait_for_turns(1)
        other.release.set()
        await d.engine.wait_for_turns(2)
        tg.push_text("anyone there?", chat_id=411)
        await d.engine.wait_for_turns(3)
        waiting = d.llm.primary.waiting
    assert tg.sent(411) == ["Later answer."] and waiting == 0


async def test_two_equal_says_in_one_step_show_one_preview(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(written_slowly(say("Here is the answer you wanted.", "Here is the answer you wanted.")), when=is_loop)
    async with running(streaming(tmp_path, llm, tg)) as d:
        tg.push_text("answer me", chat_id=402)
        trace = await finished(d)
    assert tg.shown(402) == ["Here is the answer you wanted."]
    assert not any(method == "deleteMessage" for method, _ in preview_calls(tg))
    assert [c["rule"] for c in trace["cuts"]] == ["exact_repeat"]


async def test_a_say_that_only_echoes_the_engine_note_is_never_previewed(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "missing.md"})), when=is_loop)
    llm.push(written_slowly(tool_calls(("say", {"text": "[Same turn] Tool results are ready; failed: read_file."}))),
             when=lambda r: is_loop(r) and len(loop_requests(llm)) == 2)
    llm.push(say("The file does not exist."), when=is_loop)
    async with running(streaming(tmp_path, llm, tg)) as d:
        tg.push_text("read missing.md", chat_id=403)
        await finished(d)
    assert tg.shown(403) == ["The file does not exist."]
    assert [t for method, t in preview_calls(tg) if method == "sendMessage"] == ["The file does not exist."]
    assert not any(method == "deleteMessage" for method, _ in preview_calls(tg))


async def test_a_reply_asked_again_with_a_bigger_budget_keeps_its_message(tmp_path, llm, tg):
    """The cut reply's preview was deleted and a new one sent: it flashed."""
    judges_say_done(llm)
    cut = Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hi! So, about the garden, th'}}]},
        finish_reason="length")
    llm.push(written_slowly(cut), when=is_loop)
    llm.push(written_slowly(say("Hi! So, about the garden, the tomatoes need sun.")), when=is_loop)
    async with running(streaming(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=404)
        await finished(d)
    assert tg.shown(404) == ["Hi! So, about the garden, the tomatoes need sun."]
    assert len([1 for method, _ in preview_calls(tg) if method == "sendMessage"]) == 1
    assert not any(method == "deleteMessage" for method, _ in preview_calls(tg))


async def test_a_held_say_keeps_its_place_before_a_later_one(tmp_path, llm, tg):
    """"The plan: buy milk" was held (it began like a delivered message) and arrived after the
    say that followed it."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The plan: buy milk, eggs and bread."})), when=is_loop)
    llm.push(written_slowly(say("The plan: buy milk", "Anything else you need today?")), when=is_loop)
    async with running(streaming(tmp_path, llm, tg)) as d:
        tg.push_text("what's the plan?", chat_id=405)
        await finished(d)
    assert tg.shown(405) == ["The plan: buy milk, eggs and bread.", "The plan: buy milk", "Anything else you need today?"]


async def test_a_sentence_the_note_quotes_from_the_model_is_not_an_engine_echo(tmp_path, llm, tg):
    """The post-tool note quotes what the model said; those sentences were taken for the
    engine's own and "Let me look." was never sent."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Sure. Let me look. Back soon."}), ("read_file", {"path": "a.md"})), when=is_loop)
    llm.push(tool_calls(("say", {"text": "Let me look."}), ("read_file", {"path": "b.md"})), when=is_loop)
    llm.push(say("Both files are missing."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("look at a.md and b.md", chat_id=406)
        trace = await finished(d)
    assert tg.sent(406) == ["Sure. Let me look. Back soon.", "Let me look.", "Both files are missing."]
    assert trace["cuts"] == []


async def test_prose_about_the_tool_call_tag_arrives(tmp_path, llm, tg):
    judges_say_done(llm)
    answer = "<tool_call> is the tag Hermes templates use to wrap a function call."
    llm.push(say(answer), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what is <tool_call>?", chat_id=407)
        await finished(d)
    assert tg.sent(407) == [answer]


def workspace_files(config: Any, names: dict[str, str]) -> None:
    from bumblebot.core.config import load_settings

    workspace = load_settings(config).workspace
    workspace.mkdir(parents=True, exist_ok=True)
    for name, body in names.items():
        (workspace / name).write_text(body)


async def test_files_count_against_the_message_cap(tmp_path, llm, tg):
    """Six send_file calls and a say sent seven messages past a cap of four."""
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    workspace_files(config, {f"f{i}.txt": f"file {i}\n" for i in range(6)})
    llm.push(tool_calls(*[("send_file", {"path": f"f{i}.txt", "caption": f"File {i}"}) for i in range(6)],
                        ("say", {"text": "All six files sent."}), ("end_turn", {})), when=is_loop)
    async with running(config) as d:
        tg.push_text("send me all six files", chat_id=408)
        trace = await finished(d)
    files = [c for c in tg.calls if c.method in ("sendDocument", "sendPhoto")]
    assert len(files) == 4 and tg.sent(408) == []
    assert [c["rule"] for c in trace["cuts"]] == ["message_cap"] * 3


async def test_a_file_with_a_caption_is_a_visible_reply(tmp_path, llm, tg):
    """The check saw "nothing was said" and the user got the file and then "Sorry, I couldn't
    put an answer together"."""
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    workspace_files(config, {"report.txt": "report\n"})
    llm.push(tool_calls(("send_file", {"path": "report.txt", "caption": "Here is your report."}), ("end_turn", {})),
             when=is_loop)
    async with running(config) as d:
        tg.push_text("send me report.txt", chat_id=409)
        trace = await finished(d)
    assert trace["stop_reason"] == "end_turn" and len(loop_requests(llm)) == 1
    [judge] = [r for r in llm.requests if is_grounding_judge(r)]
    assert "Here is your report.\n[file report.txt]" in contents(judge)
    assert tg.sent(409) == []  # the caption went with the document


async def test_a_say_that_renders_to_nothing_is_not_delivered_and_the_model_told(tmp_path, llm, tg):
    """An HTML comment renders to an empty message: nothing was sent, yet it counted as the answer."""
    judges_say_done(llm)
    llm.push(say("<!-- I will answer below -->"), when=is_loop)
    llm.push(say("Hello! How can I help?"), when=lambda r: is_loop(r) and "renders to an empty message" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=410)
        trace = await finished(d)
    assert tg.sent(410) == ["Hello! How can I help?"]
    assert trace["stop_reason"] == "end_turn" and not llm.unscripted


async def test_a_check_that_hangs_is_given_up_within_the_request_timeout(tmp_path, llm, tg):
    """With the client's retries a hanging check held the chat for minutes."""
    llm.push(say("Hello!"), when=is_loop)
    llm.default = lambda r: text("DONE: ok", delay=30.0)
    config = write_config(tmp_path, llm, tg, llm={"base_url": llm.base_url, "model": "test-model",
                                                  "reflex_model": "reflex-model", "max_retries": 2, "timeout_s": 1})
    async with running(config) as d:
        tg.push_text("hi", chat_id=411)
        trace = await finished(d)
    assert tg.sent(411) == ["Hello!"]
    [gate] = trace["gate"]
    assert gate["done"] and "TimeoutError" in gate["reason"]  # cut at 1 s, not after three 1 s tries


# -- the model's last word as plain text (an endpoint that does not force tools) ---------------


async def test_a_final_reply_that_repeats_a_say_is_neither_sent_nor_stored(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "the answer is 4."})), when=is_loop)
    llm.push(text("The answer is 4."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("2+2?", chat_id=5)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assistant_texts = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='assistant'")]
    assert "The answer is 4." not in assistant_texts


async def test_a_final_reply_after_say_is_delivered_as_the_model_wrote_it(tmp_path, llm, tg):
    """What the model says after its answer is its own to say: no list of "filler" phrases
    decides that a closing question is not worth sending."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The answer is 42."})), when=is_loop)
    llm.push(text("Anything else I can help you with today?"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how does the build pipeline in the repo work?", chat_id=14)
        await d.engine.wait_for_turns(1)
    assert tg.sent(14) == ["The answer is 42.", "Anything else I can help you with today?"]


async def test_a_new_answer_after_a_say_is_delivered_on_endpoints_without_forcing(tmp_path, tg):
    """Regression: with tool_choice=auto the real answer came as plain text after a say and was dropped."""
    from fakes.openai_server import FakeOpenAI

    async with FakeOpenAI(reject_tool_choice_required=400) as llm:
        judges_say_done(llm)
        llm.push(tool_calls(("say", {"text": "Good question! Let me think."})), when=is_loop)
        llm.push(text("The capital of Australia is Canberra."), when=is_loop)
        async with running(write_config(tmp_path, llm, tg)):
            # deliberate ("research"): a reflex turn would end at its first say
            tg.push_text("look up the capital of Australia", chat_id=21)
            await tg.wait_for("sendMessage", n=2)
    assert tg.sent(21) == ["Good question! Let me think.", "The capital of Australia is Canberra."]


async def test_a_plain_final_text_that_repeats_a_say_exactly_is_not_sent_again(tmp_path, llm, tg):
    """An endpoint not forcing tools: the model's plain last word repeats what it said (case
    and spacing aside), so it is not sent twice; a different last word would be."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Hey! I'm good, thanks"})), when=is_loop)
    llm.push(text("hey!  I'm good,\nthanks"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how are you?", chat_id=95)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert tg.sent(95) == ["Hey! I'm good, thanks"]
    assert [c["rule"] for c in trace["cuts"]] == ["exact_repeat"]


async def test_the_final_text_is_sent_when_say_only_carried_a_progress_note(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "One moment, let me think."})), when=is_loop)
    llm.push(text("The capital of Australia is Canberra."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("capital of Australia?", chat_id=96)
        await d.engine.wait_for_turns(1)
    assert tg.sent(96) == ["One moment, let me think.", "The capital of Australia is Canberra."]


# -- budgets, promises and endings -------------------------------------------------------------


async def test_a_say_cut_by_the_reflex_budget_is_asked_again_with_the_deliberate_one(tmp_path, llm, tg):
    """A say cut at the reflex budget (finish_reason "length", arguments cut mid-string) is asked
    again with the deliberate budget, not failed as invalid JSON."""
    judges_say_done(llm)
    cut = Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hi! So, abo'}}]},
        finish_reason="length")
    llm.push(cut, when=is_loop)
    llm.push(say("Hi! So, about that: here is the whole answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=98)  # a greeting: reflex
        await d.engine.wait_for_turns(1)
    first, second = loop_requests(llm)[:2]
    assert first["max_tokens"] == 512 and second["max_tokens"] == 2048
    assert first["messages"] == second["messages"]  # the same request, nothing run in between
    assert tg.sent(98) == ["Hi! So, about that: here is the whole answer."]
    import sqlite3

    [(trace,)] = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT trace FROM turns").fetchall()
    step = json.loads(trace)["steps"][0]
    assert step["escalated"] is True and step["finish_reason"] == "tool_calls"  # regression: traced before the retry


async def test_a_reflex_promise_is_not_the_reply(tmp_path, llm, tg):
    """A reflex turn ("hi") does not end at say("On it!") because the judge said DONE: the model
    goes on to its reply."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "On it!"})), when=is_loop)
    llm.push(say("Hi there, hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=85)
        await d.engine.wait_for_turns(1)
    assert tg.sent(85) == ["On it!", "Hi there, hello!"]


async def test_hollow_promises_end_with_an_honest_message(tmp_path, llm, tg):
    """say("On it!"), then two gate continues: the turn ends with an honest message that the
    work was not done (the gate once failed open there and the user got only the promise)."""

    def judge(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return error(500, "no closing words from this model")
        if is_aux(request):
            return text("CONTINUE: the file was never written")
        return say("On it!")

    llm.default = judge
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("write hello.py that prints hi", chat_id=97)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    sent = tg.sent(97)
    assert sent[0] == "On it!" and "didn't get that done" in sent[-1] and "never written" in sent[-1]
    assert len(sent) == 2 and (trace["stop_reason"], trace["stop_flags"]) == ("end_turn", ["unfinished"])
    assert trace["told"] == "note"


async def test_promises_that_end_by_looping_get_the_honest_message(tmp_path, llm, tg):
    """A turn that only promises and then loops ends with the message that says the work was not
    done."""
    from bumblebot.cognition.notes import LOOPING_MESSAGE

    def reply(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return error(500, "no closing words from this model")
        if is_aux(request):
            return text("CONTINUE: the file was never written")
        return tool_calls(("say", {"text": "On it! Writing the file now."}))  # repeats, never ends

    llm.default = reply
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("write hello.py that prints hi", chat_id=84)
        await d.engine.wait_for_turns(1)
    sent = tg.sent(84)
    assert sent == ["On it! Writing the file now.", LOOPING_MESSAGE]


async def test_a_turn_that_fills_the_window_after_answering_says_it_stopped(tmp_path, llm, tg):
    """Regression (real SmolLM2 run): a turn that had answered, then kept going until the
    window was full, told the user "this conversation got too long, send /reset" after its
    answer. It stopped without the model ending it: the user is told so, and that the next
    message goes on."""
    from bumblebot.cognition.notes import CONTEXT_FULL_MESSAGE

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Done: notes.txt has your list."})), when=is_loop)
    llm.push(error(400, "This model's maximum context length is 4096 tokens"), when=is_loop)
    llm.push(error(400, "This model's maximum context length is 4096 tokens"), when=is_loop)
    llm.push(say("Next answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("make my notes file", chat_id=92)  # deliberate ("file"): it goes on after its say
        await d.engine.wait_for_turns(1)
        tg.push_text("and now?", chat_id=92)
        await d.engine.wait_for_turns(2)
    assert tg.sent(92) == ["Done: notes.txt has your list.", CONTEXT_FULL_MESSAGE, "Next answer."]
    import sqlite3

    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT status, json_extract(trace, '$.stop_reason') FROM turns ORDER BY id").fetchall()
    assert rows[0] == ("done", "context_full")


async def test_a_model_that_never_ends_its_turn_is_bounded_by_the_message_cap(tmp_path, llm, tg):
    """What the real SmolLM2 run showed: "hi" got greeting after greeting, one per step; the
    model never called end_turn. A delivered message does not end a turn, so the turn's
    message cap bounds it: the model is told, and the turn stops at the first step after it
    that brings nothing new."""
    judges_say_done(llm)
    greetings = iter(["Hello Alice, how are you today?", "How are you today, Alice?", "Hello again!", "Hi!"])
    llm.default = lambda r: tool_calls(("say", {"text": next(greetings, "Hi!")})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=93)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    greeted = ["Hello Alice, how are you today?", "How are you today, Alice?", "Hello again!", "Hi!"]
    assert tg.sent(93) == greeted  # the cap counts every message: no stop note past it
    assert trace["stop_reason"] == "looping" and trace["told"] is None and len(loop_requests(llm)) == 5
    assert {c["rule"] for c in trace["cuts"]} == {"exact_repeat"}


# -- the tool-less last try for a plain answer -------------------------------------------------


async def test_a_model_that_only_loops_on_tools_still_gets_a_plain_answer_out(tmp_path, llm, tg):
    """Regression (real run): "hello there!" got "Sorry, I got stuck" after the model listed an
    empty directory four times; one tool-less request gets the answer out instead."""
    from fakes.openai_server import is_last_chance

    llm.push(text("Hello! Nice to meet you."), when=is_last_chance)
    llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=94)
        await d.engine.wait_for_turns(1)
    assert tg.sent(94) == ["Hello! Nice to meet you."]
    [last] = [r for r in llm.requests if is_last_chance(r)]
    assert "tools" not in last and "tool_choice" not in last
    assert not [m for m in last["messages"] if m["role"] == "tool" or m.get("tool_calls")]


async def test_a_last_try_that_only_writes_a_call_as_text_is_not_sent(tmp_path, llm, tg):
    """Regression (real run): the tool-less last try answered "functions.list_directory: { }",
    which reached the user."""
    from fakes.openai_server import is_last_chance

    from bumblebot.cognition.notes import LOOPING_MESSAGE

    llm.push(text("functions.list_directory: { }"), when=is_last_chance)
    llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=95)
        await d.engine.wait_for_turns(1)
    assert tg.sent(95) == [LOOPING_MESSAGE]


async def test_the_last_try_keeps_what_was_said_and_alternates_roles(tmp_path, llm, tg):
    """The tool-less last try keeps the earlier answers given by say and alternates user and
    assistant messages (three user messages in a row are refused by alternation-strict templates)."""
    from fakes.openai_server import is_last_chance

    judges_say_done(llm)
    llm.push(say("First answer."), when=is_loop)
    llm.push(text("Plain answer."), when=is_last_chance)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=86)
        await d.engine.wait_for_turns(1)
        llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else (
            error(500, "unscripted") if is_last_chance(r) else text("DONE: fine"))
        llm.push(text("Plain answer."), when=is_last_chance)
        tg.push_text("and now?", chat_id=86)
        await d.engine.wait_for_turns(2)
    assert tg.sent(86) == ["First answer.", "Plain answer."]
    [last] = [r for r in llm.requests if is_last_chance(r)]
    roles = [m["role"] for m in last["messages"]]
    assert all(a != b for a, b in zip(roles[1:], roles[2:])), roles  # user and assistant alternate
    assert any(m["role"] == "assistant" and "First answer." in m["content"] for m in last["messages"])
