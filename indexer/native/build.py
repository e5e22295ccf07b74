"""Build the indexer's C helper from source into this interpreter's site-packages.

    python -m kvtier.indexer.native.build [--strict] [--if-stale] [--out DIR]

Needs a C compiler (``cc``) and ``xxhash.h`` (Debian: ``libxxhash-dev``); the
hash is inlined from the header, so nothing but the built module is needed at
run time. Without them it says why and exits 0 (the indexer then runs its
pure-Python path, same answers); ``--strict`` makes that exit 1.

Threading model: a command; runs the compiler once.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in ("kvtier_native.c", "index_ops.c", "decode.c")]
HEADER = HERE / "kvtier_native.h"
NAME = "_kvtier_indexer_native"


def build(out_dir: Path, force: bool = True) -> Path:
    """Compile and return the module's path; RuntimeError saying why not. ``force=False``:
    keep a module newer than its source."""
    cc = shutil.which(sysconfig.get_config_var("CC") or "cc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{NAME}{suffix}"
    newest = max(p.stat().st_mtime for p in [*SOURCES, HEADER])
    if not force and target.exists() and target.stat().st_mtime >= newest:
        return target
    tmp = target.with_name(target.name + ".tmp")
    cmd = [cc, "-O3", "-shared", "-fPIC", "-std=c11", f"-I{sysconfig.get_paths()['include']}",
           *map(str, SOURCES), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()}")
    tmp.replace(target)  # atomic: a running process keeps its mapped copy
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(sysconfig.get_paths()["platlib"]),
                    help="where to put the module (default: this interpreter's site-packages)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if it cannot be built")
    ap.add_argument("--if-stale", action="store_true",
                    help="do nothing if the built module is newer than its source")
    args = ap.parse_args(argv)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    old = args.out / f"{NAME}{suffix}"
    before = old.stat().st_mtime_ns if old.exists() else None
    try:
        path = build(args.out, force=not args.if_stale)
    except RuntimeError as e:
        print(f"kvtier indexer native helper not built ({e}); the pure-Python path is used",
              file=sys.stderr)
        return 1 if args.strict else 0
    fresh = before is None or path.stat().st_mtime_ns != before
    print(f"{'built' if fresh else 'up to date:'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
