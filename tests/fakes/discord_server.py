"""A local fake of Discord's REST API and gateway for testing the real discord.py client.

`FakeDiscord` is an aiohttp server on 127.0.0.1 (port 0) that answers the REST calls and
gateway opcodes discord.py 2.7.1 uses, records everything it receives, and lets a test
push gateway events (MESSAGE_CREATE, INTERACTION_CREATE, ...) to the connected client.

Usage::

    async with FakeDiscord() as dc:
        with dc.patch_discord():                       # redirects discord.http / discord.gateway
            dc.add_guild("500", ["501"], name="Test Guild")
            client = discord.Client(intents=intents, guild_ready_timeout=0.1)
            task = asyncio.create_task(client.start(dc.token))
            await dc.wait_identified()
            await dc.send_dm("hi")
            await dc.wait_for_call("POST", r"/channels/\\d+/messages")
            await client.close(); await task

Platform rules mimicked (source: Discord developer docs, "Gateway", "Message Resource",
"Interactions", "JSON Error Codes"):

- JSON responses carry ``Content-Type: application/json`` exactly (discord.py compares the
  header literally; aiohttp's ``json_response`` adds ``; charset=utf-8`` and breaks it).
- Gateway frames are plain-JSON text frames; discord.py only decompresses binary frames.
- Events dispatched while the client is disconnected are kept in the session's event log and
  replayed on RESUME (events with ``s`` greater than the client's sequence), then RESUMED.
  Sessions and shards follow the rules below.
- Without the MESSAGE_CONTENT intent (``1 << 15``) in IDENTIFY, guild messages that do not
  mention the bot arrive with empty ``content``/``embeds``/``attachments``/``components``.
- Sending: empty content with nothing else -> 400 code 50006; content over 2000 characters
  (counted as Python ``len``, i.e. code points) -> 400 code 50035.
- A 429 that discord.py retries transparently needs a ``Via`` header and a JSON body with
  ``retry_after`` (seconds); see `FakeDiscord.fail_next_rate_limited`.
- Edits: `FakeDiscord.edit_message` dispatches MESSAGE_UPDATE with the full message; the
  author's edit sets ``edited_timestamp``, embeds added alone (a link preview) do not. Replies:
  ``referenced_message`` as in `FakeDiscord.message_payload`; set it to ``None`` in the built
  payload for a reply to a deleted message, or drop it to make the client look the message up.

Gateway sessions and shards ("Gateway": "Sharding", "Resuming", "Gateway Close Event Codes"):

- IDENTIFY may carry ``"shard": [shard_id, num_shards]``; without it the session is shard 0
  of 1. ``num_shards`` must equal the fake's ``shard_count`` (default 1, also answered by
  ``GET /gateway/bot``) and ``shard_id`` be below it, else the socket is closed with 4010
  "Invalid shard". An IDENTIFY or RESUME on a socket that already carries a session is closed
  with 4005 "Already authenticated"; a wrong token in IDENTIFY with 4004.
- A guild event goes to shard ``(int(guild_id) >> 22) % shard_count`` (`FakeDiscord.shard_of`;
  GUILD_CREATE/UPDATE/DELETE take the guild from ``id``); DMs and events without a guild go
  to shard 0. READY lists only the shard's guilds (unavailable), carries ``"shard"`` when the
  IDENTIFY did, and is followed by a GUILD_CREATE for each of them.
- Every IDENTIFY opens a new session with its own ``session_id``, sequence numbers and event
  log; several may exist at once, even for one shard. An event is appended to the log of
  every session of its shard that has not ended and sent to those whose socket is live.
- A session outlives its socket unless the client closed it with 1000 or 1001 (the session
  ended). Any socket may RESUME it with ``{token, session_id, seq}``: a socket still carrying
  it is closed with 4000 first, then the logged events with ``s`` above ``seq`` are replayed
  and RESUMED follows. RESUMing an unknown or ended session gets INVALID_SESSION (op 9,
  ``d`` false). A new socket does not disturb other sockets; it waits for IDENTIFY or RESUME.
- Events for a shard no session has identified yet are held and sent after its first READY
  (so a test may dispatch before the client is up). `FakeDiscord.invalidate_session` with
  ``resumable=False`` puts a shard back in that state when it leaves no session of it.

Files ("Message Resource": attachment object, "Uploading Files"):

- ``message_payload`` / ``send_dm`` / ``send_guild_message`` take ``attachments``: a list of
  dicts ``{filename, data: bytes, content_type?, width?, height?, size?, duration_secs?,
  waveform?, description?}`` (``size`` overrides ``len(data)``; ``waveform`` as bytes or
  base64 text; an image's width/height are read from PNG/JPEG/GIF/WebP bytes when not
  given). The fake builds real attachment objects ``{id, filename, size, url, proxy_url,
  content_type, width, height, ...}`` (see `FakeDiscord.make_attachment`) whose ``url`` is
  ``http://127.0.0.1:PORT/attachments/<channel>/<id>/<filename>`` and ``proxy_url``
  ``.../media/attachments/...``; GET on either serves the bytes (404 unknown) and appends the
  URL to ``downloads``. Dicts without ``data`` are passed through as attachment objects.
  ``sticker_items=[{id, name, format_type}]`` and ``flags`` (e.g. `IS_VOICE_MESSAGE`) go on
  the message as given.
- Uploads: a multipart POST (``payload_json`` plus ``files[n]`` parts, as discord.py sends
  ``channel.send(content, file=discord.File(...))``) to ``/channels/{id}/messages``, an
  interaction callback or a webhook follow-up creates a message carrying real, downloadable
  attachment objects (``content_type`` guessed from the filename when the part says
  ``application/octet-stream``; ``description`` from ``payload_json.attachments``); each file
  of a created message is appended to ``files_sent`` as ``{channel_id, filename, data,
  content, content_type, description, message_id, route}`` (``route``: "channel",
  "interaction", "webhook" or "edit"). A file over ``upload_limit`` (10 MiB) is refused with 413
  code 40005 "Request entity too large". ``RecordedRequest.files`` entries carry ``field``,
  ``filename``, ``size``, ``data`` and ``content_type``. An edit's ``attachments`` list keeps
  only the listed existing attachments (by id), plus any new files.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import mimetypes
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple, Self

from aiohttp import WSMsgType, web

from .telegram_server import image_size

JSON = dict[str, Any]

DISCORD_EPOCH_MS = 1420070400000
"""Discord's snowflake epoch, 2015-01-01T00:00:00Z, in milliseconds."""

BOT_ID = "1000000000000000001"
HUMAN_ID = "2000000000000000002"
OTHER_BOT_ID = "3000000000000000003"

INTENT_MESSAGE_CONTENT = 1 << 15
IS_VOICE_MESSAGE = 1 << 13
"""Message flag of a voice message (its one attachment has ``duration_secs``/``waveform``)."""
UPLOAD_LIMIT = 10 * 1024 * 1024
"""Default per-file upload limit for bots (10 MiB)."""

PERM_ADD_REACTIONS = 0x40
PERM_VIEW_CHANNEL = 0x400
PERM_SEND_MESSAGES = 0x800
PERM_EMBED_LINKS = 0x4000
PERM_ATTACH_FILES = 0x8000
PERM_READ_MESSAGE_HISTORY = 0x10000
DEFAULT_EVERYONE_PERMISSIONS = (
    PERM_VIEW_CHANNEL
    | PERM_SEND_MESSAGES
    | PERM_READ_MESSAGE_HISTORY
    | PERM_EMBED_LINKS
    | PERM_ATTACH_FILES
    | PERM_ADD_REACTIONS
)
"""@everyone permissions in guilds from `FakeDiscord.add_guild`: view, send, read history,
embed links, attach files, add reactions."""

MAX_CONTENT_LENGTH = 2000
HEARTBEAT_INTERVAL_MS = 41250

CLOSE_AUTHENTICATION_FAILED = 4004
CLOSE_ALREADY_AUTHENTICATED = 4005
CLOSE_INVALID_SHARD = 4010
CLIENT_ENDS_SESSION = (1000, 1001)
"""Close codes with which the client ends its session (it cannot be RESUMEd afterwards)."""


def make_user(user_id: str, name: str, *, bot: bool = False) -> JSON:
    """A Discord user object (snowflake as string, new-style username, discriminator "0")."""
    user: JSON = {
        "id": str(user_id),
        "username": name,
        "discriminator": "0",
        "global_name": None if bot else name,
        "avatar": None,
        "flags": 0,
    }
    if bot:
        user["bot"] = True
    return user


BOT_USER = make_user(BOT_ID, "fakebot", bot=True)
HUMAN_USER = make_user(HUMAN_ID, "alice")
OTHER_BOT_USER = make_user(OTHER_BOT_ID, "otherbot", bot=True)


def iso_now() -> str:
    """The current UTC time as ISO 8601 with offset, the format Discord uses for timestamps."""
    return datetime.now(UTC).isoformat()


class Call(NamedTuple):
    """One REST request as seen by the fake: path is relative to ``/api/v10``, no query."""

    method: str
    path: str
    json: Any
    time: float


