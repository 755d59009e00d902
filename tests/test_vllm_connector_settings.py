"""The vLLM connector's settings and model identity, which need neither vLLM nor a service: its
`kv_connector_extra_config` is checked at start (every bad value a one-line ConfigError naming
its key), and the weight fingerprint changes whenever the weights do, its cache notwithstanding."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.integrations.vllm import identity
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import adapter_fingerprint, fingerprint


@pytest.mark.parametrize("key", ["budget_ms", "max_pending_store_mib", "retry_after_ms", "max_lookup_queue_ms"])
@pytest.mark.parametrize("value", [math.inf, 1e999, -math.inf, math.nan, 1e300, 0, -1, True, "100", None])
def test_a_number_that_is_not_finite_positive_and_bounded_is_refused_naming_its_key(key: str, value: Any) -> None:
    # JSON's 1e999 is inf: an infinite budget once made every kvstore call fail at once, an
    # infinite store bound raised a bare OverflowError.
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}.*a positive number, .*at most") as e:
        ConnectorConfig.from_extra({"address": "127.0.0.1:1", key: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["budget_ms", "max_lookup_queue_ms"])
@pytest.mark.parametrize("value", [1e-9, 0.5])
def test_a_budget_or_queue_wait_under_a_millisecond_is_refused(key: str, value: float) -> None:
    # It would fail (budget) or skip (queue wait) every call: 1e-9 was taken.
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}': must be a positive number, at least 1"):
        ConnectorConfig.from_extra({"address": "127.0.0.1:1", key: value})
    assert ConnectorConfig.from_extra({"address": "127.0.0.1:1", key: 1}) is not None


def test_numbers_within_their_bounds_are_taken() -> None:
    c = ConnectorConfig.from_extra({"address": "127.0.0.1:1", "budget_ms": 100, "max_pending_store_mib": 1.5,
                                    "retry_after_ms": 3_600_000, "max_lookup_queue_ms": 250})
    assert (c.budget_seconds, c.max_pending_store_bytes, c.retry_after_seconds) == (0.1, 3 << 19, 3600.0)
    assert c.max_lookup_queue_seconds == 0.25
    assert ConnectorConfig.from_extra({"address": "127.0.0.1:1"}).max_lookup_queue_seconds == 1.0


def _model(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(b"\x01" * 4096)
    return root


def test_weights_rewritten_with_their_old_size_and_mtime_are_another_fingerprint(tmp_path: Path) -> None:
    # cp -p, rsync -a and tar give a file back its mtime: the digest cache once keyed on (path,
    # size, mtime) kept the old weights' fingerprint, and the new weights reused the old KV.
    cache = tmp_path / "fp.json"
    m = _model(tmp_path / "model")
    w = m / "model.safetensors"
    os.utime(w, ns=(1_000_000_000, 1_000_000_000))
    before = fingerprint(m, cache)
    assert fingerprint(m, cache) == before  # unchanged: the cache answers
    w.write_bytes(b"\x02" * 4096)
    os.utime(w, ns=(1_000_000_000, 1_000_000_000))
    after = fingerprint(m, cache)
    assert after != before and after == fingerprint(m, tmp_path / "fresh.json")


def test_a_damaged_digest_in_the_cache_is_computed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A digest of 64 characters that are not all hex once stopped the engine at start.
    cache = tmp_path / "fp.json"
    m = _model(tmp_path / "model")
    want = fingerprint(m, cache)
    damaged = {k: v[:-1] + "\x7f" for k, v in json.loads(cache.read_text()).items()}
    cache.write_text(json.dumps(damaged))
    monkeypatch.setattr(identity, "_KNOWN", {})  # as a new engine process
    assert fingerprint(m, cache) == want


def test_the_cache_keeps_one_digest_a_file_and_leaves_no_temporary_file_on_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "fp.json"
    m = _model(tmp_path / "model")
    for b in range(3, 6):  # rewritten three times: the older digests can never be asked for again
        (m / "model.safetensors").write_bytes(bytes([b]) * 4096)
        fingerprint(m, cache)
    assert len(json.loads(cache.read_text())) == 2  # config.json and the weights

    def full(self: Path, target: Path) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    (m / "model.safetensors").write_bytes(b"\x09" * 4096)
    assert len(fingerprint(m, cache)) == 32  # still right, only not remembered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp.json", "model"]


def test_a_single_weight_file_and_an_adapter_are_fingerprinted(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny-q4.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    assert len(fingerprint(gguf, tmp_path / "fp.json")) == 32
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\x01" * 64)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    before = adapter_fingerprint(adapter, tmp_path / "fp.json")
    (adapter / "adapter_config.json").write_text('{"r": 16}')  # another rank: other KV
    assert adapter_fingerprint(adapter, tmp_path / "fp.json") != before
    with pytest.raises(ValueError, match="no weight files"):
        fingerprint(tmp_path / "adapter" / "adapter_config.json", tmp_path / "fp.json")


@pytest.mark.parametrize(("key", "value"), [("revision", "v1\x00"), ("model_name", "llama\n"),
                                            ("model_name", "m" * 129)])
def test_a_name_the_service_would_refuse_at_every_registration_is_refused_at_start(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}"):
        ConnectorConfig.from_extra({"address": "127.0.0.1:1", key: value})
    ConnectorConfig.from_extra({"address": "127.0.0.1:1", key: "ok-name"})


# http://...: taken before, and resolved by gRPC as a host named "http" for ever.
@pytest.mark.parametrize("address", [":", "host:", ":50051", "127.0.0.1:0", "127.0.0.1:99999", "unix://", "[]:1", 7,
                                     "http://127.0.0.1:50051", "kvstore", "unix:kv.sock"])
def test_an_address_the_client_could_not_dial_is_refused_at_start(address: Any) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.address"):
        ConnectorConfig.from_extra({"address": address})


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "kvstore:50051", "[::1]:50051", "unix:///run/kvstore.sock",
                                     "dns:///kvstore.internal:50051"])
def test_addresses_gRPC_dials_are_taken(address: str) -> None:
    assert ConnectorConfig.from_extra({"address": address}).address == address


@pytest.mark.parametrize("chunk_tokens", [0, 12, 130, 65_544, True, 128.0])
def test_a_chunk_size_the_service_cannot_have_is_refused_at_start(chunk_tokens: Any) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.chunk_tokens"):
        ConnectorConfig.from_extra({"address": "127.0.0.1:1", "chunk_tokens": chunk_tokens})
