"""One turn, stage by stage: route, prompt, agent loop, commit.

``TurnRunner.run`` is called by a conversation's actor with the journal entries that make this
turn (several waiting messages merge into one turn). The user message, every assistant and tool
message of the loop, the journal settlement and the trace are written in one transaction at
the end. If the process dies mid-turn, nothing of the turn is in the history, the journal
entries stay ``pending`` and are processed again on start; messages the interrupted turn had
already delivered are listed in the new turn's context so they are not repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bumblebot.context import ConversationContext
from bumblebot.errors import ContextTooLong, ModelError
from bumblebot.events import ChatKind
from bumblebot.loop import LoopLimits, max_steps
from bumblebot.messages import Message, estimate_tools
from bumblebot.prompt import TurnInfo
from bumblebot.sequence import is_valid, repair
from bumblebot.router import CLASSIFIER_MAX_TOKENS, CLASSIFIER_TEMPERATURE, Route, route
from bumblebot.store import JournalEntry
from bumblebot.toolkit import DeliveryReport

if TYPE_CHECKING:
    from bumblebot.conversation import ConversationActor
    from bumblebot.engine import Engine

log = logging.getLogger(__name__)



def merge_text(entries: list[JournalEntry]) -> str:
    """The user text of a turn: one message as is; in groups each line names its speaker."""
    parts = []
    for e in entries:
        inb = e.inbound
        parts.append(f"[{inb.speaker}]: {inb.text}" if inb.chat_kind is ChatKind.GROUP else inb.text)
    return "\n\n".join(parts)


class TurnRunner:
    """Runs turns for the engine (one instance per engine, stateless between turns)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def _classify(self, messages: list[dict[str, Any]]) -> str:
        return await self.engine.llm.text(
            messages, max_tokens=CLASSIFIER_MAX_TOKENS, temperature=CLASSIFIER_TEMPERATURE
        )

    async def run(self, actor: ConversationActor, entries: list[JournalEntry]) -> None:
        engine = self.engine
        started = time.monotonic()
        conversation = actor.conversation
        chat = conversation.chat
        journal_ids = [e.id for e in entries]
        already_told = await engine.already_told(entries)
        turn_id = await engine.store.begin_turn(conversation.id, journal_ids)
        user_message = Message(role="user", content=merge_text(entries))
        messages: list[Message] = [user_message]  # the loop appends to it as the turn goes
        trace: dict[str, Any] = {"journal_ids": journal_ids}
        context: ConversationContext | None = None

        async def deliver(out: str) -> DeliveryReport:
            return await engine.delivery.send(conversation.id, turn_id, chat, out)

        async def tell(note: str) -> None:
            """A note from the daemon itself: delivered, and kept in history (the model should
            know, next turn, what the user was told)."""
            await deliver(note)
            if not messages or messages[-1].role != "assistant" or messages[-1].tool_calls:
                messages.append(Message(role="assistant", content=note))

        status, stop_reason = "done", "error"
        try:
            context, limits = await self._prepare(actor, entries, already_told, trace)
            adapter = engine.adapters.get(chat.platform)
            typing = (
                adapter.typing(chat, engine.settings.engine.typing_interval_s) if adapter else contextlib.nullcontext()
            )
            async with typing:
                result = await engine.loop.run(
                    user_message=user_message,
                    requests=context,
                    limits=limits,
                    deliver=deliver,
                    transcript=messages,
                    conversation=chat.key,
                )
            stop_reason = result.stop_reason
            trace.update(
                steps=[vars_of(s) for s in result.steps],
                gate=result.gate,
                thoughts=result.thoughts,
                delivered=len(result.delivered),
                prompt_tokens=[s.prompt_tokens for s in result.steps],
                estimates=[s.estimate for s in result.steps],
            )
        except asyncio.CancelledError:
            raise  # shutdown past the grace period: the journal keeps the messages pending
        except ModelError as exc:
            status, stop_reason = "failed", "model_error"
            trace["error"] = str(exc)
            log.warning("turn %s in %s failed: %s", turn_id, chat.key, exc)
            await tell(
                "That conversation got too long for my model even after compacting it. "
                "Send /reset to start fresh, or /compact to try again."
                if isinstance(exc, ContextTooLong)
                else "I can't reach my language model right now, so I couldn't answer. "
                "Your message is saved; send me anything and I'll answer it once the model is back."
            )
        except Exception:
            error_id = uuid.uuid4().hex[:8]
            log.exception("turn %s in %s crashed (error id %s)", turn_id, chat.key, error_id)
            status, stop_reason = "failed", "crash"
            trace["error_id"] = error_id
            await tell(f"Something went wrong on my side (error id {error_id}). Your message is saved.")
        if status == "failed" and not is_valid(messages):
            messages = repair(messages)  # a crash inside a tool batch; keep the rest
        if context is not None:
            journal_ids += [j for _, ids in context.steered for j in ids]
            trace["compactions"] = context.compactions
        trace["stop_reason"] = stop_reason
        trace["wall_s"] = round(time.monotonic() - started, 3)
        # endpoint errors can echo a key back ("Incorrect API key provided: sk-…")
        trace = engine.redact(json.loads(json.dumps(trace, default=str)))
        await engine.store.commit_turn(
            turn_id=turn_id,
            conversation=conversation,
            messages=messages,
            journal_ids=journal_ids,
            trace=trace,
            status=status,
        )
        actor.append_history(messages, conversation.session)
        await engine.turn_committed()

    async def _prepare(
        self,
        actor: ConversationActor,
        entries: list[JournalEntry],
        already_told: tuple[str, ...],
        trace: dict[str, Any],
    ) -> tuple[ConversationContext, LoopLimits]:
        """Route the turn and assemble its context (spec: Routing, System prompt separation)."""
        engine = self.engine
        cfg = engine.settings.cognition
        last = entries[-1].inbound
        decision = await route(
            merge_text(entries),
            classify=self._classify if cfg.classifier else None,
            source=last.source,
            always_deliberate=engine.prompts.entity.always_deliberate,
        )
        reflex = decision.route is Route.REFLEX
        limits = LoopLimits(
            max_steps=max_steps(cfg.tool_continuation_rounds),
            max_tokens=cfg.reflex_max_tokens if reflex else cfg.deliberate_max_tokens,
            model=engine.llm.reflex_model if reflex else engine.llm.model,
            thinking=not reflex,
            tool_timeout_s=cfg.tool_timeout_s,
            max_tool_result_chars=int(cfg.max_tool_result_share * cfg.max_context_tokens * 4),
        )
        trace.update(
            route=decision.route.value,
            route_reason=decision.reason,
            classifier_label=decision.label,
            classifier_error=decision.classifier_error,
            model=limits.model,
            max_tokens=limits.max_tokens,
        )
        history, summary = await actor.load_context()
        preamble = engine.prompts.preamble(
            TurnInfo(inbound=last, route=decision.route.value, now=datetime.now(UTC), already_told=already_told)
        )
        context = ConversationContext(
            system_prompt=engine.prompts.system_prompt(),
            history=history,
            summary_message=summary,
            protect_first_n=cfg.history_compression.compaction_protect_first_n,
            preamble=preamble,
            tool_tokens=estimate_tools(engine.toolbox.schemas()),
            steering=actor.take_steering if cfg.mid_turn_messages == "steer" else None,
            before_request=engine.compactor.before_request(actor) if engine.compactor else None,
            shrink=engine.compactor.shrinker(actor) if engine.compactor else None,
            on_usage=engine.observe_usage,
        )
        return context, limits


def vars_of(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}

