"""Project rules that keep the code and the docs honest."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from bumblebot.core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, field)`` for every leaf setting."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_fields(ann, f"{prefix}{name}.")
        else:
            out.append((prefix + name, field))
    return out


#: The reference of every config key (the README links to it).
CONFIG_DOC = ROOT / "docs" / "configuration.md"
#: The README's two commands, word for word.
INSTALL_AND_RUN = "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/bumblebot run"
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q -n 4 -m 'not drill' && .venv/bin/python -m pytest -q -m drill"


def _config_keys() -> list[tuple[str, Any]]:
    """Every leaf key of :class:`Settings`, and those of one MCP server (``mcp.servers.<name>.…``)
    and of one fallback endpoint (``llm.fallbacks[].…``)."""
    from bumblebot.core.mcp_settings import MCPServerSettings
    from bumblebot.core.settings import FallbackSettings

    return (
        _leaf_fields(Settings) + _leaf_fields(MCPServerSettings, "mcp.servers.<name>.")
        + _leaf_fields(FallbackSettings, "llm.fallbacks[].")
    )


def _documented_defaults(doc: str) -> dict[str, list[str]]:
    """The rows ``| `key` | `default` | meaning |`` of the doc's "Every key" section: each
    key with the defaults its rows show (one per row)."""
    import re

    section = doc.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \| `([^`]*)` \|", line)
        if m:
            rows.setdefault(m.group(1), []).append(m.group(2))
    return rows


def _shows(text: str, value: Any) -> bool:
    """Whether a table cell shows ``value`` (``null``, ``true``, ``{}``, ``./data``, ``60.0``…)."""
    import yaml

    if isinstance(value, Path):
        return Path(text) == value
    if isinstance(value, str):
        return text == value
    return yaml.safe_load(text) == value and type(yaml.safe_load(text)) is type(value)


def test_configuration_doc_documents_every_config_key():
    """docs/configuration.md has one row per key with the key's default, and no key the code lacks."""
    rows = _documented_defaults(CONFIG_DOC.read_text())
    keys = _config_keys()
    missing = [k for k, _ in keys if k not in rows]
    assert not missing, f"docs/configuration.md lacks: {missing}"
    assert [k for k, shown in rows.items() if len(shown) > 1] == [], "keys documented twice"
    assert sorted(set(rows) - {k for k, _ in keys}) == [], "docs/configuration.md documents keys the code lacks"
    wrong = [
        (k, rows[k][0], default)
        for k, f in keys
        if not _shows(rows[k][0], default := f.get_default(call_default_factory=True))
    ]
    assert wrong == [], "docs/configuration.md shows wrong defaults (key, shown, actual)"


