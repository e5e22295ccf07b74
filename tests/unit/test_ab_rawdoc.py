"""A run's raw document (kvtier.ab.rawdoc): stored gzip-compressed, read in either form, and
rewritten only when its JSON changes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtier.ab.rawdoc import LEGACY_NAME, RAW_NAME, encode, has_raw, raw_path, read_raw, write_raw

DOC = {"meta": {"command": "kvtier ab --repeats 5"}, "results": [{"strategy": "recompute"}]}


def test_written_compressed_and_read_back(tmp_path: Path) -> None:
    assert write_raw(tmp_path, DOC)
    assert raw_path(tmp_path) == tmp_path / RAW_NAME and has_raw(tmp_path)
    assert gzip.decompress((tmp_path / RAW_NAME).read_bytes()) == encode(DOC)
    assert read_raw(tmp_path) == DOC
    assert not (tmp_path / LEGACY_NAME).exists()


def test_the_same_json_is_not_rewritten(tmp_path: Path) -> None:
    write_raw(tmp_path, DOC)
    before = (tmp_path / RAW_NAME).stat().st_mtime_ns
    assert not write_raw(tmp_path, json.loads(json.dumps(DOC)))
    assert (tmp_path / RAW_NAME).stat().st_mtime_ns == before
    assert write_raw(tmp_path, {**DOC, "summary": []})


def test_a_plain_report_json_is_read_and_replaced(tmp_path: Path) -> None:
    (tmp_path / LEGACY_NAME).write_bytes(encode(DOC))
    assert raw_path(tmp_path) == tmp_path / LEGACY_NAME and read_raw(tmp_path) == DOC
    assert write_raw(tmp_path, DOC)  # the same JSON, but the plain form goes
    assert not (tmp_path / LEGACY_NAME).exists() and read_raw(tmp_path) == DOC


def test_the_bytes_do_not_depend_on_the_time(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_raw(a, DOC)
    write_raw(b, DOC)
    assert (a / RAW_NAME).read_bytes() == (b / RAW_NAME).read_bytes()


def test_a_directory_without_a_report_says_so(tmp_path: Path) -> None:
    assert not has_raw(tmp_path)
    with pytest.raises(FileNotFoundError, match="report.json.gz"):
        read_raw(tmp_path)
