"""A data dir written by an earlier version still opens, and every chunk it holds is hit and loads
byte for byte.

`tests/fixtures/datadir_0_1/` was written by kvstore 0.1.0 (commit 863d653) with
`tests/fixtures/make_old_data_dir.py`: the LMDB tier as the service lays it out in its data dir
(`lmdb/data.mdb`), and `manifest.json` with the config it was written with and, per prompt, its
model, tenant, token ids, the number of chunks stored and each chunk payload's sha256. Chunk keys
(the namespace digest, the layout id, the key chain over the token ids), the value format and the
codecs (raw and zstd values are both in it) must all stay readable for these tests to pass.
Regenerating the fixture with new code proves nothing about old data: add a new fixture instead.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.service import Service, make_config

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "datadir_0_1"
MANIFEST: dict[str, Any] = json.loads((FIXTURE / "manifest.json").read_text())
PROMPTS: list[dict[str, Any]] = MANIFEST["prompts"]
TIERS = ("device", "dram", "lmdb")


@pytest.fixture
def old_service(tmp_path: Path, make_service: Callable[..., Service]) -> Service:
    """The service over a copy of the fixture (opening it may write: the fixture stays as it is),
    with the store settings the data dir was written with."""
    data_dir = tmp_path / "data"
    shutil.copytree(FIXTURE, data_dir, ignore=shutil.ignore_patterns("manifest.json"))
    cfg = MANIFEST["config"]
    return make_service(make_config(store=cfg["store"], service={"models": cfg["service"]["models"]}), data_dir)


def test_fixture_files_are_as_written() -> None:
    """The fixture itself is untouched (else a failure below would say nothing about the code)."""
    for rel, want in MANIFEST["files"].items():
        data = (FIXTURE / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (want["bytes"], want["sha256"]), rel
    assert {p.relative_to(FIXTURE).as_posix() for p in FIXTURE.rglob("*") if p.is_file()} == {
        *MANIFEST["files"], "manifest.json"}


def test_old_data_dir_opens_with_every_chunk_hit_from_lmdb(old_service: Service) -> None:
    kv = old_service.client(message_bytes=MANIFEST["config"]["service"]["stream_message_bytes"])
    stats = kv.stats()
    assert stats.tiers["lmdb"].entries == MANIFEST["lmdb_entries"]
    assert stats.corrupt_reads == 0

    # Lookups first: after a restart nothing was loaded yet, so every hit is on the LMDB tier.
    for p in PROMPTS:
        assert stats.tenant == p["tenant"]
        hit = kv.lookup(p["model"], p["tokens"])
        n = p["stored_chunks"]
        assert len(p["tokens"]) == p["num_tokens"]
        assert (hit.full_chunks, hit.remainder_tokens, hit.chunk_bytes) == (
            p["full_chunks"], p["remainder_tokens"], p["chunk_bytes"]), p["name"]
        assert hit.hit_chunks == n, f"{p['name']}: {hit.hit_chunks} of {n} stored chunks hit"
        assert hit.hit_tokens == n * hit.chunk_tokens, p["name"]
        assert hit.chunk_tiers == ("lmdb",) * n, p["name"]

    # Loads: each payload byte for byte; a chunk no earlier load touched comes from LMDB (a loaded
    # chunk may have been promoted, and prompts share chunks).
    loaded: set[tuple[str, str]] = set()
    for p in PROMPTS:
        got = kv.load(p["model"], p["tokens"])
        assert len(got.chunks) == p["stored_chunks"], p["name"]
        assert [hashlib.sha256(c).hexdigest() for c in got.chunks] == p["chunk_sha256"], p["name"]
        for sha, tier in zip(p["chunk_sha256"], got.chunk_tiers, strict=True):
            expected = TIERS if (p["model"], sha) in loaded else ("lmdb",)
            assert tier in expected, f"{p['name']}: a chunk came from {tier!r}"
            loaded.add((p["model"], sha))

    after = kv.stats()
    assert after.corrupt_reads == 0
    assert after.token_mismatches == 0
    assert after.tiers["lmdb"].entries == MANIFEST["lmdb_entries"]


def test_the_old_data_dir_is_migrated_once_and_then_opens_from_its_index(tmp_path: Path) -> None:
    """Format 1 had no index records: the first open builds them from the values (saying so), later
    opens read only them, and every chunk still loads byte for byte."""
    from kvstore.layout import get_model
    from kvstore.store import GlobalStore

    data_dir = tmp_path / "data"
    shutil.copytree(FIXTURE, data_dir, ignore=shutil.ignore_patterns("manifest.json"))
    cfg = make_config(store=MANIFEST["config"]["store"])
    models = [get_model(m) for m in MANIFEST["config"]["service"]["models"]]
    for opening in ("first", "second"):
        lines: list[str] = []
        store = GlobalStore(cfg.store, data_dir, models, progress=lines.append)
        loading = [line for line in lines if line.startswith("index: ")]  # the index load, said at every start
        assert loading[0] == f"index: loading {MANIFEST['lmdb_entries']:,} LMDB chunks before listening"
        assert loading[-1].startswith(f"index: {MANIFEST['lmdb_entries']:,} LMDB chunks ready in ")
        # The migration's lines, not the arenas' (another thread's) or the load's.
        lines = [line for line in lines if "LMDB" in line and not line.startswith("index: ")]
        if opening == "first":
            assert lines[0].startswith(f"migrating LMDB data to format 2: indexing {MANIFEST['lmdb_entries']}")
            assert lines[-1] == f"LMDB index built: {MANIFEST['lmdb_entries']} values indexed, 0 unreadable left out"
        else:
            assert lines == []
        assert store.stats().ignored_on_open == {}
        for p in PROMPTS:
            ns = store.namespace(p["tenant"], p["model"], "bounded")
            tokens = store.tokens(ns, p["tokens"])
            with store.load(ns, tokens) as s:
                got = [hashlib.sha256(c.payload).hexdigest() for c in s]
            assert got == p["chunk_sha256"], p["name"]
        assert store.stats().corrupt_reads == 0
        store.close()
