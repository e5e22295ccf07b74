"""Snapshot file: the index's per-pod mappings plus the last applied seq.

Format: msgpack ``{"version": 1, "block_size", "hash_seed", "default_model",
"pods": {name: [last_seq, [[engine_hash, request_key, tier_bits], ...]]}}``,
written to a temporary file and renamed, so a crash never leaves half a
file. Holders are rebuilt from the mappings on load, then each pod resumes
with a replay from ``last_seq + 1``. A snapshot written with another block
size, seed or default model is ignored (its keys would not match).

Limitation: if a pod restarted *and* published more batches than the
snapshot's seq while the indexer was down, the restart is not detected and
the stale blocks stay until vLLM removes or clears them.

Threading model: plain functions; the caller provides a consistent view.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from kvtier.ids import EngineBlockHash, PodId, RequestKey
from kvtier.indexer.config import IndexerConfig
from kvtier.indexer.index import TIER_BIT, TIERS_BY_BIT, MappingEntry

log = logging.getLogger(__name__)
VERSION = 1


def write_snapshot(path: str | Path, cfg: IndexerConfig,
                   pods: dict[PodId, tuple[int, list[MappingEntry]]]) -> None:
    doc = {
        "version": VERSION, "block_size": cfg.block_size, "hash_seed": cfg.hash_seed,
        "default_model": cfg.default_model,
        "pods": {
            name: [seq, [[int(e.engine_hash), int(e.key), sum(TIER_BIT[t] for t in e.tiers)]
                         for e in entries]]
            for name, (seq, entries) in pods.items()
        },
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(doc))
    os.replace(tmp, p)


def load_snapshot(path: str | Path, cfg: IndexerConfig
                  ) -> dict[PodId, tuple[int, list[MappingEntry]]] | None:
    p = Path(path)
    if not p.exists():
        return None
    try:
        doc = msgspec.msgpack.decode(p.read_bytes())
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}")
        same = (doc["block_size"], doc["hash_seed"], doc["default_model"]) == \
            (cfg.block_size, cfg.hash_seed, cfg.default_model)
        if not same:
            log.warning("snapshot %s was written with other key settings; ignored", p)
            return None
        out: dict[PodId, tuple[int, list[MappingEntry]]] = {}
        for name, (seq, rows) in doc["pods"].items():
            out[PodId(name)] = (int(seq), [
                MappingEntry(EngineBlockHash(eh), RequestKey(rk),
                             frozenset(t for tb, t in TIERS_BY_BIT if bits & tb))
                for eh, rk, bits in rows])
        return out
    except Exception as e:  # noqa: BLE001 - a corrupt snapshot must not stop the daemon
        log.error("snapshot %s unreadable (%s); starting empty", p, e)
        return None
