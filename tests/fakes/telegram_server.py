"""A fake Telegram Bot API server for tests (aiohttp on 127.0.0.1, port 0).

Point python-telegram-bot at it with ``base_url=tg.base_url`` and
``base_file_url=tg.base_file_url``; PTB appends the token (``/bot<token>/<method>``).
Request decoding and response shapes follow /work/shared/notes/test-infra.md section 1
(form fields carry JSON for non-string values; ``{"ok": true, "result": ...}``).

Usage::

    async with FakeTelegram() as tg:
        tg.push_text("/start")
        ... run the bot ...
        calls = await tg.wait_for("sendMessage")
        assert tg.sent(chat_id=1001) == ["hello"]
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, NamedTuple

from aiohttp import web

BOT_USER = {"id": 4242, "is_bot": True, "first_name": "FakeBot", "username": "fake_bot"}
GET_ME = {**BOT_USER, "can_join_groups": True, "can_read_all_group_messages": False,
          "supports_inline_queries": False}
MAX_TEXT_UTF16 = 4096  # Bot API sendMessage: "1-4096 characters after entities parsing"
_COMMAND_NAME = re.compile(r"[a-z0-9_]{1,32}")  # Bot API BotCommand.command
# Fields the Bot API types as String: PTB sends them raw, so "42" must stay a string.
_STRING_FIELDS = frozenset({"text", "caption", "parse_mode", "action", "title", "description",
                            "short_description", "name", "language_code", "emoji", "url"})


class Call(NamedTuple):
    """One API call: ``method``, decoded ``params``, ``content_type``, monotonic ``time`` (s)."""

    method: str
    params: dict[str, Any]
    content_type: str
    time: float


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, the unit of Telegram's limits and entity offsets."""
    return len(text.encode("utf-16-le")) // 2


def retry_after_body(seconds: int) -> dict[str, Any]:
    """Body of Telegram's flood-control error (send with status 429 → PTB ``RetryAfter``)."""
    return {"ok": False, "error_code": 429,
            "description": f"Too Many Requests: retry after {seconds}",
            "parameters": {"retry_after": seconds}}


def bad_request_body(description: str) -> dict[str, Any]:
    """Body of a 400 error (→ PTB ``BadRequest``); adds the ``Bad Request: `` prefix."""
    if not description.startswith("Bad Request: "):
        description = f"Bad Request: {description}"
    return {"ok": False, "error_code": 400, "description": description}


def visible_text(text: str, parse_mode: str | None) -> str:
    """Approximate the text left after Telegram parses ``parse_mode`` markup (for limits only)."""
    if parse_mode and parse_mode.upper() == "HTML":
        return html.unescape(re.sub(r"<[^>]*>", "", text))
    if parse_mode and parse_mode.lower().startswith("markdown"):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        return re.sub(r"\\(.)|[*_~`|]", lambda m: m.group(1) or "", text)
    return text


