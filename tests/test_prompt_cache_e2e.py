"""Cache-friendly requests, end to end: over a 16-turn chat with tool use, each model request
repeats the previous request of the same model as a prefix (docs/cognition.md, "Request
assembly").

A daemon on the Telegram fake runs the chat against the scripted OpenAI fake through the real
``openai`` client; the measure is taken on the request bodies the fake received. The turns are
7 minutes apart on the runner's clock, so every ``[Turn context]`` has a Time line of its own
(a block sent again with the current time would break the prefix, and the measure would see it).

**The measure** (:func:`shares`): a request is serialized as its tool schemas, then its
messages one by one (each as JSON with sorted keys), the way an endpoint's prefix cache sees
it: tools and system prompt first, then the conversation in order. Its share is the longest
common prefix, in characters, with the previous request *of the same model*, divided by the
length of that previous request: how much of what the endpoint already processed it can
reuse. Only the agent loop's requests count (those that offer tools): the classifier and the
completion check's judges carry prompts of their own (their own system prompt, the message and
the reply, no history), so they are another kind of request, which a prefix cache keeps apart
and which says nothing about the conversation's prefix.

The chat has a photo: a request shows it while its message is in the protected tail, and names
it once it leaves (docs/cognition.md, "Request assembly"), which breaks the prefix once, at that
message; that request is counted in the average like any other.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from conftest import running, write_config
from fakes.openai_server import Reply, image_parts, is_aux, text, tool_calls

#: What the first line of every ``[Turn context]`` block is.
MARKER = "[Turn context]"


def serialized(request: dict[str, Any]) -> str:
    """A request as a prefix cache sees it: tool schemas, then each message, as JSON."""
    parts = [json.dumps(request.get("tools") or [], sort_keys=True, ensure_ascii=False)]
    parts += [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in request["messages"]]
    return "".join(parts)


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shares(requests: list[dict[str, Any]]) -> list[tuple[float, bool]]:
    """For each loop request after the first of its model: the share of the previous request
    of that model it repeats as a prefix (module docstring), and whether it shows fewer images
    than that one (a photo left the protected tail)."""
    last: dict[str, dict[str, Any]] = {}
    out = []
    for request in requests:
        if is_aux(request):
            continue
        previous = last.get(request["model"])
        if previous is not None:
            before, now = serialized(previous), serialized(request)
            dropped = len(image_parts(request)) < len(image_parts(previous))
            out.append((common_prefix(before, now) / len(before), dropped))
        last[request["model"]] = request
    return out


# -- the chat ------------------------------------------------------------------------------------


def _call(name: str, **args: Any) -> tuple[str, dict[str, Any]]:
    return (name, args)


#: A plan the model writes to a file and reads back (about 1,500 characters, as a real note).
PLAN = "\n".join(
    f"## Day {day}\n- Morning: walk to the {place} and have breakfast near the harbour.\n"
    f"- Afternoon: visit the {place} museum; book tickets online the evening before.\n"
    f"- Evening: dinner in the old town, back at the hotel by ten."
    for day, place in enumerate(["castle", "river", "market", "cathedral", "botanical garden", "lighthouse"], start=1)
)
#: A file the user keeps in the workspace (about 3,000 characters).
EXPENSES = "date,category,amount\n" + "".join(
    f"2026-03-{day:02d},{category},{amount}.{day % 10}0\n"
    for day in range(1, 29) for category, amount in (("food", 12 + day), ("transport", 3 + day % 4), ("books", 9))
)
#: An e-mail the user pastes for a reply (about 900 characters).
EMAIL = (
    "Dear Alice,\n\nThank you for your interest in the community garden. We are delighted to tell you "
    "that a plot has become free on the south side, next to the apple trees. Plots are 12 square metres, "
    "come with a water tap shared by four plots, and cost 40 euros a year, payable by the end of April. "
    "New members are asked to join two work mornings a year (the next ones are on 12 April and 20 "
    "September) and to keep their plot tidy over the summer. If you would like the plot, please reply "
    "by Friday with your preferred start date and whether you would like us to till the soil before "
    "you start (there is no extra charge for this in the first year). We also run a tool library on "
    "Saturday mornings and a seed swap in March.\n\nWarm regards,\nMarta, for the garden committee"
)
HAIKU = "Rain on the tin roof\nthe cat sleeps through the thunder\nTom dreams of warm fish\n"

#: The caption of the photo the user sends (the fourth turn).
PHOTO = "this is Tom in the garden, what do you think of the photo?"

#: The 16 turns: what the user writes, and the model's steps in answer (each a list of calls;
#: ``say`` and ``end_turn`` included). Short chat turns go to the reflex model, work to the
#: main one (``write_config``'s two models), so both models' requests are measured.
CHAT: list[tuple[str, list[list[tuple[str, dict[str, Any]]]]]] = [
    ("hi there", [[_call("say", text="Hello! What can I do for you today?"), _call("end_turn")]]),
    ("please remember that my cat is called Tom and she is three years old, she likes fish", [
        [_call("remember", title="Alice's cat", body="A cat called Tom, three years old, likes fish.")],
        [_call("say", text="Saved: Tom, three years old, a fish lover. I'll keep that in mind."), _call("end_turn")],
    ]),
    ("I'm going to Lisbon for six days next month. Write a day-by-day plan into notes/lisbon.md: "
     "mornings outside, a museum each afternoon, dinner in the old town.", [
        [_call("say", text="On it: writing the plan now."), _call("write_file", path="notes/lisbon.md", content=PLAN)],
        [_call("say", text="Written to notes/lisbon.md: six days, each with a morning walk, an afternoon "
                           "museum and dinner in the old town. Tell me if you want to swap any day around."),
         _call("end_turn")],
    ]),
    (PHOTO, [[_call("say", text="She looks very content in the sun, and that tail says she owns the garden!"),
              _call("end_turn")]]),
    ("read notes/lisbon.md and tell me which day has the lighthouse, and what I do that evening", [
        [_call("say", text="Let me check the plan."), _call("read_file", path="notes/lisbon.md")],
        [_call("say", text="The lighthouse is on day 6: a morning walk there, its museum in the afternoon "
                           "(book the evening before), and dinner in the old town, back by ten."),
         _call("end_turn")],
    ]),
    ("think of three names for a dog we might adopt, and tell me the one you like best and why", [
        [_call("think", thought="Short names work best for calling a dog: Rex, Bo, Max. Bo is friendly.")],
        [_call("say", text="Rex, Bo or Max. I like Bo best: short, friendly, and easy to call across a park."),
         _call("end_turn")],
    ]),
    ("remember that I prefer tea over coffee, green tea in the afternoon", [
        [_call("remember", title="Drinks", body="Prefers tea over coffee; green tea in the afternoon.")],
        [_call("say", text="Noted: tea, and green tea in the afternoon."), _call("end_turn")],
    ]),
    ("in the plan file, add a tea house visit to day 3, after the market", [
        [_call("read_file", path="notes/lisbon.md")],
        [_call("write_file", path="notes/lisbon.md",
               content=PLAN.replace("market museum;", "market museum, then a tea house;"))],
        [_call("say", text="Day 3 now has a tea house after the market museum."), _call("end_turn")],
    ]),
    ("thanks!", [[_call("say", text="Any time!"), _call("end_turn")]]),
    ("write a haiku about rain and my cat into poems/haiku.txt", [
        [_call("write_file", path="poems/haiku.txt", content=HAIKU)],
        [_call("say", text="Done, it is in poems/haiku.txt:\n" + HAIKU), _call("end_turn")],
    ]),
    ("search your saved facts about my pets and tell me what you know", [
        [_call("recall", query="cat pets")],
        [_call("say", text="You have a cat called Tom: three years old, and she likes fish."), _call("end_turn")],
    ]),
    ("read expenses.csv and tell me the total per category for March", [
        [_call("read_file", path="expenses.csv")],
        [_call("say", text="March: food 742.00, transport 137.00 and books 252.00, so 1,131.00 in all "
                           "(rounded to the cent)."), _call("end_turn")],
    ]),
    ("Can you draft a short, friendly reply to this? I want the plot, starting in May, and yes to "
     "tilling.\n\n" + EMAIL, [
        [_call("say", text="Here is a draft:\n\nDear Marta,\n\nThank you so much, I would love the plot "
                           "on the south side! I'd like to start in May, and yes please to tilling the soil "
                           "beforehand. I'll pay the 40 euros before the end of April and I'll be there for "
                           "the work morning on 12 April.\n\nSee you at the garden,\nAlice"),
         _call("end_turn")],
    ]),
    ("remember that my birthday is on the fourth of May, I'd like a reminder the day before", [
        [_call("remember", title="Birthday", body="Birthday on 4 May; wants a reminder on 3 May.")],
        [_call("say", text="I'll remember: 4 May, and a nudge on the 3rd."), _call("end_turn")],
    ]),
    ("read poems/haiku.txt back to me", [
        [_call("read_file", path="poems/haiku.txt")],
        [_call("say", text=HAIKU), _call("end_turn")],
    ]),
    ("bye for now", [[_call("say", text="Bye! Enjoy Lisbon."), _call("end_turn")]]),
]


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 120, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content


def model(request: dict[str, Any]) -> Reply:
    """The scripted model: judges say DONE; a loop request gets the next step of the turn it
    is for (the last user message that is one of :data:`CHAT`'s; the steps so far are the
    assistant messages after it)."""
    if is_aux(request):
        return text("DONE: the reply is adequate")
    messages = request["messages"]
    for index in range(len(messages) - 1, -1, -1):
        said = _text(messages[index]) if messages[index]["role"] == "user" else ""
        steps = next((s for line, s in CHAT if said.endswith(line)), None)
        if steps is not None:
            done = sum(1 for m in messages[index + 1:] if m["role"] == "assistant")
            return tool_calls(*steps[min(done, len(steps) - 1)])
    raise AssertionError(f"no scripted turn in {messages[-1]}")


#: When the chat begins; each turn comes :data:`TURN_GAP` after the one before (the runner's
#: clock, ``TurnContexts.clock``): every block has a Time line of its own.
START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
TURN_GAP = timedelta(minutes=7)


async def run_chat(tmp_path, llm, tg) -> tuple[list[dict[str, Any]], list[float | None]]:
    """The 16 turns in one private chat, 7 minutes apart: the requests the endpoint received,
    and the share of the previous request each step's trace shows (``repeated``), in order."""
    llm.default = model
    config = write_config(tmp_path, llm, tg)
    (tmp_path / "data" / "workspace").mkdir(parents=True)
    (tmp_path / "data" / "workspace" / "expenses.csv").write_text(EXPENSES)
    async with running(config) as d:
        turns = 0
        d.runner.contexts.clock = lambda: START + turns * TURN_GAP
        for n, (line, _) in enumerate(CHAT, start=1):
            turns = n
            if line == PHOTO:
                tg.push_photo([(640, 480, png(640, 480))], caption=line, chat_id=1)
            else:
                tg.push_text(line, chat_id=1)
            await d.engine.wait_for_turns(n)
        traces = [t["trace"] for t in await d.store.recent_turns(limit=len(CHAT))]
    assert [t["stop_reason"] for t in traces] == ["end_turn"] * len(CHAT), traces[0]
    assert not llm.violations and not llm.unscripted
    shown = [step["repeated"] for t in reversed(traces) for step in t["steps"]]
    return list(llm.requests), shown


