"""A data dir restored from a copy of its LMDB. kvstore keeps LMDB in DATA_DIR/lmdb; a copy taken
as `mdb_copy DATA_DIR/lmdb BACKUP` holds `data.mdb` at its top, and a service started on BACKUP made
a new empty LMDB beside it and served nothing, with no word. Now that start is refused, naming where
the file belongs; moved there, the copy serves its chunks. The copy is LMDB's own (py-lmdb's
`Environment.copy`, what `mdb_copy` runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import ConfigError
from tests.fixtures.service import CHUNK, TOY, make_config, payloads, start_service, tokens


def test_a_bare_lmdb_copy_is_refused_naming_where_it_belongs_and_serves_once_moved(tmp_path: Path) -> None:
    prompt, chunks = tokens(81, 4 * CHUNK), payloads(81, 4, 1272)
    svc = start_service(make_config(), tmp_path / "data")
    try:
        assert svc.client().store(TOY, prompt, chunks).durable
    finally:
        svc.stop(0.5)
    backup = tmp_path / "backup"
    backup.mkdir()
    env = lmdb.open(str(tmp_path / "data" / "lmdb"), readonly=True, lock=False, max_dbs=8)
    try:
        env.copy(str(backup))  # as `mdb_copy DATA_DIR/lmdb BACKUP`
    finally:
        env.close()

    with pytest.raises(ConfigError) as e:
        start_service(make_config(), backup)
    assert e.value.key == "data_dir" and str(backup / "lmdb") in str(e.value), e.value
    assert not (backup / "lmdb").exists()  # nothing made beside the copy
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--grpc-port", "0", "--admin-port", "-1",
                          "--data-dir", str(backup)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "holds an LMDB data file" in out.stderr, out

    (backup / "lmdb").mkdir()
    (backup / "data.mdb").rename(backup / "lmdb" / "data.mdb")  # as the refusal says
    svc = start_service(make_config(), backup)
    try:
        got = svc.client().load(TOY, prompt)
        assert [bytes(c) for c in got.chunks] == chunks
    finally:
        svc.stop(0.5)
