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


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    missing = [k for k, _ in _leaf_fields(Settings) if f"`{k}`" not in readme]
    assert not missing, f"README.md lacks: {missing}"


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
    "bumblebot/app": 7,
}


def _room(rel: str) -> str | None:
    """The room of a file (``bumblebot/runtime/turn.py`` → ``bumblebot/runtime``) or of a
    module (``bumblebot.runtime.turn`` → the same); ``None`` for the ground."""
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
        if rel not in ("bumblebot/runtime/conversation.py", "bumblebot/store/store.py") and pattern.search(path.read_text()):
            offenders.append(rel)
    assert offenders == []


def test_architecture_doc_names_existing_files():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in sorted((ROOT / "bumblebot").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        assert rel in doc, f"docs/architecture.md does not mention {rel}"