def _fenced(text: str) -> list[str]:
    """The contents of the fenced code blocks of a Markdown text."""
    import re

    return [m.group(1).strip() for m in re.finditer(r"^```[a-z]*\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)]


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    """The README's install-and-run and test commands, each alone in a fenced block; the
    ``bumblebot`` script they run exists; ``.ci/run`` installs and runs the tests the same way."""
    import tomllib

    blocks = _fenced((ROOT / "README.md").read_text())
    assert INSTALL_AND_RUN in blocks
    assert TEST_COMMAND in blocks
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["bumblebot"] == "bumblebot.app.cli:main"
    assert "test" in project["optional-dependencies"]
    assert any(d.startswith("pytest-xdist") for d in project["optional-dependencies"]["test"])  # -n 4
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line.endswith("pip install --quiet -e '.[test]'") for line in ci)
    *_, parallel, drills = TEST_COMMAND.split(" && ")
    assert ci[-2:] == [parallel, "exec " + drills]


def _subcommands(p: Any) -> dict[str, Any]:
    import argparse

    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_readme_names_real_subcommands_and_options_and_every_command():
    """Every subcommand and chat command is in the README, and every ``bumblebot …`` it shows
    uses subcommands and options the CLI has."""
    import re

    from bumblebot.app.cli import parser
    from bumblebot.core.commands import COMMANDS

    readme = (ROOT / "README.md").read_text()
    top = parser()
    names = [  # `bumblebot run`, …, `bumblebot service install`
        f"bumblebot {name} {action}".strip()
        for name, sub in _subcommands(top).items()
        for action in (_subcommands(sub) or [""])
    ]
    assert [n for n in names if f"`{n}" not in readme] == []
    assert [c.name for c in COMMANDS if f"`/{c.name}`" not in readme] == []
    problems = []
    for span in re.findall(r"`(bumblebot [^`]+)`", readme):
        p = top
        for word in span.split()[1:]:
            word = word.strip("[]")
            if word in _subcommands(p):
                p = _subcommands(p)[word]
            elif word.startswith("-") and word not in {**top._option_string_actions, **p._option_string_actions}:
                problems.append(f"{span}: {word}")
    assert problems == []


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    import re

    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_and_docs_links_point_to_existing_files():
    """Every relative link of the README and of docs/*.md names a file that exists, and a
    ``#section`` of a Markdown file one of its headings."""
    import re

    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```$", "", md.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            name, _, anchor = target.partition("#")
            dest = (md.parent / name).resolve() if name else md
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such section)")
    assert broken == []


def test_every_config_field_has_a_description():
    assert [k for k, f in _leaf_fields(Settings) if not f.description] == []


def test_env_example_lists_every_secret():
    text = (ROOT / ".env.example").read_text()
    for name in ("TELEGRAM_BOT_TOKEN", "DISCORD_BOT_TOKEN", "OPENAI_API_KEY", "OPENAI_BASE_URL", "BUMBLEBOT_CONFIG"):
        assert f"{name}=" in text


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _sources() -> list[Path]:
    return sorted([*(ROOT / "bumblebot").rglob("*.py"), *(ROOT / "adapters").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])


def test_platform_and_model_sdks_stay_in_their_room():
    """The platform SDKs stay in their adapter; ``openai`` only in ``bumblebot/llm/``."""
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        used = _imports(path)
        if "telegram" in used and not rel.startswith("adapters/telegram/"):
            problems.append(f"{rel} imports telegram")
        if "discord" in used and not rel.startswith("adapters/discord/"):
            problems.append(f"{rel} imports discord")
        if "openai" in used and not rel.startswith("bumblebot/llm/"):
            problems.append(f"{rel} imports openai")
    assert problems == []


#: The rooms of the tree and the floor each stands on (docs/architecture.md shows this table and
#: the picture drawn from it). A module imports modules of its own room and of rooms on lower
#: floors: never one beside it, never one above it. ``bumblebot/__init__.py`` (the version) is
#: the ground every room stands on.
FLOORS = {
    "bumblebot/core": 1,
    "bumblebot/store": 2,
    "bumblebot/llm": 2,
    "bumblebot/media": 3,
    "bumblebot/delivery": 3,
    "bumblebot/cognition": 4,
    "bumblebot/runtime": 5,
    "adapters": 5,
    "tools": 6,
    "adapters/telegram": 6,
    "adapters/discord": 6,
    "bumblebot/web": 6,
    "bumblebot/cluster": 6,
    "bumblebot/app": 7,
}


def _room(rel: str) -> str | None:
    """The room of a file (``bumblebot/runtime/runner.py`` → ``bumblebot/runtime``) or of a
    module (``bumblebot.runtime.runner`` → the same); ``None`` for the ground."""
    parts = rel.replace(".", "/").split("/")
    if parts[-1] == "py":
        parts = parts[:-1]
    if parts[:2] == ["bumblebot", "__main__"]:
        return "bumblebot/app"  # the entry point runs the command line
    if parts[0] == "bumblebot":
        return f"bumblebot/{parts[1]}" if len(parts) > 1 and (ROOT / "bumblebot" / parts[1]).is_dir() else None
    if parts[0] == "adapters":
        return f"adapters/{parts[1]}" if len(parts) > 1 and (ROOT / "adapters" / parts[1]).is_dir() else "adapters"
    return "tools" if parts[0] == "tools" else None


def _imported_modules(path: Path) -> set[str]:
    """Every module of the tree ``path`` imports, at any depth (``TYPE_CHECKING`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: tools/ imports its siblings this way
                out.add(".".join(path.relative_to(ROOT).parent.parts))
            elif node.module:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.split(".")[0] in ("bumblebot", "adapters", "tools")}


