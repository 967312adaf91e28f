"""The baseline of ``bench/bench_chat.py``: the thinnest possible Telegram chat bot.

python-telegram-bot's ``Application`` with one ``MessageHandler``: each text message makes one
chat completion (``openai.AsyncOpenAI``) and one ``sendMessage`` with the reply text. Updates
are handled concurrently (``concurrent_updates(True)``), as any bot serving more than one chat
at a time would. With ``--stream`` the completion is streamed and the reply is still sent once,
at the end (so its first visible text is its complete reply).

Not meant to be run by hand: ``bench_chat.py`` starts it as a subprocess against its fakes::

    python bench/baseline_bot.py --telegram-base-url URL --llm-base-url URL [--stream]

The bot token comes from ``TELEGRAM_BOT_TOKEN``. SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import os

import openai
from telegram import Update
from telegram.ext import Application, ApplicationBuilder, ContextTypes, MessageHandler, filters

MODEL = "baseline-model"  # bench_chat.py's fake model recognises the baseline by this name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--telegram-base-url", required=True)
    parser.add_argument("--telegram-base-file-url", default=None)
    parser.add_argument("--llm-base-url", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--poll-timeout", type=int, default=30)
    args = parser.parse_args()

    client: openai.AsyncOpenAI | None = None

    async def post_init(app: Application) -> None:  # type: ignore[type-arg]
        nonlocal client
        client = openai.AsyncOpenAI(base_url=args.llm_base_url, api_key="sk-bench", max_retries=0, timeout=60)

    async def post_shutdown(app: Application) -> None:  # type: ignore[type-arg]
        if client is not None:
            await client.close()

    async def on_text(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        assert client is not None and update.message is not None and update.effective_chat is not None
        messages = [{"role": "user", "content": update.message.text or ""}]
        if args.stream:
            parts: list[str] = []
            stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)  # type: ignore[arg-type]
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            reply = "".join(parts)
        else:
            completion = await client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
            reply = completion.choices[0].message.content or ""
        await context.bot.send_message(update.effective_chat.id, reply)

    base_file_url = args.telegram_base_file_url or args.telegram_base_url.replace("/bot", "/file/bot")
    app = (
        ApplicationBuilder()
        .token(os.environ["TELEGRAM_BOT_TOKEN"])
        .base_url(args.telegram_base_url)
        .base_file_url(base_file_url)
        .concurrent_updates(True)
        .post_init(post_init)
        .post_shutdown(post_shutdown)
        .build()
    )
    app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, on_text))
    app.run_polling(poll_interval=0.0, timeout=args.poll_timeout, allowed_updates=["message"])


if __name__ == "__main__":
    main()
