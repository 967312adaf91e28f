"""Scheduled tasks: ``schedule_task``, ``list_tasks``, ``cancel_task``.

Built around the daemon's :class:`~bumblebot.runtime.scheduler.Scheduler` (:func:`task_tools`): a task
belongs to the conversation that made it, runs there later as an automation turn with the same
tools and limits as any turn, and says only what the entity chooses to say then. They are work
tools: making a reminder is work the completion gate can see was done.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field

from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult
from bumblebot.runtime.schedule import describe
from bumblebot.runtime.scheduler import Scheduler, TaskError

from .definition import Tool, make_tool

__all__ = ["task_tools"]

#: Longest task text, characters.
MAX_TASK_CHARS = 2000


def task_tools(scheduler: Scheduler) -> tuple[Tool, ...]:
    """``schedule_task``, ``list_tasks`` and ``cancel_task`` on ``scheduler``."""

    async def schedule_task(
        ctx: ToolContext,
        when: Annotated[str, Field(description="ISO 8601 time with offset, 'in N minutes', 'every N hours', or a 5-field cron expression", max_length=100)],
        task: Annotated[str, Field(description="What to do or say then, written as an instruction to yourself", max_length=MAX_TASK_CHARS)],
    ) -> ToolResult:
        try:
            made = await scheduler.create(ctx.conversation, when, task)
        except TaskError as exc:
            return ToolResult.error(str(exc))
        return ToolResult(json.dumps({
            "task_id": made.id, "next_due": scheduler.when(made.next_due), "schedule": describe(made.kind, made.spec),  # type: ignore[arg-type]
        }, ensure_ascii=False))

    async def list_tasks(ctx: ToolContext) -> ToolResult:
        return ToolResult(scheduler.listing(await scheduler.tasks(ctx.conversation)))

    async def cancel_task(
        ctx: ToolContext,
        task_id: Annotated[int, Field(description="The id list_tasks shows (#3 is 3)", ge=1, lt=2**62)],
    ) -> ToolResult:
        try:
            await scheduler.cancel(ctx.conversation, task_id)
        except TaskError as exc:
            return ToolResult.error(str(exc))
        return ToolResult(json.dumps({"cancelled": task_id}))

    return (
        make_tool(
            schedule_task, kind=ToolKind.WORK,
            description="Schedule a task for later in this chat: a reminder or recurring work. At the due time "
            "you get a turn with the task text and may say something or stay silent. Times are read in your "
            "time zone unless they carry an offset.",
            brief="Schedule a reminder or recurring task.",
        ),
        make_tool(list_tasks, kind=ToolKind.WORK, description="List this chat's scheduled tasks with ids and next due times.",
                  brief="List scheduled tasks.", optional=True),
        make_tool(cancel_task, kind=ToolKind.WORK, description="Cancel one of this chat's scheduled tasks by id.",
                  brief="Cancel a scheduled task.", optional=True),
    )