def test_every_folder_is_a_room_on_a_floor():
    rooms = {_room(p.relative_to(ROOT).as_posix()) for p in _sources()} - {None}
    assert rooms == set(FLOORS)


def test_imports_point_down_the_floors():
    """No arrow runs back up the layers, nor sideways between rooms of one floor."""
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        own = _room(rel)
        if own is None:
            continue
        for module in sorted(_imported_modules(path)):
            target = _room(module)
            if target is None or target == own:
                continue
            if FLOORS[target] >= FLOORS[own]:
                problems.append(f"{rel} (floor {FLOORS[own]}) imports {module} ({target}, floor {FLOORS[target]})")
    assert problems == []


def test_the_architecture_doc_shows_the_floors():
    """docs/architecture.md's table of rooms is this rule."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown: dict[str, int] = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for room in cells[1].replace("`", "").split(","):
                shown[room.strip().rstrip("/")] = int(cells[0])
    assert shown == FLOORS


def _engine_modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "bumblebot").rglob("*.py")}


def test_the_engine_has_no_import_cycle():
    """Imports inside ``bumblebot/`` form no cycle, not even behind ``TYPE_CHECKING``."""
    modules = _engine_modules()
    graph = {}
    for name, path in modules.items():
        found = set()
        for module in _imported_modules(path):
            found |= {m for m in modules if module == m or module.startswith(m + ".")}
        graph[name] = found - {name}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt.endswith(".__init__") or node.endswith(".__init__"):
                continue  # a package's front page re-exports its own modules
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_only_the_composition_root_knows_the_engine():
    """Adapters see the engine only as ``bumblebot.core.adapter.Intake``; no part reaches back
    into ``Engine`` (no service locator)."""
    users = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if _room(rel) != "bumblebot/app" and "bumblebot.runtime.engine" in _imported_modules(path):
            users.append(rel)
    assert users == []


#: Store methods that write a conversation's history, compaction state or turns.
CONVERSATION_WRITERS = (
    "begin_turn", "record", "speak", "finish_turn", "save_compaction", "mark_pruned", "reset",
)


def test_conversation_state_has_one_writer():
    """Only ``bumblebot/runtime/conversation.py`` (Session, Turn, Conversation) calls the store's
    history, compaction and turn writers."""
    import re

    pattern = re.compile(r"store\.(" + "|".join(CONVERSATION_WRITERS) + r")\(")
    offenders = []
    for path in [*(ROOT / "bumblebot").rglob("*.py"), *(ROOT / "adapters").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel != "bumblebot/runtime/conversation.py" and pattern.search(path.read_text()):
            offenders.append(rel)
    assert offenders == []


def test_architecture_doc_names_existing_files():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in sorted((ROOT / "bumblebot").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        assert rel in doc, f"docs/architecture.md does not mention {rel}"


#: A module is one concept and a few hundred lines: past this, cut it.
MAX_MODULE_LINES = 600
#: The rooms a turn runs through, where a function must read in one sitting.
TURN_PATH = ("bumblebot/cognition", "bumblebot/runtime", "bumblebot/delivery", "bumblebot/store", "bumblebot/llm")
MAX_TURN_FUNCTION_LINES = 80


def test_no_module_is_over_a_few_hundred_lines():
    long = {}
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long[path.relative_to(ROOT).as_posix()] = lines
    assert long == {}


def test_no_function_in_the_turn_path_is_over_eighty_lines():
    long = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(TURN_PATH):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_TURN_FUNCTION_LINES:
                    long[f"{rel}:{node.name}"] = lines
    assert long == {}


def test_no_comment_cites_an_issue_or_a_document_outside_the_repository():
    """Comments say why the code is as it is; history belongs in commit messages."""
    import re
    import tokenize

    cite = re.compile(
        r"\bissues? #?\d+|\breview(?:er)? round|\bround \d+ of review|field[- ]bugs|reference[- ]study|\.\./shared/"
        r"|\(spec[,:]|\bspec:|\bthe spec\b|\bspec's\b",  # the product spec is not in the repository: docs/ is
        re.I,
    )
    found = []
    for path in _sources():
        with path.open("rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                if tok.type in (tokenize.COMMENT, tokenize.STRING) and cite.search(tok.string):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{tok.start[0]}: {tok.string.strip()[:80]}")
    assert found == []
