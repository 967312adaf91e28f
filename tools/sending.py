"""``send_file``: a workspace file sent to the chat, through the outbox like any message.

An image (PNG, JPEG, WebP, GIF, by its content, within the platform's photo limit) goes as a
photo, anything else as a document (Telegram: ``sendPhoto``/``sendDocument``; Discord: an
attachment). The platform's upload limit is checked before anything is queued (Telegram 50 MB,
10 MB for photos; Discord 10 MB). It is a work tool (it counts as work for the completion
gate) that is never cut off by the tool timeout, like ``say``: a slow upload cut off halfway
would be sent again by the outbox. A turn cut off by a crash while it ran reads what became of
it from its outbox row. Only a regular file is sent: a named pipe or a device is refused
before anything opens it, and what reads the file later opens it without blocking
(:func:`bumblebot.core.regular.open_regular`).
"""

from __future__ import annotations

import os
import stat
from typing import Annotated

from pydantic import Field

from bumblebot.core.events import storable_text
from bumblebot.core.regular import describe_kind
from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .definition import Tool, tool
from .files import PathError, resolve_in_workspace

__all__ = ["SENDING_TOOLS", "send_file"]

#: Longest caption, characters: under Telegram's caption limit (1,024; Discord's message limit is
#: 2,000), and under what a server that constrains calls to their schema accepts: llama.cpp's
#: grammar parser refuses to repeat a character much more than a thousand times, and
#: llama-cpp-python 0.3.36's server dies of a maxLength of 1,024.
MAX_CAPTION_CHARS = 1000


@tool(kind=ToolKind.WORK, brief="Send a workspace file to the chat (images as photos).")
async def send_file(
    ctx: ToolContext,
    path: Annotated[str, Field(description="The file, relative to the workspace")],
    caption: Annotated[str, Field(description="Optional text sent with it", max_length=MAX_CAPTION_CHARS)] = "",
) -> ToolResult:
    """Send a file of the workspace to the user, as a photo when it is an image, else as a
    document. Returns ``{"delivered": bool, "queued": bool, "error"?: str}`` like ``say``."""
    if ctx.turn is None:
        return ToolResult.error("no turn is running")
    try:
        target = resolve_in_workspace(ctx.workspace, path, chat=ctx.conversation, own_only=ctx.own_files_only)
    except PathError as exc:
        return ToolResult.error(str(exc))
    try:
        found = os.stat(target, follow_symlinks=False).st_mode
    except OSError:  # missing, or a name longer than the file system allows
        return ToolResult.error(f"no such file in the workspace: {path}")
    if not stat.S_ISREG(found):  # a named pipe would hold the thread that reads it for ever
        return ToolResult.error(f"{storable_text(path)} is not a regular file ({describe_kind(found)})")
    if storable_text(str(target)) != str(target):
        # bytes that are no UTF-8 (a file unpacked from elsewhere): the name can be neither
        # shown in a chat nor kept in the outbox, which sends the file after a restart too
        return ToolResult.error(f"{storable_text(path)} is (or points to) a file whose name is not UTF-8 text; copy or rename it first")
    report = await ctx.turn.send_file(target, caption.strip(), call_id=ctx.call_id)
    return report.as_result()


#: The sending tools, in the order they are offered.
SENDING_TOOLS: tuple[Tool, ...] = (send_file,)
