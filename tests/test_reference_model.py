"""The reference CED model on CPU: byte layout, determinism, resume == one go, replay contracts.

Most tests use a small window (W = 16) and 32-token chunks so that multi-chunk prefixes, exact
replays and block boundaries inside the attention and indexer loops are all cheap to reach.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore import codecs
from kvstore.errors import InvalidInput
from kvstore.layout import REFERENCE_TOY8, get_model
from replay.reference.cache import decode_snapshot
from replay.reference.config import ModelConfig
from replay.reference.model import ModelState, ReferenceModel, ReplayMode, ReplayRequest

SMALL = ModelConfig(window=16, chunk_tokens=32)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(SMALL, device="cpu")


@pytest.fixture(scope="module")
def toy8() -> ReferenceModel:
    return ReferenceModel(device="cpu")


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_state(a: ModelState, b: ModelState) -> bool:
    return (
        a.tokens == b.tokens
        and all(torch.equal(x.raw, y.raw) and x.start == y.start for x, y in zip(a.enc_rows, b.enc_rows, strict=True))
        and all(torch.equal(x.raw, y.raw) for x, y in zip(a.groups, b.groups, strict=True))
        and torch.equal(a.logits, b.logits)
    )


# --- layout --------------------------------------------------------------------------------------------

def test_default_config_matches_reference_toy8_layout(toy8: ReferenceModel) -> None:
    assert toy8.layout == REFERENCE_TOY8
    assert toy8.spec is get_model("reference-toy-8")
    cfg = toy8.cfg
    assert cfg.record_bytes == 53 and cfg.swa_row_bytes == 66
    assert REFERENCE_TOY8.chunk_bytes == 10_176 and REFERENCE_TOY8.local_snapshot_bytes == 33_792
    assert [g.name for g in cfg.groups()] == ["enc-2", "dec-4"]
    assert cfg.exact_replay_tokens == 4 * 127 + 1


def test_payload_and_snapshot_bytes_follow_the_layout(toy8: ReferenceModel) -> None:
    res = toy8.prefill(_tokens(300))
    assert res.boundary == 256 and len(res.chunk_payloads) == 2
    assert all(len(p) == REFERENCE_TOY8.chunk_bytes for p in res.chunk_payloads)
    assert res.snapshot is not None and len(res.snapshot) == REFERENCE_TOY8.local_snapshot_bytes
    enc, dec = res.state.groups
    # Chunk 1 = records 64..127 of enc-2, then records 128..255 of dec-4, each 53 B in segment order.
    p = np.frombuffer(res.chunk_payloads[1], dtype=np.uint8)
    assert np.array_equal(p[: 64 * 53].reshape(64, 53), enc.raw[64:128].numpy())
    assert np.array_equal(p[64 * 53 :].reshape(128, 53), dec.raw[128:256].numpy())
    rec = torch.from_numpy(p[:53].copy())  # main fp4 32 | e4m3 4 | index fp4 16 | ue8m0 1
    assert torch.equal(codecs.dequantize_main_kv(rec[:32], rec[32:36]), enc.main[64])
    assert torch.equal(codecs.dequantize_fp4_ue8m0(rec[36:52], rec[52:]), enc.index[64])
    # Snapshot: encoder layers 0..3, each the rows of positions [128, 256), 66 B each.
    full = toy8.prefill(_tokens(300)[:256]).state
    snap = np.frombuffer(res.snapshot, dtype=np.uint8).reshape(4, 128, 66)
    for layer in range(4):
        assert np.array_equal(snap[layer], full.enc_rows[layer].raw.numpy())
        row = torch.from_numpy(snap[layer, -1].copy())
        assert torch.equal(codecs.dequantize_fp8_ue8m0(row[:64], row[64:]), full.enc_rows[layer].values[-1])


def test_small_window_layout_is_named_apart(model: ReferenceModel) -> None:
    assert model.layout.name == "reference-toy-8-w16-c32"
    assert model.layout.local_snapshot_bytes == 4 * 16 * 66
    assert model.layout.chunk_bytes == (16 + 32) * 53


# --- determinism ---------------------------------------------------------------------------------------

def test_weights_and_outputs_are_deterministic_from_the_seed(model: ReferenceModel) -> None:
    again = ReferenceModel(SMALL, device="cpu")
    other = ReferenceModel(replace(SMALL, seed=1), device="cpu")
    toks = _tokens(100)
    a, b, c = model.prefill(toks), again.prefill(toks), other.prefill(toks)
    assert torch.equal(a.logits, b.logits) and a.chunk_payloads == b.chunk_payloads and a.snapshot == b.snapshot
    assert not torch.equal(a.logits, c.logits)


# --- resume == one go ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("hit", "n"), [(32, 32), (32, 33), (64, 97), (96, 200), (160, 431)])
def test_warm_resume_equals_one_go(model: ReferenceModel, hit: int, n: int) -> None:
    toks = _tokens(n)
    one_go = model.prefill(toks)
    cached = model.prefill(toks[:hit])
    warm = model.prefill(toks, cached.chunk_payloads, cached.snapshot)
    assert warm.computed_tokens == n - hit and warm.cached_chunks == hit // 32
    assert torch.equal(warm.logits, one_go.logits)
    assert warm.chunk_payloads == one_go.chunk_payloads and warm.snapshot == one_go.snapshot
    assert _same_state(warm.state, one_go.state)
    # ... and they keep agreeing while decoding.
    assert model.generate(warm.state, 4) == model.generate(one_go.state, 4)
    assert torch.equal(warm.state.logits, one_go.state.logits)


def test_warm_resume_below_the_window() -> None:
    m = ReferenceModel(replace(SMALL, window=48), device="cpu")  # a 32-token hit is shorter than W
    toks = _tokens(70)
    cached = m.prefill(toks[:32])
    assert cached.snapshot is not None and len(cached.snapshot) == 4 * 48 * 66
    assert cached.snapshot[: 16 * 66] == bytes(16 * 66)  # rows for positions below 0 are zeros
    warm = m.prefill(toks, cached.chunk_payloads, cached.snapshot)
    assert torch.equal(warm.logits, m.prefill(toks).logits)


def test_decode_steps_extend_the_encoder_state_like_one_go(model: ReferenceModel) -> None:
    toks = _tokens(140)
    state = model.prefill(toks[:129]).state  # odd boundary: a compressor tail is carried
    for t in toks[129:]:
        model.decode_step(state, t)
    ref = model.prefill(toks).state
    pairs = zip(state.enc_rows, ref.enc_rows, strict=True)
    assert all(torch.equal(a.raw, b.raw) and a.start == b.start for a, b in pairs)
    assert all(torch.equal(a.raw, b.raw) for a, b in zip(state.groups, ref.groups, strict=True))
    assert state.tokens == toks


# --- replay --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hit", [32, 64, 128, 256])
def test_exact_replay_equals_full_recompute(model: ReferenceModel, hit: int) -> None:
    toks = _tokens(hit)
    cold = model.prefill(toks)
    span = model.replay_span(hit, "exact")
    assert len(span) == min(hit, 4 * 15 + 1)
    snap = model.replay(toks[span.start :], span, cold.chunk_payloads)
    assert snap == cold.snapshot


def test_bounded_replay_layer0_exact_deeper_layers_approximate(model: ReferenceModel) -> None:
    toks = _tokens(256)
    cold = model.prefill(toks)
    span = model.replay_span(256, "bounded")
    assert span == range(240, 256)
    snap = model.replay(toks[240:], span, cold.chunk_payloads)
    assert cold.snapshot is not None
    got = decode_snapshot(SMALL, snap, 256, model.device)
    truth = decode_snapshot(SMALL, cold.snapshot, 256, model.device)
    assert torch.equal(got[0].raw, truth[0].raw)
    rel = [float((g.values - t.values).norm() / t.values.norm()) for g, t in zip(got, truth, strict=True)]
    assert rel[0] == 0.0 and all(0 < r < 2 for r in rel[1:])
    # The last position of layer 1 saw its whole window, so it is exact too; earlier ones are not.
    assert torch.equal(got[1].raw[-1], truth[1].raw[-1]) and not torch.equal(got[1].raw, truth[1].raw)


def test_replay_never_rewrites_global_rows(model: ReferenceModel) -> None:
    toks = _tokens(200)
    cold = model.prefill(toks[:160])
    before = [bytes(p) for p in cold.chunk_payloads]
    span = model.replay_span(160, "bounded")
    snap = model.replay(toks[span.start : 160], span, cold.chunk_payloads)
    assert cold.chunk_payloads == before
    resumed = model.prefill(toks, cold.chunk_payloads, snap)  # the expired path: replay then suffix
    assert resumed.chunk_payloads[:5] == before
    for g, cached in zip(resumed.state.groups, model.decode_chunk_payloads(before), strict=True):
        assert torch.equal(g.raw[: len(cached)], cached.raw)


def test_prefix_within_the_window_replays_from_zero_exactly(model: ReferenceModel) -> None:
    m = ReferenceModel(replace(SMALL, window=48), device="cpu")
    toks = _tokens(32)
    cold = m.prefill(toks)
    modes: tuple[ReplayMode, ...] = ("bounded", "exact")
    for mode in modes:
        span = m.replay_span(32, mode)
        assert span == range(0, 32)
        assert m.replay(toks, span, cold.chunk_payloads) == cold.snapshot


@pytest.mark.parametrize("window", [16, 80])  # 80: exact replays of 317 tokens cross the attention and indexer blocks
def test_batched_replay_equals_each_replay_alone_bit_for_bit(model: ReferenceModel, window: int) -> None:
    m = model if window == 16 else ReferenceModel(replace(SMALL, window=window), device="cpu")
    jobs: list[tuple[int, int, ReplayMode]] = [  # (seed, boundary, mode): prefixes of different lengths
        (1, 352, "exact"), (2, 352, "bounded"), (3, 32, "bounded"), (4, 128, "exact"), (2, 352, "bounded"),
        (5, 96, "bounded"),
    ]
    requests, colds = [], []
    for seed, hit, mode in jobs:
        toks = _tokens(hit + 7, seed)
        cold = m.prefill(toks)
        span = m.replay_span(hit, mode)
        requests.append(ReplayRequest(toks[span.start : hit], span, cold.chunk_payloads[: hit // 32]))
        colds.append(cold)
    alone = [m.replay(r.tokens, r.positions, r.global_payloads) for r in requests]
    together = m.replay_batch(requests)
    assert together == alone
    for (_, hit, mode), cold, snap in zip(jobs, colds, together, strict=True):
        if mode == "exact" or hit <= window:  # and exact replays still equal a full recompute
            assert snap == m.prefill(cold.state.tokens[:hit]).snapshot
    assert m.replay_batch([]) == []
    late = requests[1]  # the same job starting 4 tokens too late: it cannot rebuild the whole window
    bad = ReplayRequest(late.tokens[4:], range(352 - window + 4, 352), late.global_payloads)
    with pytest.raises(InvalidInput):  # one bad request fails the batch before anything runs
        m.replay_batch([requests[0], bad])


def test_bad_input_is_refused(model: ReferenceModel) -> None:
    toks = _tokens(96)
    cold = model.prefill(toks)
    with pytest.raises(InvalidInput):
        model.prefill([512])
    with pytest.raises(InvalidInput):
        model.prefill(toks[:40], cold.chunk_payloads, cold.snapshot)  # hit longer than the prompt
    with pytest.raises(InvalidInput):
        model.prefill(toks, cold.chunk_payloads[:1])  # no snapshot
    with pytest.raises(InvalidInput):
        model.prefill(toks, [cold.chunk_payloads[0][:-1]], cold.snapshot)
    with pytest.raises(InvalidInput):
        model.prefill(toks, cold.chunk_payloads[:1], b"\0" * 10)
    with pytest.raises(InvalidInput):
        model.replay(toks[80:96], [80, 81, *range(83, 97)], cold.chunk_payloads)  # a gap
    with pytest.raises(InvalidInput):
        model.replay(toks[84:96], range(84, 96), cold.chunk_payloads)  # starts inside the window
    with pytest.raises(InvalidInput):
        model.replay(toks[80:96], range(80, 96), cold.chunk_payloads[:2])  # rows missing below 96


def test_sharpness_changes_outputs_not_layout(model: ReferenceModel) -> None:
    sharp = ReferenceModel(replace(SMALL, attn_sharpness=4.0), device="cpu")
    assert sharp.layout == model.layout
    toks = _tokens(64)
    assert not torch.equal(sharp.prefill(toks).logits, model.prefill(toks).logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replay_within_float_tolerance() -> None:
    # cuBLAS may pick kernels by shape, so on CUDA exactness is "within float tolerance" (a rare
    # FP8 rounding flip included), not bit-for-bit.
    gpu = ReferenceModel(SMALL, device="cuda")
    toks = _tokens(256)
    cold = gpu.prefill(toks)
    assert cold.snapshot is not None and torch.isfinite(cold.logits).all()
    assert all(len(p) == gpu.layout.chunk_bytes for p in cold.chunk_payloads)
    span = gpu.replay_span(256, "exact")
    snap = gpu.replay(toks[span.start :], span, cold.chunk_payloads)
    got, truth = gpu.decode_snapshot(snap, 256), gpu.decode_snapshot(cold.snapshot, 256)
    for g, t in zip(got, truth, strict=True):
        assert float((g.values - t.values).norm() / t.values.norm()) < 0.05
    # Batched with another replay: within the same tolerance of the replay alone.
    other = _tokens(160, seed=9)
    other_cold = gpu.prefill(other)
    bounded = gpu.replay_span(160, "bounded")
    batch = gpu.replay_batch([ReplayRequest(toks[span.start :], span, cold.chunk_payloads),
                              ReplayRequest(other[bounded.start :], bounded, other_cold.chunk_payloads)])
    alone = gpu.replay(other[bounded.start :], bounded, other_cold.chunk_payloads)
    for snap_b, snap_a, h in ((batch[0], snap, 256), (batch[1], alone, 160)):
        for g, t in zip(gpu.decode_snapshot(snap_b, h), gpu.decode_snapshot(snap_a, h), strict=True):
            assert float((g.values - t.values).norm() / t.values.norm()) < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_with_the_reason(tmp_path: Any) -> None:
    import subprocess
    import sys

    from kvstore.errors import ConfigError, Unavailable
    from kvstore.service.app import build_app
    from tests.fixtures.service import make_config

    with pytest.raises(Unavailable, match="CUDA is not available here"):
        ReferenceModel(SMALL, device="cuda")
    with pytest.raises(InvalidInput, match="not a torch device"):
        ReferenceModel(SMALL, device="gpu0")
    # A flag: a clear message and status 2, no traceback.
    run = subprocess.run([sys.executable, "-m", "kvstore", "replay-quality", "--device", "cuda", "--sizes", "128"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "CUDA is not available here" in run.stderr and "Traceback" not in run.stderr
    # A config key: refused when the service starts, not at its first replay.
    with pytest.raises(ConfigError, match=r"replay\.device"):
        build_app(make_config(replay={"runner": "reference", "device": "cuda"}), tmp_path)