def without_past_contexts(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` as an engine that prefixes the ``[Turn context]`` to the current turn's
    message only would send it: every earlier user message without its block."""
    block = re.compile(r"\A\[Turn context\]\n.*?\n---\n", re.S)
    messages = [dict(m) for m in request["messages"]]
    marked = [i for i, m in enumerate(messages) if m["role"] == "user" and _text(m).startswith(MARKER)]
    for i in marked[:-1]:
        content = messages[i]["content"]
        if isinstance(content, list):  # text and image parts: the block opens the text
            messages[i]["content"] = [
                {**p, "text": block.sub("", p["text"])} if p["type"] == "text" else p for p in content
            ]
        else:
            messages[i]["content"] = block.sub("", content)
    return {**request, "messages": messages}


def report(measured: list[tuple[float, bool]]) -> tuple[float, float]:
    values = [share for share, _ in measured]
    average = sum(values) / len(values)
    print(f"\n{len(values)} requests: average share {average:.4f}, minimum {min(values):.4f};",
          " ".join(f"{share:.3f}{'*' if dropped else ''}" for share, dropped in measured))
    return average, min(values)


async def test_each_request_repeats_at_least_97_percent_of_the_previous_one_of_its_model(tmp_path, llm, tg):
    """Every turn's first message goes with the [Turn context] it was first sent with, so
    a request repeats the previous one up to that request's nudge, across turns too; the one
    break is where the photo leaves the protected tail. Each block keeps the time of its own
    turn: the turns are 7 minutes apart."""
    requests, shown = await run_chat(tmp_path, llm, tg)
    times = [re.search(r"^Time: (.*)$", b, re.M).group(1) for b in blocks([r for r in requests if not is_aux(r)][-1])]
    assert times == [f"{START + n * TURN_GAP:%A %Y-%m-%d %H:%M} (UTC)" for n in range(1, len(CHAT) + 1)]
    measured = shares(requests)
    assert {r["model"] for r in requests if not is_aux(r)} == {"test-model", "reflex-model"}  # both routes ran
    assert len(measured) == sum(len(steps) for _, steps in CHAT) - 2  # one request a step
    average, _ = report(measured)
    assert average >= 0.97
    assert [dropped for _, dropped in measured].count(True) == 1  # the photo was shown, then named
    assert min(share for share, dropped in measured if not dropped) >= 0.95
    # each step's trace shows its share (counted in whole messages: within a nudge of the measure)
    assert shown[:2] == [None, None]  # the first request of each model
    assert all(abs(share - traced) <= 0.02 for (share, _), traced in zip(measured, shown[2:], strict=True))


async def test_the_measure_fails_requests_that_drop_earlier_turn_contexts(tmp_path, llm, tg):
    """The same chat's requests, each earlier user message stripped of its [Turn context] (as
    an engine sending the block with the current message only would send them), repeat too
    little: the measure sees the prefix break at the previous turn's message, well below the
    bar the requests as sent pass."""
    requests, _ = await run_chat(tmp_path, llm, tg)
    stripped = [r if is_aux(r) else without_past_contexts(r) for r in requests]
    assert sum(a != b for a, b in zip(stripped, requests, strict=True)) > len(CHAT)  # there were blocks to strip
    measured = shares(stripped)
    average, _ = report(measured)
    sent, _ = report(shares(requests))
    assert average < 0.96 and sent - average > 0.025
    assert min(share for share, dropped in measured if not dropped) < 0.9  # at the previous turn's message


def blocks(request: dict[str, Any]) -> list[str]:
    """The [Turn context] blocks of a request's user messages, in order."""
    return [re.match(r"\[Turn context\]\n.*?\n---\n", _text(m), re.S).group() for m in request["messages"]
            if m["role"] == "user" and _text(m).startswith(MARKER)]


async def test_a_fact_shows_once_goes_when_removed_and_shows_again_after_compaction(tmp_path, llm, tg):
    """A fact goes in one [Turn context] of the active history, not in every turn's; a fact
    removed from the knowledge file is sent no more, the earlier block included; once
    compaction summarised the block's message, the next block shows the fact again. The
    summary is made of what the user wrote, never of a block; the platform and speaker lines
    go in the first block only."""
    from bumblebot.cognition.compaction import SUMMARY_HEADINGS
    from bumblebot.cognition.knowledge import Memory

    summary = "\n".join(f"## {h}\n- small talk" for h in SUMMARY_HEADINGS)

    def reply(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            seen = json.dumps(request)
            if "You compact the history" in seen:
                return text(summary)
            return text("[]" if "durable facts" in seen else "DONE: ok")
        return tool_calls(("say", {"text": "ok"}), ("end_turn", {}))

    llm.default = reply
    config = write_config(tmp_path, llm, tg, cognition={"max_context_tokens": 8000, "history_compression": {
        "compaction_protect_first_n": 0, "compaction_protect_last_n": 2, "compaction_target_ratio": 0.01,
    }})
    facts = Memory(tmp_path / "data").of("telegram:1")
    facts.append_sections([("Cat", "A cat called Tom.")])

    def turn_requests(word: str) -> list[dict[str, Any]]:
        return [r for r in llm.requests if not is_aux(r) and _text(r["messages"][-1]).endswith(word)]

    async with running(config) as d:
        turns = 0

        async def chat(word: str) -> list[str]:
            nonlocal turns
            tg.push_text(word, chat_id=1)
            turns += 1
            await d.engine.wait_for_turns(turns)
            (request,) = turn_requests(word)
            return blocks(request)

        first, second = await chat("one"), await chat("two")
        assert "## Cat\nA cat called Tom." in first[0] and second[0] == first[0]  # sent as it was
        assert "What you know here" not in second[1]  # shown already
        assert "Speaking: " in second[0] and "Speaking: " not in second[1] and "Platform: " not in second[1]
        await chat("three")
        tg.push_text("/compact", chat_id=1)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text", "").startswith("Compacted"))
        fourth = await chat("four")
        assert "## Cat\nA cat called Tom." in fourth[-1] and "Speaking: " in fourth[-1]  # the first block was summarised
        assert sum("Tom" in b for b in fourth) == 1
        facts.path.write_text("# Knowledge\n\n## Dog\nA dog called Rex.\n")  # the operator removed the cat
        fifth = await chat("five")
        assert not any("Tom" in b for b in fifth) and "## Dog\nA dog called Rex." in fifth[-1]
        assert fifth[-2] == fourth[-1].replace("What you know here:\n## Cat\nA cat called Tom.\n", "")
        sixth = await chat("six")
        assert sixth[:-1] == fifth and sum("Rex" in b for b in sixth) == 1
    (summarised,) = [r for r in llm.requests if "You compact the history" in json.dumps(r)]
    assert "one" in json.dumps(summarised) and MARKER not in json.dumps(summarised)