@dataclass
class RecordedRequest:
    """Full record of one REST request: query, uploaded files and the status answered."""

    method: str
    path: str
    query: dict[str, str]
    json: Any
    files: list[JSON]
    headers: dict[str, str]
    status: int = 0
    time: float = field(default_factory=time.monotonic)


@dataclass
class _FailRule:
    method: str
    path: re.Pattern[str]
    status: int
    body: Any
    headers: dict[str, str]
    times: int


PathSpec = str | re.Pattern[str]
_Handler = Callable[["_Req"], Any]


@dataclass
class _Req:
    """What a REST route handler gets: URL params, parsed body, query and files."""

    params: dict[str, str]
    body: Any
    query: dict[str, str]
    files: list[JSON]


@dataclass(eq=False)
class _Session:
    """One gateway session: its own sequence numbers and event log, outliving its sockets.

    ``ws`` is the socket carrying it now (None when detached); ``live`` is true while events
    are sent on that socket (false from the moment a RECONNECT or INVALID_SESSION went out);
    ``ended`` once the client closed with 1000/1001 or the session was invalidated for good.
    """

    session_id: str
    shard: int
    intents: int
    shard_in_identify: bool
    seq: int = 0
    log: list[JSON] = field(default_factory=list)
    ws: web.WebSocketResponse | None = None
    live: bool = False
    ended: bool = False

    @property
    def attached(self) -> bool:
        """Carried by a socket that is still open."""
        return self.ws is not None and not self.ws.closed

    def detach(self) -> web.WebSocketResponse | None:
        """Take the session off its socket; returns that socket."""
        ws, self.ws, self.live = self.ws, None, False
        return ws