class FakeTelegram:
    """Fake Bot API; see the module docstring for usage and the methods it serves."""

    def __init__(self, token: str = "123:TEST") -> None:
        self.token = token
        self.calls: list[Call] = []
        self.updates: list[dict[str, Any]] = []  # pending (unconfirmed) updates
        # (chat id, message id) -> Message, for pushed and sent messages
        self.messages: dict[tuple[int, int], dict[str, Any]] = {}
        self.commands: dict[str, list[dict[str, Any]]] = {}  # scope key -> BotCommand list
        self.confirmed_offset = 0
        self.next_update_id = 1
        self.base_url = self.base_file_url = ""
        self._next_message_id = 1
        self._chats: dict[int, dict[str, Any]] = {}
        self.get_me = dict(GET_ME)  # getMe's answer (e.g. can_read_all_group_messages)
        self.member_status: dict[tuple[int, int], str] = {}  # (chat, user) -> getChatMember status
        self.migrated: dict[int, int] = {}  # old group id -> supergroup id (sends to it fail)
        self._failures: dict[str, deque[tuple[int, dict[str, Any]]]] = {}
        self._called = asyncio.Condition()
        self._pushed = asyncio.Event()  # set on push; a sync push cannot hold a Condition's lock
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "getMe": lambda p: self.get_me, "deleteWebhook": lambda p: True,
            "getChatMember": self._get_chat_member,
            "sendChatAction": lambda p: True, "close": lambda p: True, "logOut": lambda p: True,
            "sendMessage": self._send_message, "editMessageText": self._edit_message_text,
            "deleteMessage": self._delete_message, "setMyCommands": self._set_my_commands,
            "getMyCommands": lambda p: self.commands.get(_scope_key(p), []),
            "deleteMyCommands": self._delete_my_commands,
            "answerCallbackQuery": self._answer_callback_query,
        }
        self.callback_answers: list[dict[str, Any]] = []  # answerCallbackQuery params

    # ---- test API -------------------------------------------------------------------------
    def push_update(self, update: dict[str, Any]) -> None:
        """Queue ``update`` as is (so the same update can be pushed twice) and wake long polls."""
        self.updates.append(update)
        self.next_update_id = max(self.next_update_id, int(update["update_id"]) + 1)
        self._pushed.set()

    def push_text(self, text: str, chat_id: int = 1001, user_id: int | None = None,
                  chat_type: str = "private", first_name: str = "Alice",
                  username: str | None = "alice", message_id: int | None = None,
                  reply_to: int | None = None, thread_id: int | None = None,
                  is_forum: bool = False, is_bot: bool = False,
                  entities: list[dict[str, Any]] | None = None,
                  quote: str | None = None) -> dict[str, Any]:
        """Push a text message from a user; return the update. A leading ``/word`` gets a
        ``bot_command`` entity and ``@name`` words get ``mention`` entities (UTF-16 offsets);
        ``entities`` adds more (e.g. a ``text_mention``).

        Groups: ``chat_type`` ``"group"`` or ``"supergroup"`` (``is_forum`` for topics). In a
        forum, ``thread_id`` names the topic (``is_topic_message``, and the message "replies"
        to the topic's first message, as Telegram does); ``None`` is the General topic. Outside
        forums ``thread_id`` is a reply thread (no ``is_topic_message``). ``quote``: the part
        of the replied-to message the user quoted."""
        user = {"id": chat_id if user_id is None else user_id, "is_bot": is_bot,
                "first_name": first_name, **({"username": username} if username else {})}
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        chat.update({"first_name": first_name, **({"username": username} if username else {})}
                    if chat_type == "private" else {"title": "Test Group"})
        if is_forum:
            chat["is_forum"] = True
        self._chats[chat_id] = chat
        message: dict[str, Any] = {
            "message_id": message_id or self._new_message_id(), "date": int(time.time()),
            "chat": chat, "from": user, "text": text}
        found = [{"type": "bot_command", "offset": 0, "length": utf16_len(m.group())}
                 for m in [re.match(r"/\S+", text)] if m]
        found += [{"type": "mention", "offset": utf16_len(text[:m.start()]),
                   "length": utf16_len(m.group())}
                  for m in re.finditer(r"(?<![\w/])@\w{3,}", text)]
        found += entities or []
        if found:
            message["entities"] = found
        if thread_id is not None:
            message["message_thread_id"] = thread_id
            if is_forum or chat_type == "private":
                message["is_topic_message"] = True
                if reply_to is None:  # Telegram: a topic's messages reply to its first message
                    message["reply_to_message"] = {
                        "message_id": thread_id, "date": message["date"], "chat": chat,
                        "from": user, "forum_topic_created": {"name": "Topic", "icon_color": 7322096}}
        if reply_to is not None:
            stub = {"message_id": reply_to, "date": message["date"], "chat": chat}
            message["reply_to_message"] = self.messages.get((chat_id, reply_to), stub)
        if quote is not None:
            message["quote"] = {"text": quote, "position": 0}
        self.messages[(chat_id, message["message_id"])] = message
        update = {"update_id": self.next_update_id, "message": message}
        self.push_update(update)
        return update

    def push_migration(self, old_chat_id: int, new_chat_id: int) -> None:
        """A group becomes a supergroup: the two service messages Telegram sends (in the old
        chat and the new one); from now on sends to the old id fail with ``migrate_to_chat_id``."""
        old = self._chats.get(old_chat_id, {"id": old_chat_id, "type": "group", "title": "Test Group"})
        new = {**old, "id": new_chat_id, "type": "supergroup"}
        self._chats[new_chat_id] = new
        self.migrated[old_chat_id] = new_chat_id
        admin = {"id": 1, "is_bot": False, "first_name": "Admin"}
        for chat, field, value in ((old, "migrate_to_chat_id", new_chat_id), (new, "migrate_from_chat_id", old_chat_id)):
            message = {"message_id": self._new_message_id(), "date": int(time.time()), "chat": chat,
                       "from": admin, field: value}
            self.push_update({"update_id": self.next_update_id, "message": message})

    def push_callback_query(self, chat_id: int, message_id: int, data: str, user_id: int | None = None,
                            first_name: str = "Alice") -> dict[str, Any]:
        """Push a press of an inline button (``callback_data`` ``data``) under the bot's
        message ``message_id`` in ``chat_id``; return the update."""
        user = {"id": chat_id if user_id is None else user_id, "is_bot": False, "first_name": first_name}
        message = self.messages.get((chat_id, message_id)) or {
            "message_id": message_id, "date": int(time.time()), "from": BOT_USER, "text": "",
            "chat": self._chats.get(chat_id, {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"})}
        update = {"update_id": self.next_update_id,
                  "callback_query": {"id": f"cq{self.next_update_id}", "from": user, "message": message,
                                     "chat_instance": str(chat_id), "data": data}}
        self.push_update(update)
        return update

    def shown(self, chat_id: int) -> list[str]:
        """What the chat shows of the bot now: the current text of each of its messages there
        (edits applied, deleted ones gone), oldest first."""
        return [m["text"] for (chat, _), m in sorted(self.messages.items())
                if chat == chat_id and m.get("from", {}).get("id") == BOT_USER["id"]]

    def fail_next(self, method: str, status: int, body: dict[str, Any], times: int = 1) -> None:
        """Answer the next ``times`` calls of ``method`` with ``status`` and ``body``."""
        self._failures.setdefault(method, deque()).extend([(status, body)] * times)

    def sent(self, chat_id: int | None = None) -> list[str]:
        """Texts of all sendMessage calls (successful or not), optionally for one chat."""
        return [c.params.get("text", "") for c in self.calls if c.method == "sendMessage"
                and (chat_id is None or int(c.params.get("chat_id", 0)) == chat_id)]

    async def wait_for(self, method: str, n: int = 1, timeout: float = 5.0,
                       predicate: Callable[[dict[str, Any]], bool] | None = None) -> list[Call]:
        """Wait until ``n`` calls of ``method`` (matching ``predicate(params)``) were received;
        return all matching calls. AssertionError on timeout, listing what was called."""
        def matching() -> list[Call]:
            return [c for c in self.calls
                    if c.method == method and (predicate is None or predicate(c.params))]
        try:
            async with asyncio.timeout(timeout):
                async with self._called:
                    await self._called.wait_for(lambda: len(matching()) >= n)
        except TimeoutError:
            seen = dict(Counter(c.method for c in self.calls))
            raise AssertionError(f"FakeTelegram: wanted {n} {method} call(s) within {timeout}s, "
                                 f"got {len(matching())}; calls so far: {seen}") from None
        return matching()

    # ---- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> FakeTelegram:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.25, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        root = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self.base_url, self.base_file_url = f"{root}/bot", f"{root}/file/bot"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closing = True
        self._pushed.set()  # release pending long polls so shutdown is immediate
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- HTTP -----------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _error(401, {"ok": False, "error_code": 401, "description": "Unauthorized"})
        method, params = request.match_info["method"], await _params(request)
        async with self._called:
            self.calls.append(Call(method, params, request.content_type, time.monotonic()))
            self._called.notify_all()
        failures = self._failures.get(method)
        if failures:
            return _error(*failures.popleft())
        if method == "getUpdates":
            return web.json_response({"ok": True, "result": await self._get_updates(params)})
        handler = self._handlers.get(method)
        if handler is None:
            return _error(404, {"ok": False, "error_code": 404,
                                "description": "Not Found: method not found"})
        result = handler(params)
        if isinstance(result, web.Response):
            return result
        return web.json_response({"ok": True, "result": result})

    async def _get_updates(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Bot API getUpdates: ids below ``offset`` are confirmed and forgotten; a negative
        offset keeps the last ``-offset``; waits up to ``timeout`` s for something to return."""
        offset = int(params.get("offset") or 0)
        limit = min(max(int(params.get("limit") or 100), 1), 100)
        if offset > 0:
            self.confirmed_offset = max(self.confirmed_offset, offset)
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
        elif offset < 0:
            self.updates = self.updates[offset:]
        deadline = time.monotonic() + float(params.get("timeout") or 0)
        while not self.updates and not self._closing:
            self._pushed.clear()
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._pushed.wait()
            except TimeoutError:
                break
        return self.updates[:limit]

    def _new_message_id(self) -> int:
        self._next_message_id += 1
        return self._next_message_id - 1

    def _bot_message(self, params: dict[str, Any], message_id: int) -> dict[str, Any]:
        chat_id = int(params["chat_id"])
        chat = self._chats.get(chat_id, {"id": chat_id,
                                         "type": "private" if chat_id > 0 else "supergroup"})
        return {"message_id": message_id, "date": int(time.time()), "chat": chat,
                "from": BOT_USER, "text": params.get("text", "")}

    def _get_chat_member(self, params: dict[str, Any]) -> dict[str, Any]:
        chat_id, user_id = int(params["chat_id"]), int(params["user_id"])
        status = self.member_status.get((chat_id, user_id), "member")
        user = {"id": user_id, "is_bot": False, "first_name": "Member"}
        member: dict[str, Any] = {"status": status, "user": user}
        if status == "administrator":
            member.update(can_be_edited=False, is_anonymous=False, can_manage_chat=True,
                          can_delete_messages=True, can_manage_video_chats=True,
                          can_restrict_members=True, can_promote_members=False,
                          can_change_info=True, can_invite_users=True, can_post_stories=False,
                          can_edit_stories=False, can_delete_stories=False)
        elif status == "creator":
            member.update(is_anonymous=False)
        return member

    def _send_message(self, params: dict[str, Any]) -> Any:
        invalid = _text_error(params)
        if invalid:
            return invalid
        chat_id = int(params["chat_id"])
        if chat_id in self.migrated:
            return _error(400, {"ok": False, "error_code": 400,
                                "description": "Bad Request: group chat was upgraded to a supergroup chat",
                                "parameters": {"migrate_to_chat_id": self.migrated[chat_id]}})
        thread = int(params.get("message_thread_id") or 0)
        if thread == 1 or (thread and not self._chats.get(chat_id, {}).get("is_forum")
                           and self._chats.get(chat_id, {}).get("type") != "private"):
            # Bot API: the General topic takes no thread id, and non-forums have no topics
            return _error(400, bad_request_body("message thread not found"))
        message = self._bot_message(params, self._new_message_id())
        if params.get("reply_markup"):
            message["reply_markup"] = params["reply_markup"]
        if thread:
            message.update(message_thread_id=thread, is_topic_message=True)
        reply = params.get("reply_parameters") or {}
        replied = self.messages.get((message["chat"]["id"], reply.get("message_id", 0)))
        if replied:
            message["reply_to_message"] = replied
        self.messages[(message["chat"]["id"], message["message_id"])] = message
        return message

    def _edit_message_text(self, params: dict[str, Any]) -> Any:
        invalid = _text_error(params)
        if invalid:
            return invalid
        key = (int(params["chat_id"]), int(params["message_id"]))
        old = self.messages.get(key)
        if old is None or old.get("from", {}).get("id") != BOT_USER["id"]:
            return _error(400, bad_request_body("message to edit not found"))
        markup = params.get("reply_markup") or None  # an edit without one removes the keyboard
        if old["text"] == params["text"] and old.get("reply_markup") == markup:
            return _error(400, bad_request_body(
                "message is not modified: specified new message content and reply markup are "
                "exactly the same as a current content and reply markup of the message"))
        message = {**old, "text": params["text"], "edit_date": int(time.time())}
        message.pop("reply_markup", None)
        if markup:
            message["reply_markup"] = markup
        self.messages[key] = message
        return message

    def _delete_message(self, params: dict[str, Any]) -> Any:
        if self.messages.pop((int(params["chat_id"]), int(params["message_id"])), None) is None:
            return _error(400, bad_request_body("message to delete not found"))
        return True

    def _answer_callback_query(self, params: dict[str, Any]) -> bool:
        self.callback_answers.append(params)
        return True

    def _set_my_commands(self, params: dict[str, Any]) -> Any:
        commands = params.get("commands") or []
        for command in commands:
            if not _COMMAND_NAME.fullmatch(str(command.get("command", ""))):
                return _error(400, bad_request_body("BOT_COMMAND_INVALID"))
            if not 1 <= len(str(command.get("description", "")).strip()) <= 256:
                return _error(400, bad_request_body("command description is empty"))
        self.commands[_scope_key(params)] = commands
        return True

    def _delete_my_commands(self, params: dict[str, Any]) -> bool:
        self.commands.pop(_scope_key(params), None)
        return True


def _text_error(params: dict[str, Any]) -> web.Response | None:
    """The Bot API's text rules for sendMessage/editMessageText, or None if the text is fine."""
    shown = visible_text(str(params.get("text", "")), params.get("parse_mode"))
    if not shown.strip():
        return _error(400, bad_request_body("message text is empty"))
    if utf16_len(shown) > MAX_TEXT_UTF16:
        return _error(400, bad_request_body("message is too long"))
    return None


def _scope_key(params: dict[str, Any]) -> str:
    scope = params.get("scope") or {"type": "default"}
    return json.dumps([scope, params.get("language_code", "")], sort_keys=True)


def _error(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


async def _params(request: web.Request) -> dict[str, Any]:
    """Query + body; form fields holding JSON (PTB's encoding of non-strings) are decoded."""
    params: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        if request.content_type == "application/json":
            params.update(await request.json())
        else:
            for key, value in (await request.post()).items():
                if isinstance(value, str) and key not in _STRING_FIELDS:
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                params[key] = value
    return params
