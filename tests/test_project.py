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
    """Platform SDKs stay in their adapter; openai only in llm.py; the engine never imports
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
        if "openai" in used and rel != "bumblebot/llm.py":
            problems.append(f"{rel} imports openai")
        if rel.startswith("bumblebot/") and rel != "bumblebot/cli.py" and used & {"adapters", "tools"}:
            problems.append(f"{rel} imports {sorted(used & {'adapters', 'tools'})}")
    assert problems == []


def test_architecture_doc_names_existing_files():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in sorted((ROOT / "bumblebot").glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        assert path.name in doc, f"docs/architecture.md does not mention {path.name}"