def _json_response(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response with ``Content-Type`` exactly ``application/json``.

    test-infra.md pitfall 1: discord.py compares the header literally.
    """
    all_headers = {"Content-Type": "application/json"}
    all_headers.update(headers or {})
    return web.Response(status=status, body=json.dumps(data).encode(), headers=all_headers)


def _error(status: int, code: int, message: str, errors: JSON | None = None) -> web.Response:
    body: JSON = {"message": message, "code": code}
    if errors is not None:
        body["errors"] = errors
    return _json_response(body, status)


def _form_error(field_name: str, code: str, message: str) -> web.Response:
    """400 code 50035 "Invalid Form Body" with Discord's nested ``errors`` shape."""
    return _error(
        400,
        50035,
        "Invalid Form Body",
        {field_name: {"_errors": [{"code": code, "message": message}]}},
    )


def _no_content() -> web.Response:
    return web.Response(status=204)


class FakeDiscord:
    """Fake Discord REST + gateway server for the real discord.py client.

    Args:
        token: the bot token the fake accepts (``Authorization: Bot <token>`` and IDENTIFY).
        enforce_message_content_intent: blank guild message content when the session's
            IDENTIFY lacked the MESSAGE_CONTENT intent and the bot is not mentioned, as real
            Discord does.
        upload_limit: largest file accepted in an upload, in bytes.
        shard_count: the number of gateway shards the bot must IDENTIFY with (module
            docstring, "Gateway sessions and shards").

    Attributes (read them in tests):
        api_base, gateway_url: URLs to point discord.py at (valid inside ``async with``).
        calls: every REST request as `Call` (method, path, json body, monotonic time).
        requests: every REST request as `RecordedRequest` (adds query, files, status).
        unknown_routes: `Call` records of requests no route matched (answered 404).
        gw_received: every gateway payload received from the client, parsed.
        gw_close_codes: close code of each gateway connection as it ended.
        gw_queries: query parameters of each gateway connection (v, encoding, compress).
        identify_count, resume_count: number of IDENTIFY (accepted) and successful RESUME,
            over all shards.
        identifies_by_shard: accepted IDENTIFYs counted by shard id.
        intents: the intents integer of the latest IDENTIFY, or None.
        shard_count: as given.
        interaction_responses: bodies POSTed to interaction callbacks, with id and token.
        server_errors: exceptions raised inside the fake's handlers (answered as 400).
        app_commands: registered application commands, keyed by guild id (None = global).
        files_sent: each file of each message the bot created (module docstring).
        downloads: attachment URLs served (GET on ``url`` or ``proxy_url``), in order.
    """

    def __init__(
        self,
        token: str = "TESTTOKEN",
        *,
        enforce_message_content_intent: bool = True,
        upload_limit: int = UPLOAD_LIMIT,
        shard_count: int = 1,
    ) -> None:
        if shard_count < 1:
            raise ValueError(f"shard_count must be at least 1, not {shard_count}")
        self.token = token
        self.shard_count = shard_count
        self.upload_limit = upload_limit
        self.files_sent: list[JSON] = []
        self.downloads: list[str] = []
        self._attachment_data: dict[tuple[str, str, str], bytes] = {}
        self.enforce_message_content_intent = enforce_message_content_intent
        self.bot_user: JSON = dict(BOT_USER)
        self.human_user: JSON = dict(HUMAN_USER)
        self.other_bot: JSON = dict(OTHER_BOT_USER)
        self.application_id = BOT_ID

        self.calls: list[Call] = []
        self.requests: list[RecordedRequest] = []
        self.unknown_routes: list[Call] = []
        self.gw_received: list[JSON] = []
        self.gw_close_codes: list[int | None] = []
        self.gw_queries: list[dict[str, str]] = []
        self.identify_count = 0
        self.identifies_by_shard: Counter[int] = Counter()
        self.resume_count = 0
        self.intents: int | None = None
        self.interaction_responses: list[JSON] = []
        self.server_errors: list[Exception] = []
        self.app_commands: dict[str | None, list[JSON]] = {}

        self._port = 0
        self._runner: web.AppRunner | None = None
        self._cond: asyncio.Condition | None = None
        self._send_lock: asyncio.Lock | None = None
        self._fail_rules: list[_FailRule] = []
        self._last_snowflake = 0

        self._guilds: dict[str, JSON] = {}
        self._channels: dict[str, JSON] = {}
        self._dm_by_user: dict[str, str] = {}
        self._messages: dict[str, JSON] = {}
        self._sent: list[tuple[str, str, str]] = []  # (channel_id, content at POST, message_id)
        self._nonces: dict[tuple[str, str], str] = {}
        self._interactions: dict[str, JSON] = {}
        self._originals: dict[str, str] = {}  # interaction token -> message id

        self._all_ws: set[web.WebSocketResponse] = set()
        self._closed_by_fake: set[web.WebSocketResponse] = set()
        self._sessions: list[_Session] = []  # every session ever opened, oldest first
        self._identified_shards: set[int] = set()  # shards whose events are no longer held
        self._held: dict[int, list[tuple[str, JSON]]] = {}  # shard -> events awaiting READY
        self._resume_target = 1  # resume_count that `wait_resumed` waits for by default
        self._routes = self._build_routes()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port and start serving."""
        self._cond = asyncio.Condition()
        self._send_lock = asyncio.Lock()
        app = web.Application()
        app.router.add_get("/gateway", self._gateway)
        app.router.add_route("*", "/api/v10/{tail:.*}", self._rest)
        for prefix in ("/attachments", "/media/attachments"):
            app.router.add_get(prefix + "/{cid}/{aid}/{filename}", self._attachment)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets, "aiohttp site did not bind"
        self._port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Close open gateway sockets (code 1001) and stop the server. Idempotent."""
        for ws in list(self._all_ws):
            if not ws.closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._close_socket(ws, 1001), 1.0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def api_base(self) -> str:
        """REST base, e.g. ``http://127.0.0.1:PORT/api/v10`` (for ``discord.http.Route.BASE``)."""
        return f"http://127.0.0.1:{self._port}/api/v10"

    @property
    def gateway_url(self) -> str:
        """``ws://127.0.0.1:PORT/gateway``, for ``DiscordWebSocket.DEFAULT_GATEWAY``."""
        return f"ws://127.0.0.1:{self._port}/gateway"

    @contextlib.contextmanager
    def patch_discord(self) -> Iterator[None]:
        """Point discord.py's REST base and default gateway at this fake; restore on exit.

        Sets ``discord.http.Route.BASE`` and ``discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY``
        (class attributes, so it affects every client in the process). Enter it before
        ``client.start()``/``login()``; do not call ``discord.http._set_api_version`` afterwards.
        """
        import discord.gateway
        import discord.http
        import yarl

        old_base = discord.http.Route.BASE
        old_gateway = discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY
        discord.http.Route.BASE = self.api_base
        discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(self.gateway_url)
        try:
            yield
        finally:
            discord.http.Route.BASE = old_base
            discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = old_gateway

    # ------------------------------------------------------------------ ids, users, guilds

    def snowflake(self) -> str:
        """A new, strictly increasing snowflake (as string) whose timestamp is now."""
        ms = int(time.time() * 1000) - DISCORD_EPOCH_MS
        value = max(ms << 22, self._last_snowflake + 1)
        self._last_snowflake = value
        return str(value)

    def shard_of(self, guild_id: str | int) -> int:
        """The shard that gets the guild's events: ``(guild_id >> 22) % shard_count``."""
        return (int(guild_id) >> 22) % self.shard_count

    def guild_id_on_shard(self, shard: int) -> str:
        """A new snowflake (as string) that, as a guild id, maps to ``shard``."""
        if not 0 <= shard < self.shard_count:
            raise ValueError(f"shard {shard} is not below shard_count {self.shard_count}")
        value = int(self.snowflake())
        timestamp = value >> 22
        timestamp += (shard - timestamp) % self.shard_count
        value = (timestamp << 22) | (value & ((1 << 22) - 1))
        self._last_snowflake = max(self._last_snowflake, value)
        return str(value)

    def human(self, id: str = HUMAN_ID, name: str = "alice") -> JSON:
        """A non-bot user object with the given id and username."""
        return make_user(str(id), name)

    def bot(self, id: str = OTHER_BOT_ID, name: str = "otherbot") -> JSON:
        """A bot user object other than our own bot."""
        return make_user(str(id), name, bot=True)

    def add_guild(
        self,
        guild_id: str | int,
        channel_ids: Sequence[str | int],
        name: str = "Test Guild",
        *,
        everyone_permissions: int = DEFAULT_EVERYONE_PERMISSIONS,
        owner: JSON | None = None,
    ) -> JSON:
        """Register a guild with text channels; returns its GUILD_CREATE ``d`` payload.

        Guilds registered before IDENTIFY are listed unavailable in the READY of their shard
        (`shard_of`) and each is followed by a GUILD_CREATE, as Discord does. For a guild added
        later use `join_guild`.
        """
        gid = str(guild_id)
        owner = owner or self.human_user
        joined = iso_now()
        channels = [
            {
                "id": str(cid),
                "type": 0,
                "name": f"channel-{i}" if i else "general",
                "position": i,
                "permission_overwrites": [],
                "nsfw": False,
                "parent_id": None,
                "topic": None,
                "last_message_id": None,
                "rate_limit_per_user": 0,
            }
            for i, cid in enumerate(channel_ids)
        ]
        members = [
            {
                "user": self.bot_user,
                "roles": [],
                "joined_at": joined,
                "deaf": False,
                "mute": False,
                "flags": 0,
            },
            {
                "user": owner,
                "roles": [],
                "joined_at": joined,
                "deaf": False,
                "mute": False,
                "flags": 0,
            },
        ]
        guild: JSON = {
            "id": gid,
            "name": name,
            "icon": None,
            "owner_id": owner["id"],
            "member_count": len(members),
            "large": False,
            "unavailable": False,
            "joined_at": joined,
            "features": [],
            "emojis": [],
            "stickers": [],
            "threads": [],
            "voice_states": [],
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "soundboard_sounds": [],
            "verification_level": 0,
            "default_message_notifications": 0,
            "explicit_content_filter": 0,
            "mfa_level": 0,
            "nsfw_level": 0,
            "premium_tier": 0,
            "preferred_locale": "en-US",
            "system_channel_id": None,
            "roles": [
                {
                    "id": gid,
                    "name": "@everyone",
                    "permissions": str(everyone_permissions),
                    "position": 0,
                    "color": 0,
                    "hoist": False,
                    "managed": False,
                    "mentionable": False,
                    "flags": 0,
                }
            ],
            "channels": channels,
            "members": members,
        }
        self._guilds[gid] = guild
        for ch in channels:
            self._channels[ch["id"]] = {**ch, "guild_id": gid}
        return guild

    async def join_guild(
        self, guild_id: str | int, channel_ids: Sequence[str | int], name: str = "Test Guild"
    ) -> JSON:
        """Register a guild and dispatch its GUILD_CREATE now (the bot joining a guild)."""
        guild = self.add_guild(guild_id, channel_ids, name)
        await self.dispatch("GUILD_CREATE", guild)
        return guild

    def dm_channel_id(self, user: JSON | None = None) -> str:
        """The DM channel id between the bot and ``user`` (default the human); created once."""
        user = user or self.human_user
        uid = str(user["id"])
        cid = self._dm_by_user.get(uid)
        if cid is None:
            cid = self.snowflake()
            self._dm_by_user[uid] = cid
            self._channels[cid] = {
                "id": cid,
                "type": 1,
                "recipients": [user],
                "last_message_id": None,
                "flags": 0,
            }
        return cid

    def _ensure_channel(self, channel_id: str, guild_id: str | None, author: JSON) -> None:
        if channel_id in self._channels:
            return
        if guild_id is None:
            self._dm_by_user.setdefault(str(author["id"]), channel_id)
            self._channels[channel_id] = {
                "id": channel_id,
                "type": 1,
                "recipients": [author],
                "last_message_id": None,
                "flags": 0,
            }
        else:
            self._channels[channel_id] = {
                "id": channel_id,
                "type": 0,
                "guild_id": guild_id,
                "name": f"channel-{channel_id}",
                "position": 0,
                "permission_overwrites": [],
                "nsfw": False,
                "parent_id": None,
            }

    # ------------------------------------------------------------------ payload builders

    def message_payload(
        self,
        content: str,
        channel_id: str | int,
        author: JSON | None = None,
        guild_id: str | int | None = None,
        mentions: Sequence[JSON] = (),
        message_id: str | int | None = None,
        referenced_message: JSON | None = None,
        *,
        attachments: Sequence[JSON] | None = (),
        embeds: Sequence[JSON] = (),
        sticker_items: Sequence[JSON] | None = None,
        flags: int = 0,
    ) -> JSON:
        """A MESSAGE_CREATE ``d`` payload (snowflakes as strings).

        Without ``guild_id`` it is a DM; with it, a guild message carrying ``member``.
        ``referenced_message`` (another payload) makes it a reply (type 19 with
        ``message_reference``). The message is stored so ``GET`` on it answers 200.
        ``attachments``: dicts with ``filename`` and ``data`` become served attachment objects
        (`make_attachment`); others are used as given. ``sticker_items``: ``{id, name,
        format_type}`` dicts (``id`` defaults to a new snowflake, ``format_type`` to 1, PNG).
        ``flags``: message flags, e.g. `IS_VOICE_MESSAGE`.
        """
        author = author or self.human_user
        cid = str(channel_id)
        gid = None if guild_id is None else str(guild_id)
        self._ensure_channel(cid, gid, author)
        data: JSON = {
            "id": str(message_id) if message_id is not None else self.snowflake(),
            "channel_id": cid,
            "author": author,
            "content": content,
            "timestamp": iso_now(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [dict(m) for m in mentions],
            "mention_roles": [],
            "attachments": [
                self.make_attachment(cid, **a) if "data" in a else dict(a)
                for a in attachments or ()
            ],
            "embeds": list(embeds),
            "components": [],
            "pinned": False,
            "type": 0,
            "flags": int(flags),
        }
        if sticker_items:
            data["sticker_items"] = [
                {"format_type": 1, **s, "id": str(s.get("id") or self.snowflake())}
                for s in sticker_items
            ]
        if gid is not None:
            data["guild_id"] = gid
            data["member"] = {
                "roles": [],
                "joined_at": iso_now(),
                "deaf": False,
                "mute": False,
                "flags": 0,
            }
        if referenced_message is not None:
            data["type"] = 19
            data["message_reference"] = {
                "type": 0,
                "message_id": referenced_message["id"],
                "channel_id": referenced_message["channel_id"],
                **({"guild_id": gid} if gid is not None else {}),
            }
            data["referenced_message"] = referenced_message
        self._messages[data["id"]] = data
        return data

    def make_attachment(
        self,
        channel_id: str | int,
        filename: str,
        data: bytes,
        *,
        content_type: str | None = None,
        width: int | None = None,
        height: int | None = None,
        size: int | None = None,
        duration_secs: float | None = None,
        waveform: bytes | str | None = None,
        description: str | None = None,
        flags: int | None = None,
    ) -> JSON:
        """A Discord attachment object for ``data``, served by this fake at its ``url`` and
        ``proxy_url``. A filename with characters other than letters, digits, ``.``, ``-``
        and ``_`` is sanitised (``_``) and the original kept in ``title``, as Discord does.
        ``content_type`` defaults to a guess from the filename; an image's ``width`` and
        ``height`` default to those in its bytes (PNG, JPEG, GIF, WebP, BMP)."""
        cid, aid = str(channel_id), self.snowflake()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", filename) or "unknown"
        content_type = content_type or mimetypes.guess_type(filename)[0]
        self._attachment_data[(cid, aid, safe)] = bytes(data)
        root = f"http://127.0.0.1:{self._port}"
        attachment: JSON = {
            "id": aid,
            "filename": safe,
            "size": len(data) if size is None else int(size),
            "url": f"{root}/attachments/{cid}/{aid}/{safe}",
            "proxy_url": f"{root}/media/attachments/{cid}/{aid}/{safe}",
        }
        if safe != filename:
            attachment["title"] = filename
        if content_type:
            attachment["content_type"] = content_type
        if (width is None or height is None) and (content_type or "").startswith("image/"):
            found = image_size(bytes(data))
            if found is not None:
                width = found[0] if width is None else width
                height = found[1] if height is None else height
        if width is not None and height is not None:
            attachment["width"], attachment["height"] = int(width), int(height)
        if description is not None:
            attachment["description"] = description
        if duration_secs is not None:
            attachment["duration_secs"] = duration_secs
        if waveform is not None:
            attachment["waveform"] = (
                waveform if isinstance(waveform, str) else base64.b64encode(waveform).decode()
            )
        if flags is not None:
            attachment["flags"] = int(flags)
        return attachment

    def interaction_payload(
        self,
        name: str,
        options: dict[str, str | int | float | bool] | None = None,
        *,
        channel_id: str | int,
        guild_id: str | int | None = None,
        user: JSON | None = None,
    ) -> JSON:
        """An INTERACTION_CREATE ``d`` payload for a slash command (type 2, chat input).

        ``options`` map option name to value; types are inferred (str 3, bool 5, int 4,
        float 10). The interaction is remembered so its callback is accepted once.
        """
        user = user or self.human_user
        cid = str(channel_id)
        gid = None if guild_id is None else str(guild_id)
        self._ensure_channel(cid, gid, user)
        registered = [
            c
            for c in self.app_commands.get(gid, []) + self.app_commands.get(None, [])
            if c["name"] == name
        ]
        type_of = {str: 3, bool: 5, int: 4, float: 10}
        opts = [
            {"name": k, "type": type_of[type(v)], "value": v} for k, v in (options or {}).items()
        ]
        channel = self._channels[cid]
        data: JSON = {
            "id": self.snowflake(),
            "application_id": self.application_id,
            "type": 2,
            "token": f"itok-{uuid.uuid4().hex}",
            "version": 1,
            "data": {
                "id": registered[0]["id"] if registered else self.snowflake(),
                "name": name,
                "type": 1,
                "options": opts,
            },
            "channel_id": cid,
            "channel": channel,
            "app_permissions": str(DEFAULT_EVERYONE_PERMISSIONS),
            "locale": "en-US",
            "attachment_size_limit": 8 * 1024 * 1024,
            "entitlements": [],
        }
        if gid is not None:
            data["guild_id"] = gid
            data["guild_locale"] = "en-US"
            data["context"] = 0
            data["authorizing_integration_owners"] = {"0": gid}
            data["member"] = {
                "user": user,
                "roles": [],
                "joined_at": iso_now(),
                "deaf": False,
                "mute": False,
                "flags": 0,
                "permissions": str(DEFAULT_EVERYONE_PERMISSIONS),
            }
        else:
            data["context"] = 1
            data["authorizing_integration_owners"] = {"0": "0"}
            data["user"] = user
        self._interactions[data["id"]] = {"payload": data, "acknowledged": False}
        return data

    def component_payload(self, message_id: str | int, custom_id: str, *, user: JSON | None = None) -> JSON:
        """An INTERACTION_CREATE ``d`` payload for a press of the button ``custom_id`` under the
        stored message ``message_id`` (type 3, message component; component type 2, a button).
        The interaction is remembered so its callback is accepted once."""
        message = self._messages[str(message_id)]
        user = user or self.human_user
        cid = str(message["channel_id"])
        channel = self._channels[cid]
        gid = channel.get("guild_id")
        data: JSON = {
            "id": self.snowflake(), "application_id": self.application_id, "type": 3,
            "token": f"itok-{uuid.uuid4().hex}", "version": 1,
            "data": {"custom_id": custom_id, "component_type": 2},
            "message": message, "channel_id": cid, "channel": channel,
            "app_permissions": str(DEFAULT_EVERYONE_PERMISSIONS), "locale": "en-US",
            "attachment_size_limit": 8 * 1024 * 1024, "entitlements": [],
        }
        if gid is not None:
            data.update(guild_id=gid, guild_locale="en-US", context=0, authorizing_integration_owners={"0": gid})
            data["member"] = {"user": user, "roles": [], "joined_at": iso_now(), "deaf": False, "mute": False,
                              "flags": 0, "permissions": str(DEFAULT_EVERYONE_PERMISSIONS)}
        else:
            data.update(context=1, authorizing_integration_owners={"0": "0"}, user=user)
        self._interactions[data["id"]] = {"payload": data, "acknowledged": False}
        return data

    async def press_button(self, message_id: str | int, custom_id: str, *, user: JSON | None = None) -> JSON:
        """Dispatch a button press (:meth:`component_payload`); returns the payload."""
        payload = self.component_payload(message_id, custom_id, user=user)
        await self.dispatch("INTERACTION_CREATE", payload)
        return payload

    # ------------------------------------------------------------------ gateway dispatch API

    async def dispatch(self, event_name: str, data: JSON, *, shard: int | None = None) -> None:
        """Send a DISPATCH (op 0) event to the sessions of its shard.

        The shard is ``shard`` if given, else the event's guild's (`shard_of`), else 0. Before
        the shard's first READY the event is held and sent right after READY and the
        GUILD_CREATEs. A session whose socket is down logs it and replays it on RESUME.
        """
        assert self._send_lock is not None, "FakeDiscord is not started"
        target = self._event_shard(event_name, data) if shard is None else shard
        async with self._send_lock:
            if target not in self._identified_shards:
                self._held.setdefault(target, []).append((event_name, data))
                return
            for session in self._open_sessions(target):
                await self._emit_locked(session, event_name, data)
        await self._notify()

    async def send_dm(
        self,
        content: str,
        author: JSON | None = None,
        *,
        message_id: str | int | None = None,
        referenced_message: JSON | None = None,
        attachments: Sequence[JSON] | None = (),
        sticker_items: Sequence[JSON] | None = None,
        flags: int = 0,
    ) -> JSON:
        """Dispatch a DM from ``author`` (default the human) to the bot; returns the payload.
        ``attachments``/``sticker_items``/``flags`` as in `message_payload`."""
        author = author or self.human_user
        payload = self.message_payload(
            content,
            self.dm_channel_id(author),
            author=author,
            message_id=message_id,
            referenced_message=referenced_message,
            attachments=attachments,
            sticker_items=sticker_items,
            flags=flags,
        )
        await self.dispatch("MESSAGE_CREATE", payload)
        return payload

    async def send_guild_message(
        self,
        content: str,
        guild_id: str | int,
        channel_id: str | int,
        mention_bot: bool = False,
        author: JSON | None = None,
        *,
        message_id: str | int | None = None,
        referenced_message: JSON | None = None,
        attachments: Sequence[JSON] | None = (),
        sticker_items: Sequence[JSON] | None = None,
        flags: int = 0,
    ) -> JSON:
        """Dispatch a guild message; returns the payload.

        ``mention_bot`` prefixes ``<@BOTID>`` to the content and puts the bot in ``mentions``.
        ``attachments``/``sticker_items``/``flags`` as in `message_payload`.
        """
        mentions: list[JSON] = []
        if mention_bot:
            content = f"<@{self.bot_user['id']}> {content}"
            mentions.append(self.bot_user)
        payload = self.message_payload(
            content,
            channel_id,
            author=author,
            guild_id=guild_id,
            mentions=mentions,
            message_id=message_id,
            referenced_message=referenced_message,
            attachments=attachments,
            sticker_items=sticker_items,
            flags=flags,
        )
        await self.dispatch("MESSAGE_CREATE", payload)
        return payload

    async def edit_message(
        self,
        message_id: str | int,
        content: str | None = None,
        *,
        attachments: Sequence[JSON] | None = None,
        embeds: Sequence[JSON] | None = None,
    ) -> JSON:
        """Dispatch MESSAGE_UPDATE for a stored message (pushed or sent); returns the payload.

        As Discord does (developer docs, "Message Update": the full message object): the
        author's edit (new ``content`` or ``attachments``, built as in `message_payload`) sets
        ``edited_timestamp``; ``embeds`` alone (a link preview unfurled later) leaves it as it
        was. The stored message changes too, so a GET on it answers the edited version.
        """
        data = dict(self._messages[str(message_id)])
        cid = str(data["channel_id"])
        if content is not None:
            data["content"] = content
        if attachments is not None:
            data["attachments"] = [
                self.make_attachment(cid, **a) if "data" in a else dict(a) for a in attachments
            ]
        if embeds is not None:
            data["embeds"] = list(embeds)
        if content is not None or attachments is not None:
            data["edited_timestamp"] = iso_now()
        self._messages[data["id"]] = data
        await self.dispatch("MESSAGE_UPDATE", data)
        return data

    async def send_interaction(
        self, name: str, options: dict[str, Any] | None = None, **kwargs: Any
    ) -> JSON:
        """Build with `interaction_payload` and dispatch INTERACTION_CREATE; returns the payload."""
        payload = self.interaction_payload(name, options, **kwargs)
        await self.dispatch("INTERACTION_CREATE", payload)
        return payload

    async def force_reconnect(
        self,
        how: Literal["op7", "close"] = "op7",
        close_code: int = 4000,
        *,
        shard: int | None = None,
    ) -> None:
        """Make the client drop its gateway connection and RESUME.

        Acts on every session carried by an open socket, or only those of ``shard``.
        ``"op7"`` sends RECONNECT (op 7); ``"close"`` closes the socket with ``close_code``
        (4000 "unknown error" is resumable). Wait with `wait_resumed`.
        """
        assert self._send_lock is not None, "FakeDiscord is not started"
        async with self._send_lock:
            targets = self._attached_sessions(shard)
            self._resume_target = self.resume_count + max(1, len(targets))
            sockets = [session.ws for session in targets if session.ws is not None]
            for session in targets:
                session.live = False
            if how == "op7":
                for ws in sockets:
                    with contextlib.suppress(ConnectionError):
                        await ws.send_str(json.dumps({"op": 7, "d": None}))
                return
        await asyncio.gather(
            *(asyncio.wait_for(self._close_socket(ws, close_code), 5.0) for ws in sockets)
        )

    async def invalidate_session(self, resumable: bool = False, *, shard: int | None = None) -> None:
        """Send INVALID_SESSION (op 9) on every socket carrying a session (or one of ``shard``).

        With ``resumable=False`` those sessions end and the client must IDENTIFY again; a shard
        left without a session holds its events for the next READY, as before its first.
        """
        assert self._send_lock is not None, "FakeDiscord is not started"
        async with self._send_lock:
            targets = self._attached_sessions(shard)
            sockets = [session.ws for session in targets if session.ws is not None]
            for session in targets:
                session.live = False
                if not resumable:
                    session.ended = True
                    session.detach()
            for ws in sockets:
                with contextlib.suppress(ConnectionError):
                    await ws.send_str(json.dumps({"op": 9, "d": resumable}))
            for shard_id in {session.shard for session in targets}:
                if not self._open_sessions(shard_id):
                    self._identified_shards.discard(shard_id)
        await self._notify()

    async def wait_identified(self, timeout: float = 5.0, count: int = 1) -> None:
        """Wait until ``count`` IDENTIFYs (all shards) were answered with READY.

        Raises TimeoutError."""
        await self.wait_until(lambda: self.identify_count >= count, timeout, f"{count} IDENTIFY")

    async def wait_resumed(self, timeout: float = 5.0, count: int | None = None) -> None:
        """Wait until ``count`` RESUMEs (all shards) succeeded; by default, until each session
        `force_reconnect` acted on (at least one) RESUMEd once more."""
        target = self._resume_target if count is None else count
        await self.wait_until(lambda: self.resume_count >= target, timeout, f"{target} RESUME")

    # ------------------------------------------------------------------ observation API

    def messages_sent(self, channel_id: str | int | None = None) -> list[str]:
        """Contents successfully POSTed to ``/channels/{id}/messages``, in order (as at POST)."""
        return [
            content
            for cid, content, _ in self._sent
            if channel_id is None or cid == str(channel_id)
        ]

    def created_messages(self, channel_id: str | int | None = None) -> list[JSON]:
        """Message objects the bot created via POST, current state (edits applied), in order."""
        out = []
        for cid, _, mid in self._sent:
            if (channel_id is None or cid == str(channel_id)) and mid in self._messages:
                out.append(self._messages[mid])
        return out

    def message(self, message_id: str | int) -> JSON | None:
        """Current state of a stored message (created, dispatched, edited), or None if absent."""
        return self._messages.get(str(message_id))

    def sessions(self, shard: int | None = None) -> list[JSON]:
        """Every gateway session opened (of ``shard``, if given), oldest first, as dicts
        ``{session_id, shard, seq, live, ended}``; ``seq`` is the last sequence number logged,
        ``live`` whether events reach it now."""
        return [
            {
                "session_id": session.session_id,
                "shard": session.shard,
                "seq": session.seq,
                "live": session.live and session.attached,
                "ended": session.ended,
            }
            for session in self._sessions
            if shard is None or session.shard == shard
        ]

    def logged(self, text: str) -> list[JSON]:
        """The sessions whose log holds a message event with ``text`` in its content, with that
        event's sequence number as ``seq``."""
        return [
            {"session_id": session.session_id, "shard": session.shard, "seq": frame["s"], "ended": session.ended}
            for session in self._sessions
            for frame in session.log
            if frame.get("t") == "MESSAGE_CREATE" and text in str(frame["d"].get("content", ""))
        ]

    def live_shards(self) -> list[int]:
        """Shards with at least one live session (identified or resumed, socket open), sorted."""
        return sorted({s.shard for s in self._sessions if s.live and s.attached})

    def matching_calls(
        self, method: str, path: PathSpec, *, status: int | None = None
    ) -> list[RecordedRequest]:
        """Requests with this method whose path fully matches ``path`` (a regex; plain paths
        match themselves), optionally only those answered with ``status``."""
        pattern = re.compile(path) if isinstance(path, str) else path
        return [
            r
            for r in self.requests
            if r.method == method.upper()
            and pattern.fullmatch(r.path)
            and (status is None or r.status == status)
        ]

    async def wait_for_call(
        self,
        method: str,
        path: PathSpec,
        n: int = 1,
        timeout: float = 5.0,
        *,
        status: int | None = None,
    ) -> list[RecordedRequest]:
        """Wait until at least ``n`` matching requests were answered; returns them.

        Raises TimeoutError naming the calls seen, to make failures readable.
        """

        def enough() -> bool:
            return len(self.matching_calls(method, path, status=status)) >= n

        await self.wait_until(enough, timeout, f"{n} x {method} {path}")
        return self.matching_calls(method, path, status=status)

    def fail_next(
        self,
        method: str,
        path_regex: PathSpec,
        status: int,
        body: Any,
        times: int = 1,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with ``status`` and ``body``.

        A dict/list body is sent as JSON; a str as text/plain. The request is still recorded.
        """
        pattern = re.compile(path_regex) if isinstance(path_regex, str) else path_regex
        self._fail_rules.append(
            _FailRule(method.upper(), pattern, status, body, dict(headers or {}), times)
        )

    def fail_next_rate_limited(
        self,
        method: str,
        path_regex: PathSpec,
        retry_after: float = 0.05,
        times: int = 1,
        *,
        is_global: bool = False,
    ) -> None:
        """A 429 discord.py retries transparently after ``retry_after`` seconds.

        Carries a ``Via`` header and a JSON body with ``retry_after``; without them discord.py
        assumes a Cloudflare ban and raises HTTPException (test-infra.md pitfall 2).
        """
        body = {
            "message": "You are being rate limited.",
            "retry_after": retry_after,
            "global": is_global,
        }
        headers = {"Via": "1.1 google", "Retry-After": str(max(1, round(retry_after)))}
        if is_global:
            headers["X-RateLimit-Global"] = "true"
        self.fail_next(method, path_regex, 429, body, times, headers)

    def fail_next_error(
        self,
        method: str,
        path_regex: PathSpec,
        status: int = 400,
        code: int = 50035,
        message: str = "Invalid Form Body",
        times: int = 1,
    ) -> None:
        """A Discord JSON error, e.g. 400/50035, 403/50013 "Missing Permissions", 404/10003."""
        self.fail_next(method, path_regex, status, {"message": message, "code": code}, times)

    def fail_next_forbidden(self, method: str, path_regex: PathSpec, times: int = 1) -> None:
        """403 code 50013 "Missing Permissions" (discord.Forbidden)."""
        self.fail_next_error(method, path_regex, 403, 50013, "Missing Permissions", times)

    # ------------------------------------------------------------------ waiting

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    async def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
    ) -> None:
        """Wait until ``predicate()`` is true; re-checked after every request and gateway change.

        Raises TimeoutError listing the REST calls and gateway ops seen so far.
        """
        assert self._cond is not None, "FakeDiscord is not started"
        try:
            async with self._cond:
                await asyncio.wait_for(self._cond.wait_for(predicate), timeout)
        except TimeoutError:
            seen = [f"{r.method} {r.path} -> {r.status}" for r in self.requests]
            ops = [p.get("op") for p in self.gw_received]
            raise TimeoutError(
                f"FakeDiscord: waited {timeout}s for {what}; REST seen: {seen}; gateway ops: {ops}"
            ) from None

    # ------------------------------------------------------------------ internals: gateway

    def _event_shard(self, event_name: str, data: JSON) -> int:
        """The shard an event belongs to: its guild's, or 0 for DMs and guildless events."""
        guild_id = data.get("guild_id")
        if guild_id is None and event_name in ("GUILD_CREATE", "GUILD_UPDATE", "GUILD_DELETE"):
            guild_id = data.get("id")
        return 0 if guild_id is None else self.shard_of(guild_id)

    def _open_sessions(self, shard: int) -> list[_Session]:
        """Sessions of ``shard`` that have not ended (each logs the shard's events)."""
        return [s for s in self._sessions if s.shard == shard and not s.ended]

    def _attached_sessions(self, shard: int | None) -> list[_Session]:
        """Sessions carried by an open socket, of ``shard`` or of every shard."""
        return [
            s for s in self._sessions if s.attached and (shard is None or s.shard == shard)
        ]

    def _session_on(self, ws: web.WebSocketResponse) -> _Session | None:
        return next((s for s in self._sessions if s.ws is ws), None)

    async def _send_frame_locked(self, session: _Session, frame: JSON) -> bool:
        ws = session.ws
        if ws is None or ws.closed or not session.live:
            return False
        try:
            await ws.send_str(json.dumps(frame))
        except ConnectionError:
            session.live = False
            return False
        return True

    def _visible_to_bot(self, event_name: str, data: JSON, intents: int) -> JSON:
        """Apply the MESSAGE_CONTENT intent rule to a message event (see module docstring)."""
        if (
            not self.enforce_message_content_intent
            or event_name not in ("MESSAGE_CREATE", "MESSAGE_UPDATE")
            or "guild_id" not in data
            or intents & INTENT_MESSAGE_CONTENT
        ):
            return data
        bot_id = self.bot_user["id"]
        if data.get("author", {}).get("id") == bot_id or any(
            m.get("id") == bot_id for m in data.get("mentions", [])
        ):
            return data
        return {**data, "content": "", "embeds": [], "attachments": [], "components": []}

    async def _emit_locked(self, session: _Session, event_name: str, data: JSON) -> None:
        """Log the event in ``session`` with its next sequence number; send it if live.
        RESUMED takes a number but is not logged: it ends the replay of the connection it is
        sent on, and a later RESUME replays the events, not an earlier connection's end."""
        session.seq += 1
        frame = {
            "op": 0,
            "t": event_name,
            "s": session.seq,
            "d": self._visible_to_bot(event_name, data, session.intents),
        }
        if event_name != "RESUMED":
            session.log.append(frame)
        await self._send_frame_locked(session, frame)

    async def _close_socket(
        self, ws: web.WebSocketResponse, code: int, message: bytes = b""
    ) -> None:
        """Close a gateway socket from the fake's side. The client's answering close frame
        may reach the socket's reader; it must not count as the client ending its session."""
        self._closed_by_fake.add(ws)
        await ws.close(code=code, message=message)

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        self._all_ws.add(ws)
        self.gw_queries.append(dict(request.query))
        assert self._send_lock is not None
        client_close_code: int | None = None  # set when the client sent a close frame
        try:
            await ws.send_str(
                json.dumps({"op": 10, "d": {"heartbeat_interval": HEARTBEAT_INTERVAL_MS}})
            )
            while True:
                msg = await ws.receive()
                if msg.type == WSMsgType.CLOSE:
                    if ws not in self._closed_by_fake:
                        client_close_code = msg.data
                    break
                if msg.type != WSMsgType.TEXT:
                    break  # closed by the fake, connection lost, or a binary frame
                payload = json.loads(msg.data)
                self.gw_received.append(payload)
                await self._on_gateway_payload(ws, payload)
        finally:
            async with self._send_lock:
                session = self._session_on(ws)
                if session is not None:
                    session.detach()
                    if client_close_code in CLIENT_ENDS_SESSION:
                        session.ended = True
            self.gw_close_codes.append(ws.close_code)
            self._all_ws.discard(ws)
            self._closed_by_fake.discard(ws)
            await self._notify()
        return ws

    async def _on_gateway_payload(self, ws: web.WebSocketResponse, payload: JSON) -> None:
        op = payload.get("op")
        raw_d = payload.get("d")
        d: JSON = raw_d if isinstance(raw_d, dict) else {}
        if op == 1:  # HEARTBEAT
            with contextlib.suppress(ConnectionError):
                await ws.send_str(json.dumps({"op": 11}))
        elif op in (2, 6) and self._session_on(ws) is not None:
            await self._close_socket(ws, CLOSE_ALREADY_AUTHENTICATED, b"Already authenticated.")
        elif op == 2:  # IDENTIFY
            await self._identify(ws, d)
        elif op == 6:  # RESUME
            await self._resume(ws, d)
        # op 3 presence, op 4 voice state, op 8 request members: recorded only.

    async def _identify(self, ws: web.WebSocketResponse, d: JSON) -> None:
        if d.get("token") != self.token:
            await self._close_socket(ws, CLOSE_AUTHENTICATION_FAILED, b"Authentication failed.")
            return
        shard_field = d.get("shard")
        shard: Any = None
        num_shards: Any = None
        if shard_field is None:
            shard, num_shards = 0, 1
        elif isinstance(shard_field, list) and len(shard_field) == 2:
            shard, num_shards = shard_field
        if not (
            isinstance(shard, int)
            and num_shards == self.shard_count
            and 0 <= shard < self.shard_count
        ):
            await self._close_socket(ws, CLOSE_INVALID_SHARD, b"Invalid shard.")
            return
        assert self._send_lock is not None
        async with self._send_lock:
            await self._identify_locked(ws, d, shard, shard_in_identify=shard_field is not None)
        await self._notify()

    async def _identify_locked(
        self, ws: web.WebSocketResponse, d: JSON, shard: int, *, shard_in_identify: bool
    ) -> None:
        self.intents = int(d.get("intents", 0))
        session = _Session(
            session_id=f"fake-session-{uuid.uuid4().hex[:12]}",
            shard=shard,
            intents=self.intents,
            shard_in_identify=shard_in_identify,
            ws=ws,
            live=not ws.closed,
        )
        self._sessions.append(session)
        guilds = [g for gid, g in self._guilds.items() if self.shard_of(gid) == shard]
        ready: JSON = {
            "v": 10,
            "user": self.bot_user,
            "guilds": [{"id": g["id"], "unavailable": True} for g in guilds],
            "session_id": session.session_id,
            "session_type": "normal",
            "resume_gateway_url": self.gateway_url,
            "private_channels": [],
            "relationships": [],
            "application": {"id": self.application_id, "flags": 0},
        }
        if shard_in_identify:
            ready["shard"] = [shard, self.shard_count]
        await self._emit_locked(session, "READY", ready)
        for guild in guilds:
            await self._emit_locked(session, "GUILD_CREATE", guild)
        if shard not in self._identified_shards:
            self._identified_shards.add(shard)
            for event_name, data in self._held.pop(shard, []):
                await self._emit_locked(session, event_name, data)
        self.identify_count += 1
        self.identifies_by_shard[shard] += 1

    async def _resume(self, ws: web.WebSocketResponse, d: JSON) -> None:
        assert self._send_lock is not None
        while True:
            async with self._send_lock:
                session = self._resumable(d)
                if session is None or ws.closed:
                    with contextlib.suppress(ConnectionError):
                        await ws.send_str(json.dumps({"op": 9, "d": False}))
                    return
                if not session.attached:
                    await self._resume_locked(ws, session, d.get("seq") or 0)
                    break
                displaced = session.detach()
            # Another socket carries the session: close it first (it no longer gets events).
            assert displaced is not None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._close_socket(displaced, 4000), 1.0)
        await self._notify()

    async def _resume_locked(
        self, ws: web.WebSocketResponse, session: _Session, client_seq: int
    ) -> None:
        """Attach ``session`` to ``ws``, replay what the client missed, then RESUMED."""
        session.ws, session.live = ws, True
        for frame in session.log:
            if frame["s"] > client_seq:
                await self._send_frame_locked(session, frame)
        await self._emit_locked(session, "RESUMED", {})
        self.resume_count += 1

    def _resumable(self, d: JSON) -> _Session | None:
        """The session a RESUME names, if the token is right and the session has not ended."""
        if d.get("token") != self.token:
            return None
        session_id = d.get("session_id")
        found = next((s for s in self._sessions if s.session_id == session_id), None)
        return found if found is not None and not found.ended else None

    # ------------------------------------------------------------------ internals: REST

    def _build_routes(self) -> list[tuple[str, re.Pattern[str], _Handler]]:
        ch = r"/channels/(?P<cid>\d+)"
        msg = ch + r"/messages/(?P<mid>\d+)"
        cmds = r"/applications/(?P<app>\d+)(?:/guilds/(?P<gid>\d+))?/commands"
        hook = r"/webhooks/(?P<app>\d+)/(?P<tok>[^/]+)"
        table: list[tuple[str, str, _Handler]] = [
            ("GET", r"/users/@me", self._get_me),
            ("GET", r"/oauth2/applications/@me", self._get_application),
            ("GET", r"/applications/@me", self._get_application),
            ("GET", r"/gateway", self._get_gateway),
            ("GET", r"/gateway/bot", self._get_gateway_bot),
            ("POST", r"/users/@me/channels", self._create_dm),
            ("GET", ch, self._get_channel),
            ("POST", ch + r"/typing", self._typing),
            ("POST", ch + r"/messages", self._create_message),
            ("GET", ch + r"/messages", self._history),
            ("GET", msg, self._get_message),
            ("PATCH", msg, self._edit_message),
            ("DELETE", msg, self._delete_message),
            ("PUT", msg + r"/reactions/(?P<emoji>[^/]+)/@me", self._reaction),
            ("DELETE", msg + r"/reactions/(?P<emoji>[^/]+)/@me", self._reaction),
            ("GET", cmds, self._get_commands),
            ("PUT", cmds, self._put_commands),
            ("POST", cmds, self._post_command),
            (
                "POST",
                r"/interactions/(?P<iid>\d+)/(?P<tok>[^/]+)/callback",
                self._interaction_callback,
            ),
            ("POST", hook, self._followup),
            ("GET", hook + r"/messages/(?P<mid>@original|\d+)", self._get_webhook_message),
            ("PATCH", hook + r"/messages/(?P<mid>@original|\d+)", self._edit_webhook_message),
            ("DELETE", hook + r"/messages/(?P<mid>@original|\d+)", self._delete_webhook_message),
        ]
        return [(m, re.compile(p), h) for m, p, h in table]

    @staticmethod
    async def _read_body(request: web.Request) -> tuple[Any, list[JSON]]:
        if not request.body_exists:
            return None, []
        ctype = request.content_type
        if ctype == "application/json":
            return await request.json(), []
        if ctype.startswith("multipart/"):
            body: Any = None
            files: list[JSON] = []
            reader = await request.multipart()
            async for part in reader:
                if part.name == "payload_json":
                    body = json.loads(await part.text())  # type: ignore[union-attr]
                else:
                    data = bytes(await part.read())  # type: ignore[union-attr]
                    files.append(
                        {
                            "field": part.name,
                            "filename": part.filename,
                            "size": len(data),
                            "data": data,
                            "content_type": part.headers.get("Content-Type"),
                        }
                    )
            return body, files
        text = await request.text()
        return (text or None), []

    async def _attachment(self, request: web.Request) -> web.Response:
        """GET an attachment's ``url``/``proxy_url`` (Discord's CDN): its bytes, or 404."""
        m = request.match_info
        data = self._attachment_data.get((m["cid"], m["aid"], m["filename"]))
        try:
            if data is None:
                return web.Response(status=404, text="404: Not Found")
            self.downloads.append(str(request.url.with_query(None)))
            ctype = mimetypes.guess_type(m["filename"])[0] or "application/octet-stream"
            return web.Response(body=data, headers={"Content-Type": ctype})
        finally:
            await self._notify()

    def _take_failure(self, method: str, path: str) -> web.Response | None:
        for rule in self._fail_rules:
            if rule.times > 0 and rule.method == method and rule.path.fullmatch(path):
                rule.times -= 1
                if isinstance(rule.body, (dict, list)):
                    return _json_response(rule.body, rule.status, rule.headers)
                return web.Response(status=rule.status, text=str(rule.body), headers=rule.headers)
        return None

    def _authorized(self, path: str, request: web.Request) -> bool:
        if path.startswith("/interactions/") or re.fullmatch(r"/webhooks/\d+/[^/]+(/.*)?", path):
            return True  # interaction and webhook-token routes take no Authorization (Discord docs)
        return request.headers.get("Authorization") == f"Bot {self.token}"

    async def _rest(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        method = request.method.upper()
        body, files = await self._read_body(request)
        record = RecordedRequest(
            method, path, dict(request.query), body, files, dict(request.headers)
        )
        self.calls.append(Call(method, path, body, record.time))
        self.requests.append(record)
        try:
            response = self._take_failure(method, path)
            if response is None and not self._authorized(path, request):
                response = _error(401, 0, "401: Unauthorized")
            if response is None:
                try:
                    response = await self._route(
                        method, path, _Req({}, body, dict(request.query), files)
                    )
                # A bug in the fake must fail fast: a 500 makes discord.py retry for 16 s.
                except Exception as exc:  # noqa: BLE001 - kept in server_errors
                    self.server_errors.append(exc)
                    response = _error(400, 0, f"FakeDiscord internal error: {exc!r}")
            record.status = response.status
            return response
        finally:
            await self._notify()

    async def _route(self, method: str, path: str, req: _Req) -> web.Response:
        for route_method, pattern, handler in self._routes:
            match = pattern.fullmatch(path)
            if match and route_method == method:
                req.params = {k: v for k, v in match.groupdict().items() if v is not None}
                result = handler(req)
                if asyncio.iscoroutine(result):
                    result = await result
                return result
        self.unknown_routes.append(Call(method, path, req.body, time.monotonic()))
        return _json_response({"message": "Unknown", "code": 0}, 404)

    # --- users, application, gateway

    def _get_me(self, req: _Req) -> web.Response:
        return _json_response(
            {**self.bot_user, "verified": True, "mfa_enabled": False, "locale": "en-US"}
        )

    def _get_application(self, req: _Req) -> web.Response:
        return _json_response(
            {
                "id": self.application_id,
                "name": self.bot_user["username"],
                "icon": None,
                "description": "",
                "rpc_origins": [],
                "bot_public": True,
                "bot_require_code_grant": False,
                "bot": self.bot_user,
                "terms_of_service_url": None,
                "privacy_policy_url": None,
                "owner": self.human_user,
                "verify_key": "0" * 64,
                "team": None,
                "flags": 0,
            }
        )

    def _get_gateway(self, req: _Req) -> web.Response:
        return _json_response({"url": self.gateway_url})

    def _get_gateway_bot(self, req: _Req) -> web.Response:
        return _json_response(
            {
                "url": self.gateway_url,
                "shards": self.shard_count,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": 999,
                    "reset_after": 0,
                    "max_concurrency": 1,
                },
            }
        )

    def _create_dm(self, req: _Req) -> web.Response:
        recipient_id = str((req.body or {}).get("recipient_id", ""))
        if not recipient_id:
            return _form_error("recipient_id", "BASE_TYPE_REQUIRED", "This field is required")
        known = {u["id"]: u for u in (self.human_user, self.other_bot)}
        user = known.get(recipient_id) or make_user(recipient_id, f"user{recipient_id[-4:]}")
        return _json_response(self._channels[self.dm_channel_id(user)])

    # --- channels and messages

    def _get_channel(self, req: _Req) -> web.Response:
        channel = self._channels.get(req.params["cid"])
        if channel is None:
            return _error(404, 10003, "Unknown Channel")
        return _json_response(channel)

    def _typing(self, req: _Req) -> web.Response:
        if req.params["cid"] not in self._channels:
            return _error(404, 10003, "Unknown Channel")
        return _no_content()

    @staticmethod
    def _content_error(
        body: JSON,
        files: list[JSON],
        *,
        require_something: bool = True,
        upload_limit: int | None = None,
    ) -> web.Response | None:
        """Discord's send rules: not empty (50006), content at most 2000 characters (50035)."""
        content = body.get("content") or ""
        if upload_limit and any(f["size"] > upload_limit for f in files):
            return _error(413, 40005, "Request entity too large")
        if len(content) > MAX_CONTENT_LENGTH:
            return _form_error(
                "content",
                "BASE_TYPE_MAX_LENGTH",
                f"Must be {MAX_CONTENT_LENGTH} or fewer in length.",
            )
        has_other = files or any(
            body.get(k) for k in ("embeds", "sticker_ids", "components", "poll", "attachments")
        )
        if require_something and not content.strip() and not has_other:
            return _error(400, 50006, "Cannot send an empty message")
        return None

    def _uploaded_attachments(self, channel_id: str, body: JSON, files: list[JSON]) -> list[JSON]:
        """Attachment objects for uploaded ``files[n]`` parts (described in ``attachments``)."""
        described = {
            str(a.get("id")): a for a in body.get("attachments") or [] if isinstance(a, dict)
        }
        out = []
        for index, f in enumerate(files):
            match = re.fullmatch(r"files\[(\d+)\]", f.get("field") or "")
            meta = described.get(match.group(1) if match else str(index), {})
            ctype = f.get("content_type")
            if ctype in (None, "application/octet-stream"):
                ctype = mimetypes.guess_type(f["filename"] or "")[0]
            extra = {
                k: meta[k]
                for k in ("description", "duration_secs", "waveform")
                if meta.get(k) is not None
            }
            out.append(
                self.make_attachment(
                    channel_id,
                    f.get("filename") or meta.get("filename") or "unknown",
                    f.get("data", b""),
                    content_type=ctype,
                    **extra,
                )
            )
        return out

    def _record_files(self, message: JSON, files: list[JSON], route: str) -> None:
        for f, attachment in zip(files, message["attachments"][-len(files) :] if files else []):
            self.files_sent.append(
                {
                    "channel_id": message["channel_id"],
                    "filename": f.get("filename"),
                    "data": f.get("data", b""),
                    "content": message.get("content", ""),
                    "content_type": attachment.get("content_type"),
                    "description": attachment.get("description"),
                    "message_id": message["id"],
                    "route": route,
                }
            )

    def _bot_message(self, channel_id: str, body: JSON, files: list[JSON]) -> JSON:
        """A message object authored by the bot, as Discord returns it from REST (no guild_id)."""
        mid = self.snowflake()
        message: JSON = {
            "id": mid,
            "channel_id": channel_id,
            "author": self.bot_user,
            "content": body.get("content") or "",
            "timestamp": iso_now(),
            "edited_timestamp": None,
            "tts": bool(body.get("tts", False)),
            "mention_everyone": False,
            "mentions": [],
            "mention_roles": [],
            "attachments": self._uploaded_attachments(channel_id, body, files),
            "embeds": list(body.get("embeds") or []),
            "components": list(body.get("components") or []),
            "pinned": False,
            "type": 0,
            "flags": int(body.get("flags") or 0),
        }
        if body.get("nonce") is not None:
            message["nonce"] = body["nonce"]
        return message

    def _create_message(self, req: _Req) -> web.Response:
        cid = req.params["cid"]
        if cid not in self._channels:
            return _error(404, 10003, "Unknown Channel")
        body: JSON = req.body if isinstance(req.body, dict) else {}
        error = self._content_error(body, req.files, upload_limit=self.upload_limit)
        if error is not None:
            return error
        nonce = body.get("nonce")
        if body.get("enforce_nonce") and nonce is not None and (cid, str(nonce)) in self._nonces:
            existing = self._messages.get(self._nonces[(cid, str(nonce))])
            if existing is not None:
                return _json_response(existing)  # Discord dedupes by nonce: no second message
        reference = body.get("message_reference")
        referenced: JSON | None = None
        if reference:
            referenced = self._messages.get(str(reference.get("message_id")))
            if referenced is None and reference.get("fail_if_not_exists", True):
                return _form_error(
                    "message_reference", "MESSAGE_REFERENCE_UNKNOWN_MESSAGE", "Unknown message"
                )
        message = self._bot_message(cid, body, req.files)
        if referenced is not None:
            message["type"] = 19
            message["message_reference"] = {
                "type": 0,
                "message_id": referenced["id"],
                "channel_id": cid,
            }
            message["referenced_message"] = referenced
        self._messages[message["id"]] = message
        self._record_files(message, req.files, "channel")
        self._sent.append((cid, message["content"], message["id"]))
        if nonce is not None:
            self._nonces[(cid, str(nonce))] = message["id"]
        return _json_response(message)

    def _history(self, req: _Req) -> web.Response:
        cid = req.params["cid"]
        if cid not in self._channels:
            return _error(404, 10003, "Unknown Channel")
        limit = int(req.query.get("limit", 50))
        msgs = sorted(
            (m for m in self._messages.values() if m["channel_id"] == cid),
            key=lambda m: int(m["id"]),
        )
        if "before" in req.query:
            msgs = [m for m in msgs if int(m["id"]) < int(req.query["before"])]
        if "after" in req.query:
            msgs = [m for m in msgs if int(m["id"]) > int(req.query["after"])]
        return _json_response(list(reversed(msgs))[:limit])

    def _lookup(self, req: _Req) -> JSON | None:
        message = self._messages.get(req.params["mid"])
        if message is None or message["channel_id"] != req.params["cid"]:
            return None
        return message

    def _get_message(self, req: _Req) -> web.Response:
        message = self._lookup(req)
        return _json_response(message) if message else _error(404, 10008, "Unknown Message")

    def _apply_edit(
        self, message: JSON, body: JSON, files: list[JSON] | None = None
    ) -> web.Response | None:
        files = files or []
        error = self._content_error(
            body, files, require_something=False, upload_limit=self.upload_limit
        )
        if error is not None:
            return error
        if "attachments" in body or files:
            listed = body.get("attachments")
            kept = (
                message.get("attachments", [])
                if listed is None
                else [
                    a
                    for a in message.get("attachments", [])
                    if a["id"] in {str(x.get("id")) for x in listed if isinstance(x, dict)}
                ]
            )
            message["attachments"] = kept + self._uploaded_attachments(
                message["channel_id"], body, files
            )
        for key in ("content", "embeds", "components", "flags"):
            if key in body:
                message[key] = (
                    body[key] if body[key] is not None else ([] if key != "content" else "")
                )
        if (
            not (message.get("content") or "").strip()
            and not message.get("embeds")
            and not message.get("attachments")
        ):
            return _error(400, 50006, "Cannot send an empty message")
        message["edited_timestamp"] = iso_now()
        return None

    def _edit_message(self, req: _Req) -> web.Response:
        message = self._lookup(req)
        if message is None:
            return _error(404, 10008, "Unknown Message")
        if message["author"]["id"] != self.bot_user["id"]:
            return _error(403, 50005, "Cannot edit a message authored by another user")
        error = self._apply_edit(message, req.body if isinstance(req.body, dict) else {}, req.files)
        if error is None:
            self._record_files(message, req.files, "edit")
        return error or _json_response(message)

    def _delete_message(self, req: _Req) -> web.Response:
        message = self._lookup(req)
        if message is None:
            return _error(404, 10008, "Unknown Message")
        del self._messages[message["id"]]
        return _no_content()

    def _reaction(self, req: _Req) -> web.Response:
        if self._lookup(req) is None:
            return _error(404, 10008, "Unknown Message")
        return _no_content()

    # --- application commands

    def _get_commands(self, req: _Req) -> web.Response:
        return _json_response(self.app_commands.get(req.params.get("gid"), []))

    def _normalise_command(self, command: JSON, gid: str | None, existing: list[JSON]) -> JSON:
        same = [
            c
            for c in existing
            if c["name"] == command["name"] and c["type"] == command.get("type", 1)
        ]
        out: JSON = {
            "type": 1,
            "description": "",
            "options": [],
            "default_member_permissions": None,
            "dm_permission": True,
            "nsfw": False,
            **command,
            "id": same[0]["id"] if same else self.snowflake(),
            "application_id": self.application_id,
            "version": self.snowflake(),
        }
        if gid is not None:
            out["guild_id"] = gid
        return out

    def _put_commands(self, req: _Req) -> web.Response:
        gid = req.params.get("gid")
        existing = self.app_commands.get(gid, [])
        commands = [self._normalise_command(c, gid, existing) for c in (req.body or [])]
        self.app_commands[gid] = commands
        return _json_response(commands)

    def _post_command(self, req: _Req) -> web.Response:
        gid = req.params.get("gid")
        existing = self.app_commands.get(gid, [])
        command = self._normalise_command(req.body or {}, gid, existing)
        self.app_commands[gid] = [c for c in existing if c["id"] != command["id"]] + [command]
        return _json_response(command)

    # --- interactions and their webhook messages

    def _interaction_callback(self, req: _Req) -> web.Response:
        iid, token = req.params["iid"], req.params["tok"]
        body: JSON = req.body if isinstance(req.body, dict) else {}
        self.interaction_responses.append({"id": iid, "token": token, **body, "files": req.files})
        known = self._interactions.get(iid)
        if known is None or known["payload"]["token"] != token:
            return _error(404, 10062, "Unknown interaction")
        if known["acknowledged"]:
            return _error(400, 40060, "Interaction has already been acknowledged.")
        callback_type = int(body.get("type", 0))
        data: JSON = body.get("data") or {}
        message: JSON | None = None
        if callback_type in (
            4,
            5,
        ):  # CHANNEL_MESSAGE_WITH_SOURCE, DEFERRED_CHANNEL_MESSAGE_WITH_SOURCE
            if callback_type == 4:
                error = self._content_error(data, req.files, upload_limit=self.upload_limit)
                if error is not None:
                    return error
            payload = known["payload"]
            message = self._bot_message(
                payload["channel_id"], data if callback_type == 4 else {}, req.files
            )
            message["type"] = 20
            message["interaction_metadata"] = {
                "id": iid,
                "type": payload["type"],
                "user": payload.get("user") or payload["member"]["user"],
                "authorizing_integration_owners": payload.get("authorizing_integration_owners", {}),
            }
            if callback_type == 5:
                message["flags"] = int(data.get("flags") or 0) | 128  # LOADING
            self._messages[message["id"]] = message
            self._record_files(message, req.files, "interaction")
            self._originals[token] = message["id"]
        known["acknowledged"] = True
        if req.query.get("with_response") not in ("1", "true", "True"):
            return _no_content()
        flags = int(data.get("flags") or 0)
        response: JSON = {
            "interaction": {
                "id": iid,
                "type": known["payload"]["type"],
                "response_message_loading": callback_type == 5,
                "response_message_ephemeral": bool(flags & 64),
            },
            "resource": {"type": callback_type},
        }
        if message is not None:
            response["interaction"]["response_message_id"] = message["id"]
            response["resource"]["message"] = message
        return _json_response(response)

    def _interaction_by_token(self, token: str) -> JSON | None:
        for known in self._interactions.values():
            if known["payload"]["token"] == token:
                return known["payload"]
        return None

    def _webhook_message(self, req: _Req) -> JSON | None:
        mid = req.params["mid"]
        if mid == "@original":
            mid = self._originals.get(req.params["tok"], "")
        return self._messages.get(mid)

    def _followup(self, req: _Req) -> web.Response:
        payload = self._interaction_by_token(req.params["tok"])
        if payload is None:
            return _error(404, 10015, "Unknown Webhook")
        body: JSON = req.body if isinstance(req.body, dict) else {}
        error = self._content_error(body, req.files, upload_limit=self.upload_limit)
        if error is not None:
            return error
        message = self._bot_message(payload["channel_id"], body, req.files)
        self._messages[message["id"]] = message
        self._record_files(message, req.files, "webhook")
        return (
            _json_response(message)
            if req.query.get("wait") in ("1", "true", "True")
            else _no_content()
        )

    def _get_webhook_message(self, req: _Req) -> web.Response:
        message = self._webhook_message(req)
        return _json_response(message) if message else _error(404, 10008, "Unknown Message")

    def _edit_webhook_message(self, req: _Req) -> web.Response:
        message = self._webhook_message(req)
        if message is None:
            return _error(404, 10008, "Unknown Message")
        message["flags"] = int(message.get("flags") or 0) & ~128
        error = self._apply_edit(message, req.body if isinstance(req.body, dict) else {}, req.files)
        if error is None:
            self._record_files(message, req.files, "edit")
        return error or _json_response(message)

    def _delete_webhook_message(self, req: _Req) -> web.Response:
        message = self._webhook_message(req)
        if message is None:
            return _error(404, 10008, "Unknown Message")
        del self._messages[message["id"]]
        return _no_content()
