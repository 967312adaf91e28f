"""Configuration loading: precedence, validation errors that name file and key, entities."""

from __future__ import annotations

import os

import pytest

from bumblebot.core.config import Secrets, effective_base_url, endpoint_secrets, find_config, load_secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.core.errors import ConfigError


def test_defaults_without_a_file(tmp_path):
    settings = load_settings(None)
    assert settings.cognition.max_context_tokens == 32768
    assert settings.cognition.history_compression.compaction_protect_last_n == 12
    assert settings.data_dir == (tmp_path / "data").resolve()
    assert settings.workspace == settings.data_dir / "workspace"


def test_env_overrides_yaml_key_by_key(tmp_path, monkeypatch):
    path = tmp_path / "bumblebot.yaml"
    path.write_text("llm:\n  model: from-yaml\n  timeout_s: 5\n")
    monkeypatch.setenv("BUMBLEBOT_LLM__MODEL", "from-env")
    settings = load_settings(find_config(None))
    assert settings.llm.model == "from-env" and settings.llm.timeout_s == 5


def test_config_path_from_env_and_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BUMBLEBOT_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError) as caught:
        find_config(None)
    assert "nope.yaml" in str(caught.value) and "not found" in str(caught.value)


@pytest.mark.parametrize(
    ("yaml_text", "key", "expected"),
    [
        ("cognition:\n  max_context_tokens: lots\n", "cognition.max_context_tokens", "integer"),
        ("telegram:\n  allowed_user_ids: alice\n", "telegram.allowed_user_ids", "list"),
        ("discord:\n  respond_in_guilds: sometimes\n", "discord.respond_in_guilds", "'mention', 'all' or 'off'"),
        ("cognition:\n  history_compression:\n    compaction_threshold_ratio: 1.5\n",
         "cognition.history_compression.compaction_threshold_ratio", "less than 1"),
        ("cognition:\n  history_compression:\n    compaction_target_ratio: 0.8\n",
         "cognition.history_compression", "below compaction_threshold_ratio"),
        ("llm: [1, 2]\n", "llm", "dictionary"),
        ("- just\n- a list\n", "(top level)", "mapping"),
        ("llm:\n  model: [unclosed\n", "line", "invalid YAML"),
        ("tools:\n  shel:\n    enabled: true\n", "tools.shel", "unknown key"),
        ("llm:\n  prices:\n    gpt-4o: {input: 2.5}\n", "llm.prices.gpt-4o", "both input and output"),
        ("llm:\n  prices:\n    gpt-4o: {}\n", "llm.prices.gpt-4o", "or audio_minute"),
        ("llm:\n  prices:\n    gpt-4o: {input: 1, output: 2, cache: 1}\n", "llm.prices.gpt-4o.cache", "unknown key"),
    ],
)
def test_bad_config_names_file_key_and_expectation(tmp_path, yaml_text, key, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and key in message and expected in message


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    (conf_dir / "bumblebot.yaml").write_text("data_dir: state\ntools:\n  workspace: ws\n")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(conf_dir / "bumblebot.yaml")
    assert settings.data_dir == (conf_dir / "state").resolve()
    assert settings.workspace == (conf_dir / "ws").resolve()


def test_secrets_come_from_env_and_dotenv_and_are_not_shown(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("TELEGRAM_BOT_TOKEN=123:abc-from-dotenv\nUNRELATED=1\n")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    secrets = Secrets()
    assert secrets.telegram_bot_token.get_secret_value() == "123:abc-from-dotenv"
    assert "abc-from-dotenv" not in repr(secrets)
    assert effective_base_url(load_settings(None), secrets) == "http://127.0.0.1:9/v1"


def test_a_fallback_key_comes_from_the_variable_its_config_names_in_env_or_dotenv(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("ROUTER_KEY=sk-router-from-dotenv-0001\nOTHER_KEY=sk-other-from-dotenv-0002\n")
    (tmp_path / "bumblebot.yaml").write_text(
        "llm:\n  fallbacks:\n    - {base_url: 'http://127.0.0.1:9/v1', api_key_env: ROUTER_KEY}\n"
        "    - {base_url: 'http://127.0.0.1:10/v1', api_key_env: OTHER_KEY}\n"
        "    - {base_url: 'http://127.0.0.1:11/v1', api_key_env: MISSING_KEY}\n"
    )
    monkeypatch.setenv("OTHER_KEY", "sk-other-from-the-environment-0003")  # the environment wins
    settings = load_settings(tmp_path / "bumblebot.yaml")
    secrets = load_secrets(path=tmp_path / ".env")
    assert secrets.named("ROUTER_KEY") == "sk-router-from-dotenv-0001" and secrets.named("MISSING_KEY") is None
    assert endpoint_secrets(settings, secrets) == ["sk-router-from-dotenv-0001", "sk-other-from-the-environment-0003"]
    assert "sk-router" not in repr(secrets)
    assert endpoint_secrets(settings, load_secrets(read_dotenv=False)) == ["sk-other-from-the-environment-0003"]


def test_entity_errors_name_the_entity_file(tmp_path):
    (tmp_path / "entities").mkdir()
    (tmp_path / "entities" / "odd.yaml").write_text("name: Odd\nvoice: [1, {a: b}]\n")
    with pytest.raises(ConfigError) as caught:
        load_entity("odd", config_dir=tmp_path)
    assert "odd.yaml" in str(caught.value) and "voice" in str(caught.value)
    with pytest.raises(ConfigError, match="not found"):
        load_entity("missing", config_dir=tmp_path)
    (tmp_path / "entities" / "tz.yaml").write_text("name: T\ntimezone: Mars/Olympus\n")
    with pytest.raises(ConfigError, match="IANA"):
        load_entity("tz", config_dir=tmp_path)


def test_bundled_default_entity_loads(tmp_path):
    entity = load_entity("default")
    assert entity.name and entity.voice and entity.greeting


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"BUMBLEBOT_TELEGRAM__ALLOWED_USER_IDS": "[1,2"}, "a valid JSON value"),
        ({"BUMBLEBOT_LLM__MODLE": "x"}, "environment variable BUMBLEBOT_LLM__MODLE: no such setting"),
        ({"BUMBLEBOT_LLM_MODEL": "x"}, "two underscores"),
        ({"BUMBLEBOT_COGNITION__MAX_CONTEXT_TOKENS": "abc"}, "environment variable BUMBLEBOT_COGNITION__MAX_CONTEXT_TOKENS"),
    ],
)
def test_bad_environment_overrides_are_named_as_such(monkeypatch, env, expected):
    """Regressions: an env typo was silently ignored or blamed on the YAML file; bad JSON crashed."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(None)
    assert expected in str(caught.value)


def test_log_level_is_case_insensitive(monkeypatch):
    monkeypatch.setenv("BUMBLEBOT_LOG_LEVEL", "debug")
    assert load_settings(None).log_level == "DEBUG"


def test_non_utf8_files_are_config_errors(tmp_path):
    bad = tmp_path / "bumblebot.yaml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_settings(bad)
    (tmp_path / "entities").mkdir()
    (tmp_path / "entities" / "odd.yaml").write_bytes(b"name: \xff\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_entity("odd", config_dir=tmp_path)


def test_entity_errors_name_the_config_file_that_asked_for_it(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_entity("ghost", config_dir=tmp_path, source=str(tmp_path / "bumblebot.yaml"))
    assert str(caught.value).startswith(str(tmp_path / "bumblebot.yaml") + ": entity:")


def test_bumblebot_lines_of_dotenv_count_like_env_vars(tmp_path, monkeypatch):
    from bumblebot.core.config import apply_dotenv

    (tmp_path / ".env").write_text("BUMBLEBOT_LLM__MODEL=from-dotenv\nBUMBLEBOT_LOG_LEVEL=warning\nTELEGRAM_BOT_TOKEN=1:x\n")
    monkeypatch.setenv("BUMBLEBOT_LOG_LEVEL", "ERROR")  # the real environment wins
    taken = apply_dotenv(tmp_path / ".env")
    try:
        settings = load_settings(None)
        assert settings.llm.model == "from-dotenv" and settings.log_level == "ERROR"
        assert taken == ["BUMBLEBOT_LLM__MODEL"] and "TELEGRAM_BOT_TOKEN" not in os.environ
    finally:
        for name in taken:
            monkeypatch.delenv(name, raising=False)


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "bumblebot.yaml"
    path.write_text("data_dir: ~/bbdata\ntools:\n  workspace: ~/ws\n")
    settings = load_settings(path)
    assert settings.data_dir == (tmp_path / "home" / "bbdata").resolve()
    assert settings.workspace == (tmp_path / "home" / "ws").resolve()


def test_non_text_yaml_keys_are_config_errors(tmp_path):
    path = tmp_path / "bumblebot.yaml"
    path.write_text("on: 1\n")
    with pytest.raises(ConfigError, match="keys must be text"):
        load_settings(path)


def test_bare_off_in_yaml_means_off_and_nested_non_text_keys_are_named(tmp_path):
    path = tmp_path / "bumblebot.yaml"
    path.write_text("discord:\n  respond_in_guilds: off\nllm:\n  thinking:\n    mode: off\n")
    settings = load_settings(path)
    assert settings.discord.respond_in_guilds == "off" and settings.llm.thinking.mode == "off"
    path.write_text("telegram:\n  on: true\n")
    with pytest.raises(ConfigError, match=r"telegram\.True: keys must be text"):
        load_settings(path)


@pytest.mark.parametrize(("yaml_value", "env_value", "expected"), [
    ("on", None, "on"), ("off", None, "off"), ("no", None, "off"), ("true", None, "on"),
    (None, "false", "off"), (None, "0", "off"), (None, "yes", "on"), (None, "ON", "on"),
])
def test_streaming_takes_the_usual_ways_of_saying_on_and_off(tmp_path, monkeypatch, yaml_value, env_value, expected):
    """``on``/``off``, ``yes``/``no`` and ``true``/``false`` mean the same in YAML (booleans to YAML
    1.1) and in an env override (the env override once refused them)."""
    path = tmp_path / "bumblebot.yaml"
    path.write_text(f"delivery: {{streaming: {yaml_value}}}\n" if yaml_value else "{}\n")
    if env_value is not None:
        monkeypatch.setenv("BUMBLEBOT_DELIVERY__STREAMING", env_value)
    assert load_settings(path).delivery.streaming == expected


def test_a_bad_streaming_value_names_the_key(tmp_path):
    path = tmp_path / "bumblebot.yaml"
    path.write_text("delivery: {streaming: sometimes}\n")
    with pytest.raises(ConfigError, match="delivery.streaming"):
        load_settings(path)


def test_one_setting_caps_a_tool_result_and_the_old_key_is_ignored(tmp_path):
    """``tools.max_result_chars`` was a second cap beside ``cognition.max_tool_result_share``;
    an old file that still sets it loads, and the share of the window decides."""
    from bumblebot.app.daemon import build_toolbox

    (tmp_path / "config.yaml").write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "cognition: {max_context_tokens: 8192, max_tool_result_share: 0.1}\n"
        "tools: {max_result_chars: 900}\n"
    )
    settings = load_settings(tmp_path / "config.yaml")
    assert build_toolbox(settings).max_result_chars == int(0.1 * 8192 * 4)


def test_a_tool_result_share_too_small_for_any_result_is_a_config_error_naming_the_key(tmp_path):
    """0.01 of a 4,096-token window is 163 characters: the file loaded, ``check`` said it was
    fine, and ``run`` died with a traceback building the tools."""
    path = tmp_path / "config.yaml"
    path.write_text("cognition: {max_context_tokens: 4096, max_tool_result_share: 0.01}\n")
    with pytest.raises(ConfigError, match="max_tool_result_share"):
        load_settings(path)


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    """``--config /tmp`` said "config file not found" about a directory that exists."""
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        find_config(str(tmp_path))


@pytest.mark.parametrize("url", ["postgresq://bumblebot:TopSecret77@127.0.0.1/bb", "postgresql:/bumblebot:TopSecret77@h/bb"])
def test_a_store_url_that_is_no_database_is_refused_without_showing_it(tmp_path, url):
    """A scheme typo was shown back in the error, password and all; one missing slash made a
    SQLite file named like the URL."""
    path = tmp_path / "bumblebot.yaml"
    path.write_text(f"store: {{url: '{url}'}}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert caught.value.key == "store.url" and "TopSecret77" not in str(caught.value)


def test_a_sqlite_store_url_is_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "etc").mkdir()
    path = tmp_path / "etc" / "bumblebot.yaml"
    path.write_text("store: {url: state/rel.db}\n")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(path)
    assert settings.db_path == tmp_path / "etc" / "state" / "rel.db" and not settings.on_postgres


def test_a_password_in_the_store_url_is_a_secret_as_written_and_decoded(tmp_path):
    from bumblebot.core.config import store_secrets

    path = tmp_path / "bumblebot.yaml"
    path.write_text("store: {url: 'postgresql://bb:p%40ss@h/db?sslmode=require&password=Other1'}\n")
    assert sorted(store_secrets(load_settings(path))) == ["Other1", "p%40ss", "p@ss"]
