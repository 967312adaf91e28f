"""Project rules that keep the code and the docs honest."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from bumblebot.config import Settings

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


def test_layering():
    """Platform SDKs stay in their adapter; openai only in llm.py and speech.py; the engine never imports
    adapters/ or tools/ (bumblebot/cli.py wires them)."""
    problems = []
    for path in sorted((ROOT / "bumblebot").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py")) + sorted(
        (ROOT / "tools").rglob("*.py")
    ):
        rel = path.relative_to(ROOT).as_posix()
        used = _imports(path)
        if "telegram" in used and not rel.startswith("adapters/telegram/"):
            problems.append(f"{rel} imports telegram")
        if "discord" in used and not rel.startswith("adapters/discord/"):
            problems.append(f"{rel} imports discord")
        if "openai" in used and rel not in ("bumblebot/llm.py", "bumblebot/speech.py"):
            problems.append(f"{rel} imports openai")
        if rel.startswith("bumblebot/") and rel not in WIRING and used & {"adapters", "tools"}:
            problems.append(f"{rel} imports {sorted(used & {'adapters', 'tools'})}")
    assert problems == []


#: the composition root and the command line: the only modules that wire adapters and tools
WIRING = frozenset({"bumblebot/cli.py", "bumblebot/daemon.py"})


def _module_imports(path: Path) -> set[str]:
    """Every ``bumblebot.*`` module ``path`` imports, at any depth (``TYPE_CHECKING`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bumblebot"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("bumblebot")}
    modules = {f"bumblebot.{p.stem}" for p in (ROOT / "bumblebot").glob("*.py")}
    return found & modules


def test_the_engine_has_no_import_cycle():
    """Imports inside ``bumblebot/`` form no cycle, not even behind ``TYPE_CHECKING``."""
    graph = {
        f"bumblebot.{p.stem}": _module_imports(p) - {f"bumblebot.{p.stem}"}
        for p in (ROOT / "bumblebot").glob("*.py")
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
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
    """Adapters see the engine only as ``bumblebot.adapter.Intake``; no part reaches back into
    ``Engine`` (no service locator)."""
    users = []
    for path in [*(ROOT / "bumblebot").rglob("*.py"), *(ROOT / "adapters").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel not in WIRING and "bumblebot.engine" in _module_imports(path):
            users.append(rel)
    assert users == []


#: Store methods that write a conversation's history, compaction state or turns.
CONVERSATION_WRITERS = (
    "begin_turn", "record", "speak", "finish_turn", "save_compaction", "mark_pruned", "reset",
)


def test_conversation_state_has_one_writer():
    """Only ``bumblebot/conversation.py`` (Session, Turn, Conversation) calls the store's
    history, compaction and turn writers."""
    import re

    pattern = re.compile(r"store\.(" + "|".join(CONVERSATION_WRITERS) + r")\(")
    offenders = []
    for path in [*(ROOT / "bumblebot").rglob("*.py"), *(ROOT / "adapters").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel not in ("bumblebot/conversation.py", "bumblebot/store.py") and pattern.search(path.read_text()):
            offenders.append(rel)
    assert offenders == []


def test_architecture_doc_names_existing_files():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in sorted((ROOT / "bumblebot").glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        assert path.name in doc, f"docs/architecture.md does not mention {path.name}"
