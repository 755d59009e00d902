"""Opt-in lossy quantize-on-store: the bf16 <-> FP8/FP4 plan, the tier wrapper, and a store using it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.config import parse_config
from kvstore.config.store import StoreConfig
from kvstore.errors import ConfigError
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import (
    DENSE_GQA_32L,
    REFERENCE_TOY8,
    CacheLayout,
    GlobalGroup,
    LocalSpec,
    RecordSegment,
    get_model,
)
from kvstore.store import GlobalStore
from kvstore.tiers.base import ChunkMeta, TierName
from kvstore.tiers.dram import DramTier
from kvstore.tiers.factory import quantize_tiers
from kvstore.tiers.lmdb_tier import LmdbTier
from kvstore.tiers.quantize import QuantizeMode, plan_for
from kvstore.tiers.quantizing import QuantizingDurableTier, QuantizingTier
from tests.store_helpers import CHUNK, payload_for, small_config, tokens_for

GROUP = {"fp8": 32, "fp4": 16}
DENSE = DENSE_GQA_32L.with_chunk_tokens(8)  # 1 MiB chunks keep the tests quick
MODELS = [get_model("dense-gqa-32l"), get_model("reference-toy-8")]


def random_bf16(n: int, seed: int) -> bytes:
    """Gaussian values with a log-normal scale per 16 channels: groups of very different sizes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.repeat(rng.lognormal(0.0, 2.0, n // 16), 16)
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def bf16_values(b: bytes) -> np.ndarray:
    return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def assert_within_bound(sent: bytes, got: bytes, mode: str) -> None:
    """The documented bounds (kvstore/tiers/quantize.py), per value, with amax over its group."""
    x = bf16_values(sent).reshape(-1, GROUP[mode])
    y = bf16_values(got).reshape(-1, GROUP[mode])
    amax = np.abs(x).max(axis=1, keepdims=True)
    bound = np.abs(x) / 16 + amax / 2**17 if mode == "fp8" else 0.18 * amax + 6 * 2.0**-10
    if mode == "fp4":  # groups beyond the largest E4M3 scale saturate at ±2,688 (documented)
        big = (amax > 2688).ravel()
        assert np.all(np.abs(y[big]) <= 2688) and np.all(np.sign(y[big]) * np.sign(x[big]) >= 0)
        x, y, bound = x[~big], y[~big], bound[~big]
    err = np.abs(y - x)
    assert np.all(err <= bound), float((err - bound).max())
    assert not np.array_equal(x, y)  # lossy indeed


def meta(layout: CacheLayout, key: bytes) -> ChunkMeta:
    return ChunkMeta(bytes(32), layout.layout_id, np.arange(layout.chunk_tokens, dtype="<u4").tobytes() + key[:0])


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_round_trip_error_is_within_the_documented_bound(mode: QuantizeMode) -> None:
    plan = plan_for(DENSE, mode)
    assert plan is not None
    sent = random_bf16(DENSE.chunk_bytes // 2, seed=1)
    stored = plan.quantize(memoryview(sent))
    assert len(stored) == plan.stored_bytes < DENSE.chunk_bytes * (0.53 if mode == "fp8" else 0.29)
    out = bytearray(DENSE.chunk_bytes)
    plan.dequantize_into(memoryview(stored), memoryview(out))
    assert_within_bound(sent, bytes(out), mode)


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_values_near_the_largest_bf16_stay_finite_and_within_the_bound(mode: QuantizeMode) -> None:
    """In fp8 such a group gets the largest scale, 2^120, at which E4M3's rounding up to 256 would
    decode to 2^128: past float32's (and bf16's) largest, an infinity."""
    plan = plan_for(DENSE, mode)
    assert plan is not None
    x = torch.from_numpy(bf16_values(random_bf16(DENSE.chunk_bytes // 2, seed=4)).astype(np.float32))
    top = float(torch.finfo(torch.bfloat16).max)
    for i, big in enumerate([top, 1.9375 * 2.0**127, 1.75 * 2.0**127, 2.0**127]):
        group = x[i * 32 : (i + 1) * 32]  # a group in either mode (fp4's groups are 16)
        group[::3] = big
        group[1::7] = -big
        group[5] = -top
    sent = x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    out = bytearray(DENSE.chunk_bytes)
    plan.dequantize_into(memoryview(plan.quantize(memoryview(sent))), memoryview(out))
    assert np.isfinite(bf16_values(bytes(out))).all()
    assert_within_bound(sent, bytes(out), mode)


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_only_whole_group_bf16_segments_change(mode: QuantizeMode) -> None:
    layout = CacheLayout(
        "mixed", (GlobalGroup("g", (0,), 1, (
            RecordSegment("raw", 12), RecordSegment("bf16", 128), RecordSegment("bf16", 64),
            RecordSegment("fp4", 8), RecordSegment("bf16", 10),  # 5 values: not a whole group, kept
        )),), LocalSpec(0, 0, ()), chunk_tokens=8,
    )
    plan = plan_for(layout, mode)
    assert plan is not None
    rng = np.random.default_rng(2)
    rec = [rng.integers(0, 256, 12, dtype=np.uint8).tobytes(), random_bf16(96, 3),
           rng.integers(0, 256, 8, dtype=np.uint8).tobytes(), rng.integers(0, 256, 10, dtype=np.uint8).tobytes()]
    sent = b"".join(rec) * 8
    out = bytearray(layout.chunk_bytes)
    plan.dequantize_into(memoryview(plan.quantize(memoryview(sent))), memoryview(out))
    for i in range(8):
        o = i * 222
        assert out[o : o + 12] == sent[o : o + 12]
        assert out[o + 204 : o + 222] == sent[o + 204 : o + 222]
        assert_within_bound(sent[o + 12 : o + 204], bytes(out[o + 12 : o + 204]), mode)


def test_a_quantized_read_fills_any_writable_buffer_as_a_plain_tier_does() -> None:
    q = QuantizingTier(DramTier(4 * DENSE.chunk_bytes, 1 << 20, pin_memory=False), "fp8", [DENSE])
    meta = ChunkMeta(b"n" * 32, DENSE.layout_id, bytes(4 * DENSE.chunk_tokens))
    q.put(b"k" * 32, memoryview(bytes(DENSE.chunk_bytes)), meta)  # zeros: exact in FP8
    out = np.full(DENSE.chunk_bytes // 2, 7, np.uint16)
    assert q.get_into(b"k" * 32, memoryview(out)) == meta
    assert not out.any()


def test_layouts_without_bf16_have_no_plan() -> None:
    assert plan_for(REFERENCE_TOY8, "fp8") is None and plan_for(REFERENCE_TOY8, "fp4") is None
    assert plan_for(DENSE, "off") is None


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_wrapped_tier_stores_fewer_bytes_and_reads_bf16_back(tmp_path: Path, mode: QuantizeMode) -> None:
    toy = REFERENCE_TOY8.with_chunk_tokens(8)
    plain = DramTier(8 << 20, 4096, pin_memory=False)
    tier = QuantizingTier(DramTier(8 << 20, 4096, pin_memory=False), mode, [DENSE, toy])
    dense = (DENSE.chunk_bytes, DENSE.layout_id)
    assert tier.footprint(*dense) < plain.footprint(*dense) * 0.55
    assert tier.footprint(toy.chunk_bytes, toy.layout_id) == plain.footprint(toy.chunk_bytes, toy.layout_id)
    sent = random_bf16(DENSE.chunk_bytes // 2, seed=4)
    tier.put(b"k" * 32, memoryview(sent), meta(DENSE, b"k"))
    plain.put(b"k" * 32, memoryview(sent), meta(DENSE, b"k"))
    assert tier.stats().used_bytes == tier.footprint(DENSE.chunk_bytes, DENSE.layout_id) < plain.stats().used_bytes
    out = bytearray(DENSE.chunk_bytes)
    assert tier.get_into(b"k" * 32, memoryview(out)) == meta(DENSE, b"k")
    assert_within_bound(sent, bytes(out), mode)
    assert tier.join_payloads(b"", [b"k" * 32]) is None
    toy_bytes = np.random.default_rng(5).integers(0, 256, toy.chunk_bytes, dtype=np.uint8).tobytes()
    tier.put_many([(b"t" * 32, memoryview(toy_bytes), meta(toy, b"t"))])
    out = bytearray(toy.chunk_bytes)
    assert tier.get_into(b"t" * 32, memoryview(out)) is not None and bytes(out) == toy_bytes
    tier.close()
    plain.close()

    lmdb = QuantizingDurableTier(LmdbTier(tmp_path, 64 << 20, [DENSE], compression="none"), mode, [DENSE])
    assert lmdb.footprint(DENSE.chunk_bytes, DENSE.layout_id) < LmdbTier(tmp_path / "p", 64 << 20, [DENSE]).footprint(
        DENSE.chunk_bytes, DENSE.layout_id) * 0.55
    lmdb.put(b"k" * 32, memoryview(sent), meta(DENSE, b"k"))
    assert [(s.payload_bytes, s.ok) for s in lmdb.scan()] == [(DENSE.chunk_bytes, True)]
    lmdb.close()


# --- a store configured with it -----------------------------------------------------------------


def bf16_payload_for(ns: Namespace, index: int, tokens: np.ndarray, nbytes: int) -> bytes:
    seed = int.from_bytes(payload_for(ns, index, tokens, 8), "little")
    return random_bf16(nbytes // 2, seed)


def open_store(path: Path, **over: Any) -> GlobalStore:
    base: dict[str, Any] = dict(device_capacity_bytes=0, dram_capacity_bytes=0, lmdb_capacity_bytes=64 << 20)
    base.update(over)
    return GlobalStore(small_config(**base), path, MODELS)


def store_and_load(store: GlobalStore, model: str, seed: int) -> tuple[list[bytes], list[tuple[TierName, bytes]]]:
    ns = store.namespace("default", model, "bounded")
    layout = store.layout(ns)
    tokens = tokens_for(seed, 3 * CHUNK)
    make = bf16_payload_for if model.startswith("dense") else payload_for
    sent = [make(ns, i, tokens[i * CHUNK : (i + 1) * CHUNK], layout.chunk_bytes) for i in range(3)]
    with store.begin_store(ns, tokens) as txn:
        for i in txn.chunks_needed:
            txn.write(i, sent[i])
        res = txn.commit()
    assert res.stored_chunks + res.already_present == 3
    with store.load(ns, tokens) as session:
        got = [(c.tier, bytes(c.payload)) for c in session]
    with store.load(ns, tokens) as session:  # the batched read a Load makes gives the same bytes
        bufs = [memoryview(bytearray(len(p))) for _, p in got]
        assert len(session.read_many_into(0, bufs)) == len(got)
        assert [bytes(b) for b in bufs] == [p for _, p in got]
    return sent, got


@pytest.mark.parametrize(("tier", "mode"), [("lmdb", "fp8"), ("lmdb", "fp4"), ("dram", "fp8"), ("device", "fp4")])
def test_a_store_that_quantizes_loads_back_approximately_equal_bf16(tmp_path: Path, tier: str, mode: str) -> None:
    over: dict[str, Any] = {f"quantize_{tier}": mode}
    if tier != "lmdb":
        over[f"{tier}_capacity_bytes"] = 16 << 20
    store = open_store(tmp_path, **over)
    sent, got = store_and_load(store, "dense-gqa-32l", seed=6)
    assert [t for t, _ in got] == [tier] * 3
    for s, (_, g) in zip(sent, got, strict=True):
        assert len(g) == len(s)
        assert_within_bound(s, g, mode)
    toy_sent, toy_got = store_and_load(store, "reference-toy-8", seed=7)
    assert [g for _, g in toy_got] == toy_sent  # not bf16: bytes exactly as sent
    usage = store.stats().tiers[tier]
    assert 0 < usage.used_bytes < 3 * store.layout(store.namespace("default", "dense-gqa-32l", "bounded")).chunk_bytes
    store.check_invariants()
    store.close()

    if tier == "lmdb":  # restart: found again; ignored when reopened without it or in another mode
        again = open_store(tmp_path, **over)
        assert again.stats().ignored_on_open == {}
        _, got = store_and_load(again, "dense-gqa-32l", seed=6)  # already present: loaded back
        for s, (_, g) in zip(sent, got, strict=True):
            assert_within_bound(s, g, mode)
        again.close()
        plain = open_store(tmp_path)
        assert plain.stats().ignored_on_open == {"size-mismatch": 3}
        plain.close()
        other = open_store(tmp_path, quantize_lmdb="fp4" if mode == "fp8" else "fp8")
        assert other.stats().ignored_on_open == {"format-version": 3}
        other.close()


def test_off_by_default_and_bytes_stay_exact(tmp_path: Path) -> None:
    cfg = StoreConfig()
    assert (cfg.quantize_device, cfg.quantize_dram, cfg.quantize_lmdb) == ("off", "off", "off")
    tiers: tuple[Any, Any, Any] = (object(), object(), object())
    assert quantize_tiers(cfg, [DENSE], *tiers) == tiers
    store = open_store(tmp_path, dram_capacity_bytes=16 << 20)
    sent, got = store_and_load(store, "dense-gqa-32l", seed=8)
    assert [g for _, g in got] == sent
    store.close()


@pytest.mark.parametrize("key", ["quantize_device", "quantize_dram", "quantize_lmdb"])
def test_a_bad_value_names_the_key(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"store": {key: "int8"}})
    assert e.value.key == f"store.{key}"
    assert parse_config({"store": {key: "fp4"}}).store.__getattribute__(key) == "fp4"
