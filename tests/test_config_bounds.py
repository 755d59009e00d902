"""Values that passed `check-config` and then failed `serve` (or every call), found by fuzzing the
config: integers past TOML's 64 bits, share weights whose split overflowed, a per-tenant window
of 4e9 samples, Redis URLs redis-py could not read, 1-byte stream messages, a message limit the
project's own clients exceed, and binds that collide under another spelling. Each is refused with
one line naming the key (no traceback), or warned about where the service can run with it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.client.sync_client import KvstoreClient
from kvstore.config import load_config, parse_config
from kvstore.config.warnings import CLIENT_MESSAGE_BYTES, PIECE_HEADER_BYTES, config_warnings
from kvstore.layout import get_model
from kvstore.local_pool.reload import ConfigReloader
from kvstore.v1 import kvstore_pb2 as pb
from tests.fixtures.service import DENSE, base_table

TOKEN_A, TOKEN_B = "tenant-token-aaaa", "tenant-token-bbbb"
TWO_TENANTS = f'[tenants.a]\ntokens = ["{TOKEN_A}"]\nshare_weight = 1000\n[tenants.b]\ntokens = ["{TOKEN_B}"]\n'


def _check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "c.toml"
    path.write_text(text)
    rc = main(["check-config", str(path)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("text", "key"), [
    # 1a: float(10**400) overflowed in the coercion (a traceback).
    ("[local_pool.ttl]\nttl_seconds = 1" + "0" * 400 + "\n", "local_pool.ttl.ttl_seconds"),
    # 2: passed, then the arena's torch.empty overflowed (a C++ traceback at serve).
    ("[store]\ndevice_capacity_bytes = 18446744073709551616\n", "store.device_capacity_bytes"),
    ("[store]\ndram_capacity_bytes = 18446744073709551616\n", "store.dram_capacity_bytes"),
    ("[store]\ndram_capacity_bytes = 9223372036854775807\n", "store.dram_capacity_bytes"),
    ("[store]\nlmdb_capacity_bytes = 1125899906842625\n", "store.lmdb_capacity_bytes"),
    ("[local_pool]\ncapacity_bytes = 18446744073709551616\n", "local_pool.capacity_bytes"),
    ("[local_pool]\npart_bytes = 1073741824\n", "local_pool.part_bytes"),
    # 3: every StoreLocal then failed INTERNAL (np.zeros of 4e9 float64s per tenant).
    ('[local_pool.ttl]\nkind = "adaptive"\nadaptive_window_samples = 4000000000\n',
     "local_pool.ttl.adaptive_window_samples"),
    # 4: every replay then failed (torch's manual_seed overflowed).
    ("[replay]\nreference_seed = 18446744073709551616\n", "replay.reference_seed"),
    # 5: serve crashed in redis-py's parse_url; the path read as database 0; a cluster took a database.
    ('[local_pool]\nurl = "redis://127.0.0.1:1?db=abc"\n', "local_pool.url"),
    ('[local_pool]\nurl = "redis://h:6391/abc"\n', "local_pool.url"),
    ('[local_pool]\nurl = "redis+cluster://h:1/3"\n', "local_pool.url"),
    ('[local_pool]\nurl = "rediss://h:1?ssl_min_version=abc"\n', "local_pool.url"),
    # No connection to Redis at all (every pool call would wait out its deadline), or more than it takes.
    ("[local_pool]\nmax_connections = 0\n", "local_pool.max_connections"),
    ("[local_pool]\nmax_connections = 10001\n", "local_pool.max_connections"),
    # 7: every Load of a V4.1 chunk then timed out.
    ("[service]\nstream_message_bytes = 1\n", "service.stream_message_bytes"),
    # 1c: least_total's ceil(inf) overflowed (a traceback); 1e-300 asked for a 300-digit total.
    (TWO_TENANTS + "share_weight = 5e-324\n", "tenants.b.share_weight"),
    (TWO_TENANTS + "share_weight = 1e-300\n", "tenants.b.share_weight"),
    # An empty data_dir put LMDB's files in the start directory (`serve --data-dir ''` is refused).
    ('data_dir = ""\n', "data_dir"),
    # Passed check-config, then the second bind failed at serve: one address, two spellings.
    ('[service]\ngrpc_host = "::1"\ngrpc_port = 45999\n[admin]\nhost = "0:0:0:0:0:0:0:1"\nport = 45999\n',
     "admin.port"),
    ('[service]\ngrpc_host = "127.1"\ngrpc_port = 45999\n[admin]\nhost = "127.0.0.1"\nport = 45999\n',
     "admin.port"),
], ids=["ttl-400-digits", "device-2**64", "dram-2**64", "dram-2**63", "lmdb-over-1PiB", "pool-2**64",
        "part-1GiB", "window-4e9", "seed-2**64", "redis-db-abc", "redis-path-abc", "cluster-path-db",
        "ssl-min-version-abc", "pool-connections-0", "pool-connections-10001",
        "stream-1-byte", "weight-5e-324", "weight-1e-300", "data-dir-empty",
        "ipv6-spellings", "ipv4-short-form"])
def test_a_value_serve_cannot_use_is_one_line_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             text: str, key: str) -> None:
    rc, err = _check(tmp_path, text, capsys)
    assert rc == 2 and err.count("\n") == 1 and f"config key '{key}'" in err, err
    assert "Traceback" not in err and len(err) < 400, err  # no 300-digit number either


def test_an_integer_of_thousands_of_digits_is_a_file_error_naming_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # tomllib's int() refused it with a ValueError that load_config did not catch (a traceback).
    rc, err = _check(tmp_path, "[store]\n\ndram_capacity_bytes = " + "1" * 5000 + "\n", capsys)
    assert rc == 2 and err.count("\n") == 1 and "line 3" in err and "64-bit" in err, err


def test_the_bounds_keep_the_values_that_work() -> None:
    top = (1 << 63) - 1
    cfg = parse_config({"replay": {"reference_seed": top}, "store": {"dram_capacity_bytes": 1 << 50},
                        "local_pool": {"url": "redis://h:6379/3", "part_bytes": 512 << 20,
                                       "ttl": {"kind": "adaptive", "adaptive_window_samples": 1_000_000}},
                        "service": {"stream_message_bytes": 4096},
                        "tenants": {"a": {"tokens": [TOKEN_A], "share_weight": 1e-6},
                                    "b": {"tokens": [TOKEN_B], "share_weight": 1e-6}}})
    assert cfg.replay.reference_seed == top and cfg.tenants["a"].share_weight == 1e-6
    assert parse_config({"local_pool": {"max_connections": 10_000}}).local_pool.max_connections == 10_000
    assert parse_config({"replay": {"reference_seed": -(1 << 63)}}).replay.reference_seed == -(1 << 63)
    for url in ("redis://h:6379?db=2", "unix:///tmp/redis.sock?db=1", "redis+cluster://h:1,h:2/",
                "rediss://h:1?ssl_min_version=771&ssl_cert_reqs=none"):
        assert parse_config({"local_pool": {"url": url}}).local_pool.url == url
    # One address, one port, bound once: refused only where the two spellings are one address.
    parse_config({"service": {"grpc_host": "127.0.0.2", "grpc_port": 45999}, "admin": {"host": "127.1", "port": 45999}})


def test_a_database_given_twice_is_refused() -> None:
    # redis-py took ?db= and dropped the path's without a word.
    with pytest.raises(ValueError, match="database twice"):
        parse_config({"local_pool": {"url": "redis://h:6379/2?db=3"}})


def test_a_reload_applies_the_same_bounds(tmp_path: Path) -> None:
    # SIGHUP re-reads the file: a window of 4e9 would be built for the next tenant's first write,
    # and a 5000-digit number raised out of the reloader's thread.
    path = tmp_path / "kvstore.toml"
    path.write_text('[local_pool.ttl]\nkind = "adaptive"\n')
    seen: list[object] = []
    reloader = ConfigReloader(path, seen.append, current=load_config(path), poll_seconds=60)
    for bad in ("adaptive_window_samples = 4000000000\n", "adaptive_window_samples = " + "9" * 5000 + "\n"):
        path.write_text('[local_pool.ttl]\nkind = "adaptive"\n' + bad)
        assert reloader.reload_now() is False and seen == []
    path.write_text('[local_pool.ttl]\nkind = "adaptive"\nadaptive_window_samples = 2048\n')
    assert reloader.reload_now() is True and len(seen) == 1


def test_the_clients_default_message_is_the_one_the_warning_names() -> None:
    assert inspect.signature(KvstoreClient).parameters["message_bytes"].default == CLIENT_MESSAGE_BYTES
    mib = CLIENT_MESSAGE_BYTES
    for piece in (pb.StoreRequest(chunks=pb.ChunkPiece(first_chunk=2**32 - 1, offset=2**64 - 1, data=b"x" * mib,
                                                       tiers=[1, 2, 3])),
                  pb.StoreLocalRequest(local=pb.LocalPiece(offset=2**64 - 1, data=b"x" * mib))):
        assert piece.ByteSize() <= mib + PIECE_HEADER_BYTES


def test_a_message_limit_under_the_clients_default_is_warned_about(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # 256 KiB refused KvstoreClient's and the vLLM connector's 1 MiB messages ("Received message
    # larger than max (1048584 vs. 528384)"). A warning, not a refusal: tests and tuned deployments
    # run small limits with clients given a smaller message_bytes.
    rc, err = _check(tmp_path, "[service]\nmax_message_bytes = 262144\nstream_message_bytes = 65536\n", capsys)
    assert rc == 0 and "warning: service.max_message_bytes = 262144" in err and "message_bytes <= 262080" in err, err
    enough = parse_config({"service": {"max_message_bytes": CLIENT_MESSAGE_BYTES + PIECE_HEADER_BYTES,
                                       "stream_message_bytes": 65536}})
    assert not [w for w in config_warnings(enough) if "max_message_bytes" in w]


def test_a_tier_that_holds_no_chunk_or_a_model_no_tier_holds_is_warned_about() -> None:
    # The dense model's 2 MiB chunk (at 16 tokens) fits neither a 64 KiB device tier, a 128 KiB DRAM
    # one nor a 1 MiB LMDB: every Store of it was refused (no room) without a word at start.
    chunk = get_model(DENSE).layout.with_chunk_tokens(16).chunk_bytes
    table = base_table(store={"chunk_tokens": 16, "lmdb_capacity_bytes": 1 << 20}, service={"models": [DENSE]})
    said = [w for w in config_warnings(parse_config(table)) if "store." in w or "no tier" in w]
    assert len(said) == 3, said
    assert said[0].startswith("store.device_capacity_bytes = 65536 is less than one chunk of any served model")
    assert said[1].startswith("store.dram_capacity_bytes = 131072 is less than one chunk of any served model")
    assert said[2] == f"no tier can hold one chunk of '{DENSE}' ({chunk} bytes): every Store of it is refused " \
                      "(no room); raise a tier's capacity_bytes above that"
    # A tier too small for one model's chunks but not another's is how tiers are shared.
    for fine in (base_table(store={"chunk_tokens": 16}),
                 base_table(store={"chunk_tokens": 16, "device_capacity_bytes": 0, "dram_capacity_bytes": 0}),
                 base_table(store={"chunk_tokens": 16, "quantize_device": "fp4", "quantize_dram": "fp8"})):
        assert not [w for w in config_warnings(parse_config(fine)) if "store." in w or "no tier" in w]
    assert not [w for w in config_warnings(parse_config({})) if "store." in w or "no tier" in w]  # the defaults
