"""Telegram through python-telegram-bot: long polling; private chats, groups and forum topics.

:class:`TelegramAdapter` is composed of one part per concept: the intake of messages, edits
and service messages with the group gate (:mod:`adapters.telegram.intake`, reading messages
through :mod:`adapters.telegram.reading`), commands and the Stop button
(:mod:`adapters.telegram.commands`), messages and streamed previews out
(:mod:`adapters.telegram.sending`, rendered by :mod:`adapters.telegram.render`, paced by
:mod:`adapters.telegram.pacing`) and files in and out (:mod:`adapters.telegram.files`). Who
gets an answer is :mod:`adapters.telegram.policy`. This module holds the lifecycle and the
polling loop, and wires the handlers.

Why our own polling loop instead of PTB's ``Updater``: the ``Updater`` asks for the next batch
(which acknowledges the previous one to Telegram) as soon as it has queued the updates, before
any handler ran, so a crash in between loses messages. Here each update is fed to the PTB
``Application`` (handlers, command parsing) and journaled — together with the next offset, in
one SQLite transaction — before the next ``getUpdates`` moves the offset past it. A restart
resumes from the stored offset, so an update that was answered is never answered again; an
update Telegram delivers again is dropped by the journal's uniqueness on (chat, message id).
Past an update no handler journals (a service message, an edit) the poller moves the offset
itself; an update whose recording fails is retried, and skipped after
:data:`MAX_UPDATE_ATTEMPTS` so others can flow; one python-telegram-bot cannot read at all is
logged and skipped at once (:mod:`adapters.telegram.polling`). A 409 ``Conflict`` (another
instance polling the same token) is fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from telegram import Update
from telegram.error import Conflict, InvalidToken, NetworkError, RetryAfter, TelegramError, TimedOut
from telegram.ext import (
    Application,
    ApplicationBuilder,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    filters,
)

from adapters.bots import BotTurnBudget
from adapters.telegram.commands import MENU, TelegramCommands
from adapters.telegram.files import TelegramFiles
from adapters.telegram.intake import TelegramIntake
from adapters.telegram.pacing import Pacer
from adapters.telegram.polling import PollingRequest
from adapters.telegram.reading import seconds
from adapters.telegram.sending import STOP_DATA, TelegramSending
from adapters.telegram.webhook import WebhookServer, secret_problem
from bumblebot.core.adapter import Adapter, Intake
from bumblebot.core.errors import STORE_FAILURES, AdapterError, ConfigError, StoreError
from bumblebot.core.events import Platform
from bumblebot.core.settings import MediaSettings, TelegramSettings

log = logging.getLogger(__name__)

OFFSET_KEY = "telegram.offset"
#: Attempts at recording one update before it is skipped (logged) so others can flow.
MAX_UPDATE_ATTEMPTS = 5
PRIVACY_NOTE = (
    "Telegram: privacy mode is on for @%s: in groups it only sees messages that mention it, reply "
    "to it or are commands, so telegram.group_context has nothing to show. To let it read "
    "the whole group: @BotFather, /mybots, the bot, Bot Settings, Group Privacy, Turn off; then "
    "remove the bot from each group and add it again"
)
#: Updates asked of getUpdates: messages, their edits, and the Stop button's presses.
ALLOWED_UPDATES = ["message", "edited_message", "callback_query"]


class TelegramAdapter(TelegramIntake, TelegramCommands, TelegramSending, TelegramFiles, Adapter):
    """Connects the engine to one Telegram bot: the handlers (intake, commands), sending and
    files come from the parts it is composed of; here are the lifecycle and the polling loop.

    Args:
        intake: the engine, as adapters see it.
        settings: the ``telegram`` config section.
        token: the bot token (``TELEGRAM_BOT_TOKEN``); never logged.
        media: the ``media`` config section.
        pacer: paces every call to a chat (default: one with Telegram's published limits).
    """

    platform = Platform.TELEGRAM

    def __init__(
        self, intake: Intake, settings: TelegramSettings, token: str, *, media: MediaSettings | None = None,
        pacer: Pacer | None = None, poller_role: asyncio.Event | None = None, webhook_secret: str | None = None,
    ) -> None:
        self.pacer = pacer or Pacer()
        #: a worker of a cluster polls only while this is set (it holds ``telegram.poller``)
        self._poller_role = poller_role
        self._webhook: WebhookServer | None = None
        if settings.webhook_url:  # updates come by webhook: nobody polls
            if (problem := secret_problem(webhook_secret)) is not None:
                raise ConfigError("environment", "TELEGRAM_WEBHOOK_SECRET", problem)
            assert webhook_secret is not None
            self._webhook = WebhookServer(settings.webhook_url, settings.webhook_listen, webhook_secret, self._take_update)
            self._webhook_secret = webhook_secret
        self.intake = intake
        self.settings = settings
        self.media = media or MediaSettings()
        self._polling = PollingRequest(read_timeout=settings.poll_timeout_s + 10)
        self.app: Application = (  # type: ignore[type-arg]
            ApplicationBuilder()
            .token(token)
            .base_url(settings.base_url)
            .base_file_url(settings.base_file_url)
            .updater(None)
            .get_updates_request(self._polling)
            .build()
        )
        self._polling.bot = self.app.bot
        # first: every other handler's filters (TEXT, COMMAND, PHOTO…) match edited messages
        # too, and an edit must never be answered as a new message
        self.app.add_handler(MessageHandler(filters.UpdateType.EDITED, self._on_edit))
        self.app.add_handler(CallbackQueryHandler(self._on_stop_button, pattern=f"^{STOP_DATA}$"))
        self.app.add_handler(MessageHandler(filters.StatusUpdate.MIGRATE, self._on_migrate))
        # joins, pins, title changes, topic creation: not speech; never answered or kept
        self.app.add_handler(MessageHandler(filters.StatusUpdate.ALL, self._on_service))
        self.app.add_handler(CommandHandler([c.command for c in MENU], self._on_command))
        self.app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, self._on_text))
        self.app.add_handler(MessageHandler(filters.COMMAND, self._on_unknown_command))
        self.app.add_handler(MessageHandler(
            filters.PHOTO | filters.Document.ALL | filters.VOICE | filters.AUDIO | filters.VIDEO | filters.VIDEO_NOTE,
            self._on_files,
        ))
        self.app.add_handler(MessageHandler(
            filters.Sticker.ALL | filters.LOCATION | filters.CONTACT | filters.POLL | filters.Dice.ALL, self._on_described,
        ))
        self.app.add_handler(MessageHandler(filters.ALL, self._on_unsupported))
        self.app.add_error_handler(self._on_error)
        self._handler_error: BaseException | None = None
        self._update_failures: dict[int, int] = {}
        self._poller: asyncio.Task[None] | None = None
        self._pending_kv: dict[str, str] = {}
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._started = False
        self._bot_budget = BotTurnBudget()
        self._albums: dict[str, int] = {}  # albums answered lately, with the parts taken (oldest first)
        self._menu: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("Telegram adapter already started")
        self._started = True
        try:
            await self.app.initialize()
        except InvalidToken as exc:
            raise AdapterError("Telegram rejected the bot token (TELEGRAM_BOT_TOKEN); get one from @BotFather") from exc
        except TelegramError as exc:
            raise AdapterError(f"cannot reach Telegram at {self.settings.base_url}: {exc.message}") from exc
        await self.app.start()
        if self._webhook is not None:
            await self._start_webhook()
        else:
            with contextlib.suppress(TelegramError):
                await self.app.bot.delete_webhook(drop_pending_updates=False)
            self._poller = asyncio.create_task(self._poll(), name="bumblebot:telegram:poll")
        # the command menu is a convenience: it goes up while the first updates are read
        self._menu = asyncio.create_task(self._set_menu(), name="bumblebot:telegram:menu")
        log.info("Telegram: %s as @%s", "by webhook" if self._webhook else "polling", self.app.bot.username)
        if self.settings.respond_in_groups != "never" and self.app.bot.can_read_all_group_messages is False:
            log.warning(PRIVACY_NOTE, self.app.bot.username)

    async def _set_menu(self) -> None:
        with contextlib.suppress(TelegramError):
            await self.app.bot.set_my_commands(MENU)

    async def _start_webhook(self) -> None:
        assert self._webhook is not None
        try:
            await self._webhook.start()
        except OSError as exc:
            raise AdapterError(f"cannot serve the Telegram webhook on {self.settings.webhook_listen}: {exc.strerror or exc}") from exc
        try:
            await self.app.bot.set_webhook(
                self.settings.webhook_url, secret_token=self._webhook_secret, allowed_updates=ALLOWED_UPDATES,
            )
        except TelegramError as exc:
            await self._webhook.stop()
            raise AdapterError(f"Telegram refused the webhook {self.settings.webhook_url}: {exc.message}") from exc

    async def _take_update(self, data: dict[str, object]) -> bool:
        """One update from the webhook through the handlers: whether it is recorded (or cannot
        be, ever); ``False``: the database failed, or this process stops, and Telegram sends
        it again."""
        if not self.intake.accepting:
            return False
        update = Update.de_json(data, self.app.bot)
        if update is None:
            return True
        self._pending_kv, self._handler_error = {}, None
        await self.app.process_update(update)
        if self._handler_error is not None and not _may_pass(self._handler_error):
            log.error("Telegram: update %s cannot be handled (%r); skipped", update.update_id, self._handler_error)
            return True
        if self._handler_error is not None:
            log.error("Telegram: update %s not recorded (%s); Telegram sends it again", update.update_id, self._handler_error)
            return False
        return self.intake.accepting

    async def stop_intake(self) -> None:
        if self._webhook is not None:
            await self._webhook.stop()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.stop_intake()
        if self._menu is not None and not self._menu.done():
            self._menu.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._menu
        if self.app.running:
            await self.app.stop()
        await self.app.shutdown()
        if self.failure.done():
            self.failure.exception()  # logged when it came; once stopped, nobody waits for it

    # -- polling -----------------------------------------------------------------------------

    async def _poll(self) -> None:
        """``getUpdates`` from the stored offset, each update through the handlers and journaled
        with the next offset before the next batch is asked for."""
        stored = await self.intake.cursor(OFFSET_KEY)
        offset = int(stored) if stored else 0
        backoff = 1.0
        while True:
            if self._poller_role is not None and not self._poller_role.is_set():
                await self._poller_role.wait()  # another worker polls meanwhile, and moves the offset
                stored = await self.intake.cursor(OFFSET_KEY)
                offset = int(stored) if stored else 0
            try:
                await self.app.bot.get_updates(  # the batch is read update by update by self._polling
                    offset=offset, timeout=self.settings.poll_timeout_s, allowed_updates=ALLOWED_UPDATES,
                    limit=1 if offset <= self._polling.narrow_until else None,
                )
                backoff = 1.0
            except Conflict as exc:
                if self._poller_role is not None:  # the last poller's request is still open: a handover
                    log.warning("Telegram: another worker's getUpdates is still open; retrying")
                    await asyncio.sleep(1.0)
                    continue
                log.error("Telegram: another process is polling this bot token (409 Conflict); stopping")
                if not self.failure.done():
                    self.failure.set_exception(AdapterError(f"Telegram conflict: {exc.message}"))
                return
            except InvalidToken as exc:
                if not self.failure.done():
                    self.failure.set_exception(AdapterError("Telegram rejected the bot token"))
                log.error("Telegram: %s", exc.message)
                return
            except RetryAfter as exc:
                await asyncio.sleep(seconds(exc.retry_after))
                continue
            except (TimedOut, NetworkError) as exc:
                log.warning("Telegram: polling failed (%s); retrying in %.0f s", exc.message, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            except Exception:  # a library bug must not end the polling for good
                log.exception("Telegram: polling failed; retrying in %.0f s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            for update_id, update in self._polling.take_batch():
                next_offset = update_id + 1
                if update is None:  # one python-telegram-bot cannot read (logged): passed
                    await self.intake.set_cursor(OFFSET_KEY, str(next_offset))
                    offset = next_offset
                    continue
                self._pending_kv = {OFFSET_KEY: str(next_offset)}
                self._handler_error = None
                await self.app.process_update(update)
                if not self.intake.accepting:
                    return  # stopping: never move the offset past an update we did not journal
                if self._handler_error is not None and not _may_pass(self._handler_error):
                    log.error("Telegram: update %s cannot be handled (%r); skipped", update.update_id, self._handler_error)
                elif self._handler_error is not None:
                    # the database is unavailable: keep the update unacknowledged, retry later;
                    # an update that fails every time must not block everyone else for ever
                    tries = self._update_failures.get(update.update_id, 0) + 1
                    self._update_failures = {update.update_id: tries}
                    if tries < MAX_UPDATE_ATTEMPTS:
                        delay = min(2.0**tries, 60.0)
                        log.error(
                            "Telegram: update %s not recorded (%s); retry %d in %.0f s",
                            update.update_id, self._handler_error, tries, delay,
                        )
                        await asyncio.sleep(delay)
                        break
                    log.error("Telegram: giving up on update %s after %d attempts", update.update_id, tries)
                    await self.intake.set_cursor(OFFSET_KEY, str(next_offset))
                if self._pending_kv:  # no handler journaled it (an update we do not answer)
                    await self.intake.set_cursor(OFFSET_KEY, str(next_offset))
                    self._pending_kv = {}
                offset = next_offset

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A handler raised: :meth:`_poll` retries the update if the store failed
        (:func:`_may_pass`), and skips it otherwise."""
        self._handler_error = context.error
        log.error("Telegram: handler failed: %r", context.error)

    def _take_kv(self) -> dict[str, str]:
        """The next update offset for the handler that journals the update (once)."""
        kv, self._pending_kv = self._pending_kv, {}
        return kv


def _may_pass(error: BaseException) -> bool:
    """Whether a handler's ``error`` may pass with time: the database (locked, the disk full,
    unreachable), so the update is tried again. Anything else fails the same way every time
    (an update whose fields are not what the Bot API promises): it is skipped at once, not
    after minutes of retries that hold every other chat's updates back."""
    return isinstance(error, (StoreError, *STORE_FAILURES, OSError))
