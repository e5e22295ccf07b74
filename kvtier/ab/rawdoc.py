"""A run's raw document on disk: ``report.json.gz``, every record of an A/B run.

``kvtier ab`` writes each run's records, summaries and verdicts (``kvtier.ab.report``) as
formatted JSON, gzip-compressed: a live run's turns come to 2-3 MB of JSON, about a tenth of
that compressed, and the committed runs under ``benchmarks/ab/`` travel with the working tree
to the lent GPU, whose carry limit counts every tracked byte. Read it with
``zcat report.json.gz | jq``, or ``read_raw``. A run written before the switch keeps a plain
``report.json``; ``read_raw`` reads either, and ``write_raw`` replaces it with the
compressed form.

The compressed bytes are deterministic for one zlib (no name, mtime 0); whether a document
changed is decided on the JSON, so a different zlib elsewhere never counts as a change.

Threading model: plain functions on files.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import msgspec

RAW_NAME = "report.json.gz"
LEGACY_NAME = "report.json"


def raw_path(run_dir: Path | str) -> Path:
    """The run's raw document: the compressed one, else a plain one written before the
    switch, else where the compressed one goes."""
    d = Path(run_dir)
    gz, plain = d / RAW_NAME, d / LEGACY_NAME
    return plain if plain.exists() and not gz.exists() else gz


def has_raw(run_dir: Path | str) -> bool:
    return raw_path(run_dir).exists()


def raw_json(run_dir: Path | str) -> bytes:
    """The raw document's JSON bytes (decompressed); FileNotFoundError naming both names."""
    p = raw_path(run_dir)
    if not p.exists():
        raise FileNotFoundError(f"{Path(run_dir)}: no {RAW_NAME} (or {LEGACY_NAME}): "
                                "not the --out directory of a kvtier ab run")
    data = p.read_bytes()
    return gzip.decompress(data) if p.name == RAW_NAME else data


def read_raw(run_dir: Path | str) -> dict[str, Any]:
    doc = json.loads(raw_json(run_dir))
    if not isinstance(doc, dict):
        raise ValueError(f"{raw_path(run_dir)}: not a kvtier ab report (a JSON object)")
    return doc


def encode(doc: dict[str, Any]) -> bytes:
    """The formatted JSON a run's document is stored as."""
    return msgspec.json.format(msgspec.json.encode(doc))


def write_raw(run_dir: Path | str, doc: dict[str, Any]) -> bool:
    """Store ``doc`` as the run's ``report.json.gz`` (removing a plain ``report.json``);
    True when the stored JSON changed (a missing file, other JSON, or the plain form)."""
    d = Path(run_dir)
    data = encode(doc)
    gz, plain = d / RAW_NAME, d / LEGACY_NAME
    if gz.exists() and not plain.exists() and gzip.decompress(gz.read_bytes()) == data:
        return False
    d.mkdir(parents=True, exist_ok=True)
    tmp = gz.with_name(gz.name + ".tmp")
    tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    tmp.replace(gz)
    plain.unlink(missing_ok=True)
    return True
