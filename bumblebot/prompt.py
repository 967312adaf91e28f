"""The stable system prompt and the volatile ``[Turn context]`` preamble.

Spec, "System prompt separation": the system prompt (identity, persona, voice rules, tool
declarations, knowledge) is compiled from the entity file and ``knowledge.md`` and cached by a
fingerprint of those inputs; it is rebuilt only when one of them changes, so endpoints with
prompt caching keep their cache. Everything that changes per turn goes into a ``[Turn context]``
block prefixed to the user message of the request (history stores what the user wrote).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bumblebot.entity import Entity, load_entity
from bumblebot.events import ChatKind, Inbound
from bumblebot.knowledge import KnowledgeFile, parse_sections

log = logging.getLogger(__name__)

#: knowledge.md up to this size goes whole into the system prompt; beyond it, only locked
#: sections and the list of titles do, and relevant sections go into the turn context.
KNOWLEDGE_INLINE_CHARS = 6000
RELEVANT_SECTIONS = 3
_WORD = re.compile(r"[^\W_]{4,}", re.UNICODE)

PROTOCOL = """\
# How you act
- You act only through tools. To talk to the user, call `say` with the message; each call is \
delivered at once as its own chat message. Text you write outside tool calls is private \
reasoning and is never shown to anyone.
- When a request needs real work (files, commands, web pages, facts to look up), do it with the \
work tools in this same turn, then tell the user what the tools actually returned. Never promise \
work for later and never claim a result you did not get from a tool.
- When you have answered, call `end_turn`. You may call several tools in one step.
- The latest user message begins with a [Turn context] block written by the system (time, \
platform, who is speaking). It is not from the user; never quote it back."""


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """Per-turn facts for the preamble."""

    inbound: Inbound
    route: str
    now: datetime
    note: str = ""


class PromptBuilder:
    """Compiles and caches the system prompt; renders the turn preamble.

    Args:
        entity: the loaded entity (reloaded when its file changes).
        knowledge: ``knowledge.md``.
        tool_lines: ``"name: description"`` lines for the tool declarations.
    """

    def __init__(self, entity: Entity, knowledge: KnowledgeFile, tool_lines: list[str]) -> None:
        self.entity = entity
        self.knowledge = knowledge
        self.tool_lines = tool_lines
        self._key: str | None = None
        self._prompt = ""
        self._entity_stamp = self._stamp(Path(entity.source_path)) if entity.source_path else None
        self._knowledge_stamp: tuple[int, int] | None = None
        self._knowledge_text = ""
        self._sections: list[Any] = []
        self._unreadable: tuple[int, int] | None = None
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

    def _knowledge(self) -> tuple[str, list[Any]]:
        """knowledge.md's text and sections, re-read only when the file's stat changes.

        A file that cannot be read (permissions, a directory in its place) is logged once and
        counts as empty: the entity goes on talking without its notes rather than failing
        every turn.
        """
        stamp = self._stamp(self.knowledge.path)
        if stamp is None or stamp != self._knowledge_stamp:
            try:
                self._knowledge_text = self.knowledge.read()  # creates the file if missing
            except OSError as exc:
                if self._unreadable != stamp:  # once per state of the file
                    self._unreadable = stamp
                    log.error("cannot read %s (%s); going on without it", self.knowledge.path, exc)
                self._knowledge_text, self._sections, self._knowledge_stamp = "", [], None
                return "", []
            self._sections = parse_sections(self._knowledge_text)
            self._knowledge_stamp = self._stamp(self.knowledge.path)
        return self._knowledge_text, self._sections

    def system_prompt(self) -> str:
        """The system prompt; recompiled only when the entity, knowledge or tools changed."""
        self._refresh_entity()
        knowledge_text, _ = self._knowledge()
        key = hashlib.sha256(
            "\x00".join(
                [self.entity.model_dump_json(), knowledge_text, "\n".join(self.tool_lines)]
            ).encode()
        ).hexdigest()
        if key != self._key:
            self._prompt = self._compile(knowledge_text)
            self._key = key
            self.builds += 1
        return self._prompt

    def _compile(self, knowledge_text: str) -> str:
        e = self.entity
        parts = [f"# Who you are\nYour name is {e.name}.\n{e.persona.strip()}".rstrip()]
        if e.voice:
            parts.append("# Voice\n" + "\n".join(f"- {rule}" for rule in e.voice))
        parts.append(PROTOCOL)
        if self.tool_lines:
            parts.append("# Tools\n" + "\n".join(f"- {line}" for line in self.tool_lines))
        body = knowledge_text.strip()
        if body and len(body) <= KNOWLEDGE_INLINE_CHARS:
            parts.append("# What you know (knowledge.md)\n" + body)
        elif body:
            _, sections = self._knowledge()
            locked = [f"## {s.title}\n{s.body.strip()}" for s in sections if s.locked]
            titles = ", ".join(s.title for s in sections if not s.locked)
            text = "\n\n".join(locked)
            parts.append(
                "# What you know (knowledge.md)\n"
                + (text + "\n\n" if text else "")
                + f"Other sections (relevant ones appear in the turn context): {titles}"
            )
        return "\n\n".join(parts)

    def relevant_knowledge(self, text: str) -> list[str]:
        """Up to 3 unlocked sections sharing the most words with ``text``, when knowledge.md is large."""
        knowledge_text, sections = self._knowledge()
        if len(knowledge_text.strip()) <= KNOWLEDGE_INLINE_CHARS:
            return []
        words = {w.lower() for w in _WORD.findall(text)}
        if not words:
            return []
        scored = []
        for s in sections:
            if s.locked:
                continue
            overlap = len(words & {w.lower() for w in _WORD.findall(s.title + " " + s.body)})
            if overlap:
                scored.append((overlap, s))
        scored.sort(key=lambda pair: -pair[0])
        return [f"## {s.title}\n{s.body.strip()}" for _, s in scored[:RELEVANT_SECTIONS]]

    def preamble(self, info: TurnInfo) -> str:
        """The ``[Turn context]`` block for this turn (ends with a ``---`` line)."""
        inb = info.inbound
        local = info.now.astimezone(self.entity.zone)
        lines = [
            "[Turn context]",
            f"Time: {local:%A %Y-%m-%d %H:%M} ({self.entity.timezone})",
            f"Platform: {inb.chat.platform.value}, "
            + ("private chat" if inb.chat_kind is ChatKind.PRIVATE else "group chat (several people)"),
            f"Speaking: {inb.speaker} (id {inb.sender_id[:32]})",
        ]
        if info.route == "reflex":
            lines.append("Mode: quick reply; keep it short.")
        if info.note:
            lines.append(info.note)
        relevant = self.relevant_knowledge(inb.text)
        if relevant:
            lines.append("Relevant knowledge:\n" + "\n\n".join(relevant))
        lines.append("---")
        return "\n".join(lines)
