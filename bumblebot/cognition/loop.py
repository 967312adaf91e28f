"""The bounded agent loop of one turn (docs/cognition.md, "The agent loop").

Each step sends one chat completion with every tool and tool forcing. Tool calls of a step run
concurrently, each under a timeout. Speaking is the ``say`` tool; ending is ``end_turn``, which
goes through the completion gate. Text the model writes alongside tool calls is private
reasoning and is never delivered. A plain-text answer (an endpoint that does not enforce
``tool_choice``) is the model's last word: it is delivered, and the gate judges the ending.

**The model decides when its turn is over.** A turn ends when the model calls ``end_turn``
(or answers in plain text) and the completion gate accepts; otherwise only at a limit: the
step cap, a model that repeats itself without progress (``looping``), replies that keep
hitting the token budget (``budget``), a full window, ``/stop``, or a person's message waiting
while the turn is at its message cap (``message_waiting``). Delivering a ``say`` never
ends a turn. A turn that stops at a limit tells the user so once, in words the model is asked
for (in the user's language), or a plain note when it cannot give them.

**First words.** A chat turn that has shown its person nothing names ``say`` as the tool of its
next step once the model tried to end it without a word, or once ``first_words_s`` have passed
(:meth:`AgentLoop._speak_now`): the model writes the words, but spends no more steps first.

**Delivery.** Every ``say`` is delivered as written, except an exact repeat (same text after
whitespace and case normalisation) of a message already delivered in this turn, and except
past the turn's message cap, which the model is told. Only the text rules of
:mod:`bumblebot.core.textrules` remove anything (reasoning, a call written as text, the engine's own
notes echoed); every removal is recorded in the trace. A say that will not be delivered is
never streamed as a preview.

**Checkpoints.** Every step is recorded as it happens, through the :class:`TurnPort`: the
assistant message *before* its tools run, each tool result as soon as it completes, and every
message for the user in the outbox. What the loop knows of a turn (:class:`LoopState`) is a
function of that record, so a turn resumed after a crash rebuilds it with
:meth:`LoopState.replay` and goes on:

* a call whose result was recorded is never run again;
* a ``say`` (or ``send_file``) cut off before it reached the outbox is delivered as recorded
  (nothing of it was sent: there is no outbox row), one that reached it is answered from its
  row (delivered, queued, or refused);
* any other call that was cut off gets a result saying it was interrupted and may or may not
  have taken effect; it is not silently run again;
* a step that had ended the turn goes to the gate again.

Limits: tool continuation rounds are clamped to [0, 16]; steps are capped at
``max(6, min(25, 6 + rounds))``; a work tool called in three consecutive steps is refused from
the third (docs/cognition.md, "The agent loop"); three steps in a row that bring nothing new
stop a looping model, one such step at the message cap; after 3 consecutive length-limited
completions the model is told to write long output to a file (or to say less at a time), and a
fourth stops the turn.

Internal nudges (post-tool, gate) live only in the request of the next step: they are never
stored as if the user had written them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from bumblebot.cognition.calls import Calls, fit_call, fit_text
from bumblebot.cognition.gate import MAX_GATE_CONTINUES, CompletionGate
from bumblebot.cognition.limits import (
    IDLE_STEP_LIMIT,
    LENGTH_STALL_LIMIT,
    STEER_MIN_STEPS_LEFT,
    LoopLimits,
)
from bumblebot.cognition.notes import (
    CLOSING_MAX_TOKENS,
    CLOSING_NUDGE,
    CONTEXT_FULL_MESSAGE,
    LAST_CHANCE_MAX_TOKENS,
    LAST_CHANCE_NUDGE,
    LENGTH_ADVICE,
    LENGTH_ADVICE_FILE,
    LIMIT_NOTES,
    LIMIT_WHY,
    NO_REPLY_MESSAGE,
    REASON_CHARS,
    UNFINISHED_MESSAGE,
    clip,
    model_words,
    post_tool_nudge,
)
from bumblebot.cognition.port import RequestBuilder, TurnPort
from bumblebot.cognition.prefixes import Prefixes
from bumblebot.cognition.resume import close_interrupted, close_open_calls
from bumblebot.cognition.run import Run
from bumblebot.cognition.sequence import plain_conversation
from bumblebot.cognition.speech import DeliveryRule, SayStream, Visible
from bumblebot.cognition.state import DELIVERIES, LoopState
from bumblebot.cognition.steps import (
    Burst,
    Stopped,
    Superseded,
    cut_short,
    given_up_for,
    unique_id,
    unless_stopped,
)
from bumblebot.cognition.trace import (
    LoopResult,
    LoopTrace,
    StepTrace,
    Stop,
    StopFlag,
    StopReason,
    step_usage,
)
from bumblebot.core.errors import ContextTooLong
from bumblebot.core.events import blank, storable_text
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import Toolbox, ToolContext, ToolKind, ToolResult
from bumblebot.llm import Completion, Endpoints, SayListener

log = logging.getLogger(__name__)


class AgentLoop:
    """Runs one turn. Collaborators come in through the constructor."""

    def __init__(
        self, *, llm: Endpoints, toolbox: Toolbox, gate: CompletionGate, tool_context: ToolContext,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.llm = llm
        self.clock = clock
        self.toolbox = toolbox
        self.calls = Calls(toolbox)
        self.gate = gate
        self.tool_context = tool_context
        #: the last request per conversation and model (the trace's ``repeated`` share)
        self.prefixes = Prefixes()

    async def run(
        self, port: TurnPort, requests: RequestBuilder, limits: LoopLimits, trace: LoopTrace, *, conversation: str = ""
    ) -> LoopResult:
        """Run (or resume) the turn whose record ``port.transcript`` is.

        Args:
            trace: filled in as the loop goes (the caller saves it with the turn).
            conversation: a readable conversation key, for tools' logs.

        Raises:
            ModelError: the endpoint failed (after the one retry on a context-length refusal);
                every step before it is recorded, so the turn can be resumed later.
        """
        run = self._start(port, requests, limits, trace, conversation)
        run.ended_by, run.nudge = await close_interrupted(run, self.calls)
        while await self._step(run):
            pass
        return await self._close(run)

    def _start(
        self, port: TurnPort, requests: RequestBuilder, limits: LoopLimits, trace: LoopTrace, conversation: str
    ) -> Run:
        names = [s["function"]["name"] for s in requests.tool_schemas if isinstance(s.get("function"), dict)]
        state = LoopState.replay(port.transcript, self.toolbox.kind)
        visible = Visible(frozenset(names), trace)
        rule = DeliveryRule(state, trace, limits.max_messages, visible)
        port.begin(rule)  # the agency tools call the port: it asks the rule what goes out
        ctx = ToolContext(
            workspace=self.tool_context.workspace, data_dir=self.tool_context.data_dir, turn=port,
            conversation=conversation, extras=self.tool_context.extras,
        )
        return Run(
            port=port, requests=requests, limits=limits, trace=trace, state=state, rule=rule, visible=visible,
            stream=SayStream(port.on_say(visible.preview), state, limits, rule, visible), ctx=ctx,
            work_tools=tuple(n for n in names if self.toolbox.kind(n) is ToolKind.WORK),
            used_ids=requests.call_ids(),
            started=self.clock(),
        )

    async def _step(self, run: Run) -> bool:
        """One round: judge an ending, check the limits, take what arrived meanwhile, ask the
        model, act on its answer. ``False`` when the turn is over (``run.stop_reason`` says why)."""
        if run.port.stop.is_set():
            run.stop_reason = StopReason.STOPPED
            return False
        if self._at_cap(run) and run.port.message_waiting():
            return await self._superseded(run)
        if run.ended_by is not None and await self._gate(run):
            return False
        limit = self._limit(run)
        if limit is not None:
            run.stop_reason = limit
            return False
        if (run.limits.max_steps - run.state.steps >= STEER_MIN_STEPS_LEFT
                and len(run.state.delivered) < run.limits.max_messages):
            # later messages wait for the next turn: this one must keep steps, and room under
            # its message cap, to answer them
            for steer in await run.port.take_steering():
                run.state.on_user(steer)
                run.nudge = None
        try:
            completion = await self._ask(run)
        except Stopped:
            run.stop_reason = StopReason.STOPPED
            return False
        except Superseded:
            if run.port.stop.is_set():
                run.stop_reason = StopReason.STOPPED  # /stop came with the message: it wins
                return False
            if not run.port.message_waiting():
                return True  # the message no longer waits (a paused chat, /reset): ask again
            return await self._superseded(run)
        except ContextTooLong:
            if not run.state.delivered:
                raise  # nothing got through: the turn fails with the "too long" note
            # the turn's own steps filled the window after it had answered: stop here; the
            # next turn starts from compacted history
            run.stop_reason = StopReason.CONTEXT_FULL
            return False
        if completion is None:  # a burst went on: asked again with all of it
            return True
        if completion.tool_calls:
            await self._act(run, completion)
        else:
            await self._answer(run, completion)
        return True

    async def _gate(self, run: Run) -> bool:
        """The model ended its turn: may it? ``True`` when the turn is over."""
        ended_by, run.ended_by = run.ended_by, None
        run.port.judging()
        try:
            decision = await unless_stopped(run.port.stop, self.gate.check(run.state.gate_input(
                ended_by or "end_turn", run.hit_length, run.gate_continues,
                silent_ok=run.limits.silent_ok, work_tools=run.work_tools,
            )))
        except Stopped:
            run.stop_reason = StopReason.STOPPED
            return True
        run.trace.judged(decision)
        if decision.done:
            run.stop_reason = StopReason.END_TURN if ended_by == "end_turn" else StopReason.FINAL_REPLY
            capped = run.gate_continues >= MAX_GATE_CONTINUES
            if capped and run.unmet is not None and run.state.work_ok == 0 and run.state.delivered:
                run.flags.add(StopFlag.UNFINISHED)  # the check found it undone to the end: say so
            return True
        run.gate_continues += 1
        run.unmet = decision
        run.nudge = decision.nudge
        if ended_by == "text" and run.length_stalls >= LENGTH_STALL_LIMIT:
            run.nudge = (run.nudge or "") + " " + self._length_advice(run)
        return False

    @staticmethod
    def _at_cap(run: Run) -> bool:
        return len(run.state.delivered) >= run.limits.max_messages

    @staticmethod
    async def _superseded(run: Run) -> bool:
        """The turn can say no more and a person's message waits for it to end: it ends now,
        decided from delivery state, not from what was said. Its steps left could only work
        unseen, or call ``end_turn`` for the check to judge; the person does not wait for
        them (minutes on a slow endpoint). The message's own turn sees all of it in the
        history, with a note that this turn ended before the model ended it (work it had not
        asked for yet was not done). ``False``: the turn is over."""
        ended = {"end_turn": StopReason.END_TURN, "text": StopReason.FINAL_REPLY}
        run.stop_reason = ended.get(run.ended_by or "", StopReason.MESSAGE_WAITING)
        if run.stop_reason is StopReason.MESSAGE_WAITING:
            await run.port.superseded()
        return False

    @staticmethod
    def _limit(run: Run) -> StopReason | None:
        """The limit the turn has reached, if any (it stops there)."""
        if run.state.steps >= run.limits.max_steps:
            return StopReason.STEP_CAP
        # past the message cap nothing more reaches the person: a step that only tried to say
        # more there shows a model talking on (one that thinks before work left is not one)
        if run.state.idle_steps >= IDLE_STEP_LIMIT or (run.state.idle_steps and run.talked_past_cap):
            return StopReason.LOOPING  # no need to wait for the step cap
        if run.length_stalls > LENGTH_STALL_LIMIT:
            return StopReason.BUDGET  # told to write less at a time, and still cut
        if run.rule.undeliverable:
            return StopReason.UNDELIVERABLE  # e.g. the user blocked the bot: stop spending tokens
        return None

    async def _ask(self, run: Run) -> Completion | None:
        """The step's completion (a reflex reply cut by its budget asked again once with the
        deliberate one); ``None`` when more messages of the burst the turn began with came
        while its first completion was awaited: it was aborted, and the rest of the burst
        taken in."""
        stop, limits = run.port.stop, run.limits
        request, estimate = await run.requests.build(run.nudge)
        if run.nudge:
            run.visible.echoes.add(run.nudge, model_words=_model_words(run))
        run.port.waiting()
        run.stream.reset()
        # the first completion of a turn that began at once may be asked again when the
        # burst it began with goes on (cognition.debounce_s): it has shown nothing yet
        first = not run.trace.steps and not run.restarted and not run.state.delivered
        call = "say" if self._speak_now(run) else None
        # at the cap, a person's message coming ends the turn before its next request is sent
        # (a one-slot endpoint may keep that request waiting behind other chats' for minutes)
        superseded = run.port.arrival() if self._at_cap(run) else None
        if superseded is not None and run.port.message_waiting():
            raise Superseded  # came while the request was built
        try:
            with given_up_for(superseded):
                completion, request = await unless_stopped(stop, self._complete_fitting(
                    request, run.nudge, run.requests, limits, run.stream.listener, call
                ), burst=run.port.burst if first else None, may_restart=lambda: not run.stream.shown)
        except Burst:
            run.restarted = True
            await unless_stopped(stop, run.port.settle_burst())
            for steer in await run.port.take_steering(burst=True):
                run.state.on_user(steer)
            run.nudge = None
            return None
        step = StepTrace(
            step=len(run.trace.steps) + 1,
            finish_reason=completion.finish_reason,
            prompt_tokens=completion.sample_tokens,
            completion_tokens=completion.completion_tokens,
            estimate=estimate,
            tool_choice=completion.tool_choice,
            endpoint=completion.endpoint,
            model=completion.model,
            usage=step_usage(completion.usage, completion.cost),
            repeated=self._repeated(run, completion, request),
            cut=completion.cut.as_dict() if completion.cut else None,
        )
        await run.port.answered()
        await run.requests.observe_usage(completion.sample_tokens, estimate)
        if (cut_short(completion) and completion.cut is None and limits.escalate_tokens
                and limits.escalate_tokens > limits.max_tokens):
            # a reply cut by the reflex budget: ask again once with the deliberate one, before
            # anything of it is run or delivered (not one the client cut: that server did not
            # stop at the budget it was given, and would only run longer with a larger one)
            if superseded is not None and run.port.message_waiting():
                run.trace.steps.append(step.as_dict())  # answered and metered: it stays in the trace
                raise Superseded  # a cut step of a turn that can say no more: not worth a longer one
            limits.max_tokens, limits.escalate_tokens = limits.escalate_tokens, None
            run.port.restart_previews()  # the new text takes the shown messages over
            run.stream.reset()
            with given_up_for(superseded):
                completion = await unless_stopped(
                    stop, self._complete(request, run.requests.tool_schemas, limits, run.stream.listener, call)
                )
            step.finish_reason, step.escalated = completion.finish_reason, True
            step.endpoint, step.model = completion.endpoint, completion.model
            self._repeated(run, completion, request)  # the next request of that endpoint and model repeats this one
            step.completion_tokens = completion.completion_tokens
            step.usage = step_usage(completion.usage, completion.cost, step.usage)
            step.cut = completion.cut.as_dict() if completion.cut else None
        run.trace.steps.append(step.as_dict())
        run.hit_length = completion.hit_length
        run.length_stalls = run.length_stalls + 1 if run.hit_length else 0
        run.nudge = None
        return completion

    async def _act(self, run: Run, completion: Completion) -> None:
        """A step with tool calls: record it, run the calls, and decide what the model is told
        next (or that it ended its turn)."""
        state, port = run.state, run.port
        said_before = len(state.delivered)
        fitted = [fit_call(unique_id(c, run.used_ids), run) for c in completion.tool_calls]
        calls = [call for call, _ in fitted]
        unusable = {call.id: error for call, error in fitted if error is not None}
        # text of only invisible characters is no text (strict endpoints refuse it)
        content = "" if blank(completion.content) else storable_text(completion.content)
        message = Message(role="assistant", content=content, tool_calls=[c.to_api() for c in calls])
        await port.record(message)  # before any side effect: a crash from here on is resumable
        state.on_assistant(message)
        for streamed, call in zip(completion.tool_calls, calls, strict=True):
            if streamed.index is not None and call.name == "say" and call.id not in unusable:
                port.bind_say(streamed.index, call.id)
        plan = state.plan(calls)
        run.rule.lost = False
        failed = await self.calls.run_step(run, plan, unusable)
        await port.settle_previews()
        state.step_done(said_before, plan, cut=run.hit_length)
        run.talked_past_cap = said_before >= run.limits.max_messages and any(c.name in DELIVERIES for c in calls)
        if run.rule.end_requested:
            run.rule.end_requested = False
            if not run.rule.lost:  # a message that did not get out must not end the turn
                run.ended_by = "end_turn"
                return
        run.nudge = post_tool_nudge(failed, state.delivered)
        if run.length_stalls >= LENGTH_STALL_LIMIT:
            run.nudge += " " + self._length_advice(run)

    async def _answer(self, run: Run, completion: Completion) -> None:
        """A completion without tool calls (the endpoint did not force tools): the model's
        last word. It is delivered as any say would be, and the gate judges the ending."""
        state = run.state
        await run.port.settle_previews()  # a say streamed before an escalation asked again
        said_before = len(state.delivered)
        run.talked_past_cap = False
        text = fit_text(run.visible(completion.content), run)
        text = "" if blank(text) else storable_text(text)
        if text and state.already_said(text):
            run.trace.cut("exact_repeat", chars=len(text))
            text = ""
        elif text and len(state.delivered) >= run.limits.max_messages:
            run.trace.cut("message_cap", chars=len(text))
            run.talked_past_cap = True
            text = ""
        if text and not run.rule.undeliverable:
            await self._reply(run, text)  # recorded with its outbox row; counts the step
        else:
            state.steps += 1
        state.step_done(said_before, [], cut=run.hit_length)
        run.ended_by = "text"

    async def _close(self, run: Run) -> LoopResult:
        """The loop is over: say what the user must still be told, once.

        A turn with nothing delivered gets one tool-less try for a plain answer, whether the
        model ended it or it stopped at a limit (a weak model that only loops on tools can
        still answer in plain text), then an honest note. A turn that said something and then
        stopped at a limit (or that the check found undone to the end) gets closing words: the
        model is asked, without tools, to tell the user in their language what it did and what
        is left; a plain note when it cannot. Nothing is added past the turn's message cap (it
        counts every message the user gets), to an automation's turn (nobody is waiting for an
        apology), nor to a chat the platform refuses."""
        state, reason = run.state, run.stop_reason
        if reason is StopReason.STOPPED:
            await run.port.stopped()  # what was delivered stays; nothing more is said
            return self._result(run)
        if run.limits.silent_ok:
            # a scheduled or autonomous turn: silence is an answer, and nobody awaits an apology
            if not state.delivered:
                run.flags.add(StopFlag.SILENT)
            return self._result(run)
        if reason is StopReason.UNDELIVERABLE or len(state.delivered) >= run.limits.max_messages:
            return self._result(run)
        if not state.delivered and (reason.limit or reason in (StopReason.END_TURN, StopReason.FINAL_REPLY)):
            text = await self._plain_words(run, LAST_CHANCE_NUDGE, LAST_CHANCE_MAX_TOKENS)
            if text:
                run.flags.add(StopFlag.LAST_CHANCE)
                await self._reply(run, text)
                return self._result(run)
            if not reason.limit:
                run.flags.add(StopFlag.FALLBACK)
            await self._note(run, LIMIT_NOTES[reason] if reason.limit else NO_REPLY_MESSAGE)
            return self._result(run)
        if reason is StopReason.CONTEXT_FULL:
            await self._note(run, CONTEXT_FULL_MESSAGE)  # the window has no room to ask
            return self._result(run)
        if StopFlag.UNFINISHED in run.flags:
            unmet = clip(run.unmet.reason, REASON_CHARS) if run.unmet and run.unmet.reason else ""
            why = f"a check found the request not done yet: {unmet}" if unmet else "a check found the request not done yet"
            await self._closing_words(run, why, UNFINISHED_MESSAGE.format(why=f" ({unmet})" if unmet else ""))
        elif reason.limit:
            await self._closing_words(run, LIMIT_WHY[reason], LIMIT_NOTES[reason])
        return self._result(run)

    async def _closing_words(self, run: Run, why: str, note: str) -> None:
        """Tell the user once why the turn stopped: in the model's words when it gives new
        ones, else ``note`` (the trace's ``told`` says which). Recorded as the turn's end (a
        crash from here on finishes the turn instead of saying it again)."""
        text = await self._plain_words(run, CLOSING_NUDGE.format(why=why), CLOSING_MAX_TOKENS)
        if text and not run.state.already_said(text):
            run.trace.told = "model"
            await self._reply(run, text, closing=True)
        else:
            await self._note(run, note)

    async def _note(self, run: Run, text: str) -> None:
        """A plain note of the engine's, recorded as the turn's end."""
        run.trace.told = "note"
        await self._reply(run, text, note=True, closing=True)

    async def _reply(self, run: Run, text: str, *, note: bool = False, closing: bool = False) -> None:
        """A message of the loop's own: a plain-text reply (it counts as said) or a note,
        recorded with its outbox row; ``closing``: it ends the turn, so a resumed turn
        finishes instead of saying it again."""
        message = Message(role="assistant", content=text, note=note)
        report = await run.port.reply(message, closing=str(self._stop(run)) if closing else None)
        run.state.on_assistant(message)
        run.rule.reached(report)

    @staticmethod
    def _stop(run: Run) -> Stop:
        return Stop(run.stop_reason, frozenset(run.flags))

    def _result(self, run: Run) -> LoopResult:
        return LoopResult(messages=run.port.transcript, stop=self._stop(run), delivered=list(run.state.delivered))

    async def _plain_words(self, run: Run, nudge: str, max_tokens: int) -> str:
        """One tool-less completion with ``nudge``, its text as it may reach the user; ``""``
        when it fails or says nothing usable."""
        limits = run.limits
        try:
            request, _ = await run.requests.build(nudge)
            run.visible.echoes.add(nudge, model_words=_model_words(run))
            # without the tool rounds: a weak model shown them only writes another call as text,
            # and some servers refuse tool messages in a request that offers no tools
            completion = await self.llm.complete(
                plain_conversation(request), model=limits.model, max_tokens=min(limits.max_tokens, max_tokens),
                temperature=limits.temperature,
            )
        except Exception as exc:  # the plain note is sent instead
            log.info("a tool-less reply failed: %s", exc)
            return ""
        text = run.visible(completion.content)
        if len(text) > max_tokens * 4:
            run.trace.cut("say_budget", chars=len(text) - max_tokens * 4)
            text = text[: max_tokens * 4 - 1].rstrip() + "…"
        return "" if blank(text) else storable_text(text)

    def _length_advice(self, run: Run) -> str:
        return LENGTH_ADVICE_FILE if "write_file" in run.visible.tools else LENGTH_ADVICE

    def _repeated(self, run: Run, completion: Completion, request: list[dict[str, Any]]) -> float | None:
        """The share of the previous request the endpoint and model that answered got in this
        conversation that ``request`` repeats (``Prefixes``); ``request`` is the previous one now."""
        key = f"{completion.endpoint or ''}|{completion.model or run.limits.model}"
        return self.prefixes.repeated(run.ctx.conversation, key, run.requests.tool_schemas, request)

    async def _complete_fitting(
        self,
        request: list[dict[str, Any]],
        nudge: str | None,
        requests: RequestBuilder,
        limits: LoopLimits,
        on_say: SayListener | None = None,
        call: str | None = None,
    ) -> tuple[Completion, list[dict[str, Any]]]:
        """One completion, and the request it answers; a context-length refusal compacts (or
        prunes) and retries once."""
        try:
            return await self._complete(request, requests.tool_schemas, limits, on_say, call), request
        except ContextTooLong as exc:
            # compact (or prune) and retry once; a second refusal ends the turn
            await requests.observe_refusal(exc.prompt_tokens)  # estimates were low: learn now
            await requests.shrink()
            request, _ = await requests.build(nudge)
            return await self._complete(request, requests.tool_schemas, limits, on_say, call), request

    def _speak_now(self, run: Run) -> bool:
        """Whether this step must be a ``say``: the person is waiting for a chat turn that has
        shown them nothing yet, and either the model already tried to end it so (the gate
        sent it back) or they have waited ``first_words_s``. The model still writes the
        words; it only may not spend another step on anything else first (a weak model that
        ends or keeps calling tools without a word, a slow endpoint where each step takes
        many seconds). Decided from delivery state and time, never from what was written."""
        limits = run.limits
        if run.state.delivered or limits.silent_ok or run.rule.undeliverable or "say" not in run.visible.tools:
            return False
        if run.unmet is not None:
            return True
        return limits.first_words_s is not None and self.clock() - run.started >= limits.first_words_s

    async def abandon(self, port: TurnPort, reason: str) -> None:
        """The turn ends without the loop (a bug stopped it mid-step, or it is given up after
        repeated crashes): give its cut-off calls a result, so the history stays a valid
        sequence. A ``say`` gets what its delivery did (nothing new is sent); a work call
        ``not completed: <reason>``."""
        await close_open_calls(port, ToolResult.error(f"not completed: {reason}"))

    async def _complete(
        self, request: list[dict[str, Any]], schemas: list[dict[str, Any]], limits: LoopLimits,
        on_say: SayListener | None = None, call: str | None = None,
    ) -> Completion:
        return await self.llm.complete(
            request,
            model=limits.model,
            max_tokens=limits.max_tokens,
            temperature=limits.temperature,
            tools=schemas,
            thinking=limits.thinking,
            on_say=on_say,
            call=call,
        )


def _model_words(run: Run) -> list[str]:
    """What the notes of this turn quote of the model's (the echo rule leaves it alone)."""
    return model_words(run.state.delivered, run.unmet.reason if run.unmet else None)
