"""Every module path and module name that README.md and docs/*.md mention exists.

Checks, in README.md and docs/*.md (benchmarks/*.md are dated history and may name old paths):

- repository paths (``kvtier/tier/spec.py``, ``router/``, ``configs/kvtier-peer.json``,
  ``tests/unit/test_checks.py``, ...): the file or folder exists;
- dotted module names (``kvtier.cost.decide``, ``kvtier.router.client.Conversation``): the
  longest module prefix is a file or package of the installed layout (``kvtier.connectors`` ->
  ``connectors/``, ``kvtier.indexer`` -> ``indexer/``, ``kvtier.router`` -> ``router/``), and a
  name after it is defined in that module;
- "`path.py` `name`" pairs (``kvtier/cost/decide.py` `decide```): the name is defined there;
- the README's layout block names every module of every room of kvtier/ (and no module that
  is not there).

Used by tests/unit/test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOTS = ("kvtier/", "connectors/", "indexer/", "router/", "configs/", "tests/", "benchmarks/",
         "docs/")
INSTALLED = {"kvtier.connectors": "connectors", "kvtier.indexer": "indexer",
             "kvtier.router": "router"}
_ROOTS_RE = "|".join(re.escape(r) for r in ROOTS)
PATH_RE = re.compile(r"(?<![\w./-])((?:" + _ROOTS_RE + r")[\w./*-]*)")
MOD_RE = re.compile(r"(?<![\w./\"-])(kvtier(?:\.\w+)+)")
PAIR_RE = re.compile(r"`([\w/]+\.py)`\s+`(\w+)(?:\.\w+)?(?:\(\))?`")


def module_file(repo: Path, dotted: str) -> Path | None:
    for prefix, folder in INSTALLED.items():
        if dotted == prefix or dotted.startswith(prefix + "."):
            rel = folder + dotted[len(prefix):].replace(".", "/")
            break
    else:
        rel = dotted.replace(".", "/")
    for cand in (repo / (rel + ".py"), repo / rel / "__init__.py"):
        if cand.is_file():
            return cand
    if (repo / rel).is_dir():  # a namespace-less folder (e.g. indexer/native)
        return repo / rel
    return None


def defines(path: Path, name: str) -> bool:
    if path.is_dir():
        return (path / f"{name}.py").exists() or (path / name).is_dir()
    text = path.read_text(encoding="utf-8", errors="replace")
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]"
                     rf"|^\s*from\s+\S+\s+import\s+.*\b{name}\b", text, re.M) is not None


def check_text(repo: Path, doc: Path, text: str) -> list[str]:
    bad: list[str] = []
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".,;:)")
        if "*" in p or "DATE" in p or p.endswith("/results/"):
            continue
        if not (repo / p).exists():
            bad.append(f"{doc.name}: path {p} does not exist")
    for m in MOD_RE.finditer(text):
        parts = m.group(1).rstrip(".").split(".")
        for n in range(len(parts), 1, -1):
            f = module_file(repo, ".".join(parts[:n]))
            if f is not None:
                if n < len(parts) and not defines(f, parts[n]):
                    bad.append(f"{doc.name}: {'.'.join(parts)}: {parts[n]} not defined in "
                               f"{f.relative_to(repo)}")
                break
        else:
            bad.append(f"{doc.name}: module {'.'.join(parts)} does not exist")
    for m in PAIR_RE.finditer(text):
        f = repo / m.group(1)
        if f.is_file() and not defines(f, m.group(2)):
            bad.append(f"{doc.name}: {m.group(2)} not defined in {m.group(1)}")
    return bad


def check_layout(repo: Path, readme: str) -> list[str]:
    """Every kvtier/ module is named in the README's layout block, a top-level one as
    ``name.py``, a room's by its stem within that room's lines; nothing named is missing."""
    start = readme.index("## Layout")
    block = readme[readme.index("```", start) + 3:]
    block = block[:block.index("```")]
    rooms: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    current = None
    for line in block.splitlines():
        m = re.match(r"^( +)(\w+)/\s", line)
        if m and line.startswith("  "):
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            current = "/".join(n for _, n in stack)
            rooms[current] = line[m.end():]
        elif line[:1].strip():  # a top-level folder: the kvtier/ block is over
            stack, current = [], None
        elif current is not None and not re.match(r"^  \w+\.py", line):
            rooms[current] += " " + line
        else:
            stack, current = [], None
    bad = []
    kv = repo / "kvtier"
    for f in sorted(kv.rglob("*.py")):
        rel = f.relative_to(kv)
        if f.name == "__init__.py" or "native" in rel.parts:
            continue
        room = "/".join(rel.parts[:-1])
        if not room:
            if not re.search(rf"^  {re.escape(f.name)}\b", block, re.M):
                bad.append(f"README layout: kvtier/{rel} is not named")
        elif room not in rooms:
            bad.append(f"README layout: room kvtier/{room}/ is not named")
        elif not re.search(rf"\b{f.stem}\b", rooms[room]):
            bad.append(f"README layout: kvtier/{rel} is not named in its room's lines")
    for m in re.finditer(r"^  (\w+\.py)\b", block, re.M):
        if not (kv / m.group(1)).exists():
            bad.append(f"README layout: kvtier/{m.group(1)} does not exist")
    for top in ("indexer", "router"):  # the folders installed under kvtier.*: every module
        m = re.search(rf"^{top}/.*?(?=^\S)", block, re.M | re.S)
        lines = m.group(0) if m else ""
        for f in sorted((repo / top).glob("*.py")):
            if f.name != "__init__.py" and not re.search(rf"\b{f.stem}\b", lines):
                bad.append(f"README layout: {top}/{f.name} is not named")
    for room in rooms:
        if not (kv / room).is_dir():
            bad.append(f"README layout: kvtier/{room}/ does not exist")
    return bad


def problems(repo: Path) -> list[str]:
    """Every problem in README.md and docs/*.md of ``repo``, one line each."""
    docs = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    bad: list[str] = []
    for d in docs:
        bad += check_text(repo, d, d.read_text(encoding="utf-8"))
    bad += check_layout(repo, (repo / "README.md").read_text(encoding="utf-8"))
    return bad
