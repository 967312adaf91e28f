"""System prompt cache and turn preamble (spec, "System prompt separation")."""

from __future__ import annotations

from datetime import UTC, datetime

from bumblebot.cognition.knowledge import Memory
from bumblebot.cognition.prompt import GLOBAL_INLINE_CHARS, PromptBuilder, TurnInfo
from bumblebot.core.entity import load_entity
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message


def builder(tmp_path, knowledge_text="# Knowledge\n"):
    entity_file = tmp_path / "me.yaml"
    entity_file.write_text("name: Testy\npersona: You test things.\ntimezone: Europe/Lisbon\n")
    (tmp_path / "knowledge.md").write_text(knowledge_text)
    entity = load_entity(str(entity_file))
    return PromptBuilder(entity, Memory(tmp_path), ["say: talk"]), entity_file


def test_system_prompt_is_rebuilt_only_when_its_inputs_change(tmp_path):
    prompts, entity_file = builder(tmp_path)
    first = prompts.system_prompt()
    assert prompts.system_prompt() == first and prompts.builds == 1
    (tmp_path / "knowledge.md").write_text("# Knowledge\n\n## Pets\nCat: Miso\n")
    second = prompts.system_prompt()
    assert "Cat: Miso" in second and prompts.builds == 2
    entity_file.write_text("name: Testy\npersona: You test things, carefully.\ntimezone: Europe/Lisbon\n")
    assert "carefully" in prompts.system_prompt() and prompts.builds == 3


def test_broken_entity_edit_keeps_the_last_good_entity(tmp_path):
    prompts, entity_file = builder(tmp_path)
    prompts.system_prompt()
    entity_file.write_text("name: [unclosed\n")
    assert "Testy" in prompts.system_prompt()


def test_preamble_carries_the_volatile_facts(tmp_path):
    prompts, _ = builder(tmp_path)
    inbound = Inbound(ChatRef(Platform.TELEGRAM, "5"), "1", "5", "Ada", "hello", ChatKind.PRIVATE)
    text = prompts.preamble(TurnInfo(inbound=inbound, route="reflex", now=datetime(2026, 7, 1, 12, 0, tzinfo=UTC)))
    assert text.startswith("[Turn context]") and text.endswith("---")
    assert "2026-07-01 13:00 (Europe/Lisbon)" in text  # local time of the entity
    assert "telegram, private chat" in text and "Ada (id 5)" in text
    assert "[Turn context]" not in prompts.system_prompt().split("# How you act")[0]


def test_large_knowledge_moves_relevant_sections_into_the_preamble(tmp_path):
    sections = "".join(f"## Topic {i}\n" + "filler words " * 40 + "\n\n" for i in range(20))
    prompts, _ = builder(tmp_path, "# Knowledge\n\n## [locked] Core\nAlways kind.\n\n" + sections + "## Bees\nThe hive is blue.\n")
    assert len((tmp_path / "knowledge.md").read_text()) > GLOBAL_INLINE_CHARS
    system = prompts.system_prompt()
    assert "Always kind." in system and "The hive is blue." not in system and "Topic 3" not in system  # bounded
    inbound = Inbound(ChatRef(Platform.TELEGRAM, "5"), "1", "5", "Ada", "what colour is the hive?", ChatKind.PRIVATE)
    preamble = prompts.preamble(TurnInfo(inbound=inbound, route="deliberate", now=datetime.now(UTC)))
    assert "The hive is blue." in preamble and len(preamble) < 2500


def test_a_conversations_facts_reach_only_its_own_turn_context(tmp_path):
    prompts, _ = builder(tmp_path)
    Memory(tmp_path).of("telegram:5").append_sections([("Pets", "Ada's cat is called Miso.")])
    now = datetime.now(UTC)
    ada = Inbound(ChatRef(Platform.TELEGRAM, "5"), "1", "5", "Ada", "hi again", ChatKind.PRIVATE)
    bob = Inbound(ChatRef(Platform.DISCORD, "7"), "1", "7", "Bob", "what is the cat called?", ChatKind.GROUP)
    assert "Miso" in prompts.preamble(TurnInfo(inbound=ada, route="reflex", now=now))
    assert "Miso" not in prompts.preamble(TurnInfo(inbound=bob, route="reflex", now=now))
    assert "Miso" not in prompts.system_prompt()


def test_a_turn_context_shows_what_the_blocks_of_the_history_do_not(tmp_path):
    """Earlier blocks stay in the request (as they were sent): a new block leaves out the
    platform and speaker lines the latest one says already and the facts one of them shows,
    and shows a new speaker, a new fact, and a fact whose block is no longer in the history."""
    prompts, _ = builder(tmp_path)
    facts = Memory(tmp_path).of("telegram:5")
    facts.append_sections([("Pets", "Ada's cat is called Miso.")])
    chat, now = ChatRef(Platform.TELEGRAM, "5"), datetime(2026, 7, 1, 12, 0, tzinfo=UTC)

    def context(speaker: str, history: list[Message]):
        inbound = Inbound(chat, "1", speaker.lower(), speaker, "hello all", ChatKind.GROUP)
        return prompts.context(TurnInfo(inbound=inbound, route="deliberate", now=now), history)

    first = context("Ada", [])
    assert [line.split(":")[0] for line in first.lines] == ["[Turn context]", "Time", "Platform", "Speaking"]
    assert first.facts == ("## Pets\nAda's cat is called Miso.",)
    history = [Message(role="user", content="hello all", context=first), Message(role="assistant", content="hi")]
    again = context("Ada", history)
    assert [line.split(":")[0] for line in again.lines] == ["[Turn context]", "Time"] and again.facts == ()
    assert again.text() == "[Turn context]\nTime: Wednesday 2026-07-01 13:00 (Europe/Lisbon)\n---"
    facts.append_sections([("Dogs", "Bob walks Rex.")])
    bob = context("Bob", [*history, Message(role="user", content="hello all", context=again)])
    assert bob.lines[2:] == ("Speaking: Bob (id bob)",) and bob.facts == ("## Dogs\nBob walks Rex.",)
    anew = context("Ada", history[1:])  # the first block was compacted away: all of it again
    assert anew.lines == first.lines and anew.facts == (*first.facts, "## Dogs\nBob walks Rex.")
    known = prompts.known_facts("telegram:5")
    facts.path.write_text("# Knowledge\n\n## Dogs\nBob walks Rex.\n")  # Miso forgotten
    assert "Miso" in first.text(known) and "Miso" not in first.text(prompts.known_facts("telegram:5"))
