"""The ready-made files in the repository's ``configs/`` folder, by name.

The local stack, the A/B strategies and the tests build vLLM ``--kv-transfer-config``
values from these files rather than from literals, so what is tested is what ships.

Threading model: pure functions (each call reads the file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"


def load_config_file(name: str) -> dict[str, Any]:
    """Read a JSON file from ``configs/`` (name with or without .json)."""
    path = CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise FileNotFoundError(f"no config {path.name} in {CONFIG_DIR}; known: {known}")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc
