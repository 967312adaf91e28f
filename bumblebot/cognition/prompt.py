"""The stable system prompt and the volatile ``[Turn context]`` preamble.

Spec, "System prompt separation": the system prompt (identity, persona, voice rules, tool
declarations, knowledge) is compiled from the entity file and ``knowledge.md`` and cached by a
fingerprint of those inputs; it is rebuilt only when one of them changes, so endpoints with
prompt caching keep their cache. Everything that changes per turn goes into a ``[Turn context]``
block prefixed to the user message of the turn (history stores what the user wrote, and the block
apart, :class:`~bumblebot.core.messages.TurnContext`: later requests send that message with its
block as it was, so each request repeats the one before it as a prefix). A block shows a fact
only when no block of the active history shows it yet.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bumblebot.cognition.knowledge import KnowledgeFile, Memory, Section, parse_sections, relevant
from bumblebot.core.entity import Entity, load_entity
from bumblebot.core.events import ChatKind, Inbound
from bumblebot.core.messages import Message, TurnContext
from bumblebot.core.textrules import TURN_CONTEXT

log = logging.getLogger(__name__)

#: The global knowledge.md goes whole into the system prompt up to this size (characters;
#: :data:`SHORT_GLOBAL_CHARS` at prompt level 2 and up); a bigger file contributes its locked
#: sections only, cut to the same bound, and its other sections are searched per turn.
GLOBAL_INLINE_CHARS = 2000
SHORT_GLOBAL_CHARS = 600
#: At most this many sections, and characters, of relevant knowledge go into a turn context.
RELEVANT_SECTIONS = 3
RELEVANT_CHARS = 1500

PROTOCOL = """\
# How you act
- You act only through tools. To talk to the user, call `say` with the message; each call is \
delivered at once as its own chat message. Text you write outside tool calls is private \
reasoning and is never shown to anyone.
- When a request needs real work (files, commands, web pages, facts to look up), do it with the \
work tools in this same turn, then tell the user what the tools actually returned. Never promise \
work for later and never claim a result you did not get from a tool.
- Your turn lasts until you call `end_turn`: call it once you have answered and the work is done. \
You may call several tools in one step; a reply and `end_turn` can go together.
- A user message that starts a turn begins with a [Turn context] block written by the system \
(time, platform, who is speaking, facts you know); the latest one is current, and facts an earlier \
one shows still hold. It is not from the user; never quote it back."""

#: The protocol for small windows (prompt level 2 and up): the same rules, fewer words.
PROTOCOL_SHORT = """\
# How you act
- Talk only with `say` (plain text is never shown). Do real work with the work tools in this \
turn and report what they returned; never promise work for later. Your turn lasts until you \
call `end_turn` (it may go in the same step as your last `say`).
- [Turn context] blocks at the start of user messages are from the system; the latest is current."""

#: System prompt levels (small windows get a higher one, see ``TurnRunner.fixed_part``): 0 all;
#: 1 without the tool list (the tool schemas describe the tools); 2 also the short protocol, the
#: persona cut to :data:`SHORT_PERSONA_CHARS` and at most :data:`SHORT_VOICE_RULES` voice rules.
PROMPT_LEVELS = 4
SHORT_PERSONA_CHARS = 400
SHORT_VOICE_RULES = 3


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """Per-turn facts for the preamble."""

    inbound: Inbound
    route: str
    now: datetime
    note: str = ""
    level: int = 0  # the prompt level of the turn (small windows carry less global knowledge)


class PromptBuilder:
    """Compiles and caches the system prompt; renders the turn preamble.

    Args:
        entity: the loaded entity (reloaded when its file changes).
        memory: the global ``knowledge.md`` and the conversations' own facts.
        tool_lines: ``"name: description"`` lines for the tool declarations.
    """

    def __init__(self, entity: Entity, memory: Memory, tool_lines: list[str]) -> None:
        self.entity = entity
        self.memory = memory
        self.tool_lines = tool_lines
        self._prompts: dict[int, tuple[str, str]] = {}  # level -> (fingerprint, prompt)
        self._entity_stamp = self._stamp(Path(entity.source_path)) if entity.source_path else None
        #: path -> (stat stamp, text, sections): each knowledge file is re-read when it changes
        self._files: dict[Path, tuple[tuple[int, int] | None, str, list[Section]]] = {}
        self._unreadable: dict[Path, tuple[int, int] | None] = {}
        self.builds = 0

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _refresh_entity(self) -> None:
        if not self.entity.source_path:
            return
        stamp = self._stamp(Path(self.entity.source_path))
        if stamp != self._entity_stamp:
            self._entity_stamp = stamp
            try:
                self.entity = load_entity(self.entity.source_path)
            except Exception:  # a broken edit keeps the last good entity
                pass

    def _read(self, file: KnowledgeFile, *, create: bool = False) -> tuple[str, list[Section]]:
        """A knowledge file's text and sections, re-read only when its stat changes. A missing
        file is empty (the global one is created, so the operator finds it). One that cannot
        be read (permissions, a directory in its place) is logged once and counts as empty:
        the entity goes on without those notes rather than failing every turn."""
        stamp = self._stamp(file.path)
        cached = self._files.get(file.path)
        if cached is not None and cached[0] == stamp and stamp is not None:
            return cached[1], cached[2]
        if stamp is None and not create:
            return "", []
        try:
            text = file.read()  # creates a missing file with the seed
        except OSError as exc:
            if self._unreadable.get(file.path, ()) != stamp:  # once per state of the file
                self._unreadable[file.path] = stamp
                log.error("cannot read %s (%s); going on without it", file.path, exc)
            return "", []
        sections = parse_sections(text)
        self._files[file.path] = (self._stamp(file.path), text, sections)
        return text, sections

    def system_prompt(self, level: int = 0) -> str:
        """The system prompt at a compaction ``level`` (:data:`PROMPT_LEVELS`); recompiled only
        when the entity, knowledge, tools or level changed (docs/cognition.md, "System prompt and [Turn context]")."""
        self._refresh_entity()
        knowledge_text, _ = self._read(self.memory.shared, create=True)
        key = hashlib.sha256(
            "\x00".join(
                [self.entity.model_dump_json(), knowledge_text, "\n".join(self.tool_lines), str(level)]
            ).encode()
        ).hexdigest()
        cached = self._prompts.get(level)
        if cached is None or cached[0] != key:
            cached = self._prompts[level] = (key, self._compile(knowledge_text, level))
            self.builds += 1
        return cached[1]

    def _compile(self, knowledge_text: str, level: int) -> str:
        e = self.entity
        persona = e.persona.strip()
        voice = list(e.voice)
        if level >= 2:
            persona = _clip_sentences(persona, SHORT_PERSONA_CHARS)
            voice = voice[:SHORT_VOICE_RULES]
        parts = [f"# Who you are\nYour name is {e.name}.\n{persona}".rstrip()]
        if voice:
            parts.append("# Voice\n" + "\n".join(f"- {rule}" for rule in voice))
        parts.append(PROTOCOL_SHORT if level >= 2 else PROTOCOL)
        if self.tool_lines and level == 0:
            parts.append("# Tools\n" + "\n".join(f"- {line}" for line in self.tool_lines))
        known = self._inline_global(knowledge_text, level)
        if known:
            parts.append("# What you know\n" + known)
        return "\n\n".join(parts)

    def _inline_global(self, text: str, level: int) -> str:
        """The global knowledge the system prompt carries: all of it when it is small
        (:data:`GLOBAL_INLINE_CHARS`), else its locked sections, cut to the same bound."""
        bound = SHORT_GLOBAL_CHARS if level >= 2 else GLOBAL_INLINE_CHARS
        sections = parse_sections(text)
        if not sections:
            return ""
        if len(text.strip()) <= bound:
            return "\n\n".join(f"## {s.title}\n{s.body}" for s in sections)
        locked = "\n\n".join(f"## {s.title}\n{s.body}" for s in sections if s.locked)
        return locked if len(locked) <= bound else locked[: bound - 1] + "…"

    def relevant_knowledge(
        self, conversation: str, text: str, level: int = 0, shown: Collection[str] = ()
    ) -> list[str]:
        """Facts for this turn's context (bounded, and private to the conversation), leaving
        out the ``shown`` ones (an earlier block of the active history shows them): the
        conversation's own sections (all of them while it has at most
        :data:`RELEVANT_SECTIONS`), else the ones sharing the most words with ``text``,
        plus relevant global sections the system prompt does not carry; at most
        :data:`RELEVANT_SECTIONS` sections and :data:`RELEVANT_CHARS` characters."""
        _, own = self._read(self.memory.of(conversation))
        global_text, shared = self._read(self.memory.shared)
        new = [s for s in own if _block(s) not in shown]
        chosen = new if len(own) <= RELEVANT_SECTIONS else relevant(new, text, RELEVANT_SECTIONS)
        inline = self._inline_global(global_text, level)
        others = [s for s in shared if not s.locked and _block(s) not in inline and _block(s) not in shown]
        if len(chosen) < RELEVANT_SECTIONS:
            chosen = chosen + relevant(others, text, RELEVANT_SECTIONS - len(chosen))
        out, used = [], 0
        for section in chosen:
            block = _block(section)
            if used + len(block) > RELEVANT_CHARS:
                break
            out.append(block)
            used += len(block)
        return out

    def known_facts(self, conversation: str) -> frozenset[str]:
        """Every fact a turn context of ``conversation`` may show, as it shows it: the
        sections of its own file and of the global one. A fact of an earlier block that is
        not among them any more (the file was edited) is no longer sent."""
        _, own = self._read(self.memory.of(conversation))
        _, shared = self._read(self.memory.shared)
        return frozenset(_block(s) for s in (*own, *shared))

    def context(self, info: TurnInfo, history: Collection[Message] = ()) -> TurnContext:
        """The ``[Turn context]`` block for this turn. ``history``: the active history; what
        its blocks show already is not shown again: the platform and speaker lines while the
        latest block that has one says the same, the facts one of them shows (that still hold)."""
        inb = info.inbound
        said = {line.split(":", 1)[0]: line for m in history if m.context is not None for line in m.context.lines}
        steady = [
            f"Platform: {inb.chat.platform.value}, "
            + ("private chat" if inb.chat_kind is ChatKind.PRIVATE else "group chat (several people)"),
            f"Speaking: {inb.speaker} (id {inb.sender_id[:32]})",
        ]
        lines = [
            TURN_CONTEXT,
            self.time_line(info.now),
            *(line for line in steady if said.get(line.split(":", 1)[0]) != line),
        ]
        if info.route == "reflex":
            lines.append("Mode: quick reply; keep it short.")
        if info.note:
            lines.append(info.note)
        known = self.known_facts(inb.chat.key)
        shown = {f for m in history if m.context is not None for f in m.context.facts if f in known}
        facts = self.relevant_knowledge(inb.chat.key, inb.text, info.level, shown)
        return TurnContext(tuple(lines), tuple(facts))

    def time_line(self, now: datetime) -> str:
        """A block's Time line: ``now`` in the entity's timezone, to the minute."""
        return f"Time: {now.astimezone(self.entity.zone):%A %Y-%m-%d %H:%M} ({self.entity.timezone})"

    def preamble(self, info: TurnInfo) -> str:
        """The ``[Turn context]`` block for a turn with no history (ends with a ``---`` line)."""
        return self.context(info).text()


def _block(section: Section) -> str:
    """A knowledge section as a turn context shows it."""
    return f"## {section.title}\n{section.body.strip()}"


def _clip_sentences(text: str, limit: int) -> str:
    """``text`` cut after the last whole sentence that ends within ``limit`` characters (or
    at a word boundary if the first sentence is longer)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("! "), head.rfind("? "), head.rfind(".\n"))
    if end > 0:
        return head[: end + 1]
    return head.rsplit(" ", 1)[0] + "…"
