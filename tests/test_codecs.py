"""FP4 / FP8 codecs: bit-exact against ml_dtypes and torch's float8, plus round-trip properties.

ml_dtypes and torch are independent references (docs/architecture.md §5.1); where they disagree on special
values (overflow, NaN) the codec documents its choice and the tests pin it down.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvstore import codecs as C

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _near(values: list[float]) -> np.ndarray:
    """Each value, its float32 neighbours and its negation."""
    out = []
    for v in values:
        f = np.float32(v)
        out += [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    a = np.array(out, dtype=np.float32)
    return np.concatenate([a, -a])


def _ref_fp4(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(F4).view(np.uint8)


# --- FP4 E2M1 -------------------------------------------------------------------------------------

def test_fp4_encode_matches_ml_dtypes_on_random_inputs() -> None:
    rng = np.random.default_rng(0)
    for scale in (0.3, 1.0, 3.0, 10.0):
        x = (rng.standard_normal(200_000) * scale).astype(np.float32)
        assert np.array_equal(C.fp4_encode(x).numpy(), _ref_fp4(x))


def test_fp4_encode_edge_cases() -> None:
    edges = _near([*THRESHOLDS, *C.FP4_VALUES, 6.5, 7.0, 100.0, 1e30, 2.0**-149, 1e-40, 0.1])
    edges = np.concatenate([edges, np.array([np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)])
    assert np.array_equal(C.fp4_encode(edges).numpy(), _ref_fp4(edges))


def test_fp4_ties_go_to_even_code_and_saturate() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, float("inf")])
    assert C.fp4_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 7]


def test_fp4_nan_encodes_as_zero_with_its_sign_bit() -> None:
    nan = torch.tensor([float("nan"), -float("nan")])
    codes = C.fp4_encode(nan)
    assert (codes & 7).tolist() == [0, 0]  # a zero, as in ml_dtypes
    assert codes.tolist() == [0, 8]


def test_fp4_decode_all_codes() -> None:
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(F4).astype(np.float32)
    got = C.fp4_decode(codes).numpy()
    assert np.array_equal(got, ref)
    assert np.array_equal(np.signbit(got), np.signbit(ref))


def test_pack_puts_even_channel_in_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = C.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(C.unpack_fp4(packed), codes)
    assert torch.equal(C.decode_packed_fp4(packed), C.fp4_decode(codes))


# --- E4M3 -----------------------------------------------------------------------------------------

def test_e4m3_matches_ml_dtypes_and_torch_in_range() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (rng.standard_normal(100_000) * 50).astype(np.float32),
        (rng.standard_normal(10_000) * 2**-8).astype(np.float32),  # subnormals of E4M3
        _near([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 240.0, 0.0]),
    ]).astype(np.float32)
    x = x[np.abs(x) < 464]
    ours = C.e4m3_encode(x).numpy()
    assert np.array_equal(ours, x.astype(F8).view(np.uint8))
    assert np.array_equal(ours, torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_e4m3_overflow_and_specials() -> None:
    x = np.array([449, 463.9, 464, 464.01, 1e6, -1e6, np.inf, -np.inf, np.nan, -np.nan], dtype=np.float32)
    # saturate=False is exactly ml_dtypes: beyond 464 (and inf) is NaN, NaN keeps its sign bit.
    assert np.array_equal(C.e4m3_encode(x, saturate=False).numpy(), x.astype(F8).view(np.uint8))
    # saturate=True (scales): clamp to +-448 first; NaN stays NaN.
    sat = C.e4m3_encode(x).numpy()
    assert sat.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0xFF]
    finite = np.isfinite(x)
    ref = np.clip(x[finite], -448, 448).astype(F8).view(np.uint8)
    assert np.array_equal(sat[finite], ref)


def test_e4m3_decode_all_bytes() -> None:
    b = np.arange(256, dtype=np.uint8)
    ref = b.view(F8).astype(np.float32)
    got = C.e4m3_decode(b).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(got[ok], ref[ok])


# --- UE8M0 ----------------------------------------------------------------------------------------

def test_ue8m0_is_ceil_log2_and_handles_zero_and_nan() -> None:
    inf, nan = float("inf"), float("nan")
    amax = torch.tensor([6.0, 6.000001, 5.99, 3.0, 12.0, 0.0, 1e-45, 3 * 2.0**126, inf, nan])
    b = C.ue8m0_encode(amax, 6.0)
    assert b.tolist() == [127, 128, 127, 126, 128, 0, 0, 252, 254, 255]
    scales = C.ue8m0_decode(b)
    assert scales[0].item() == 1.0 and scales[5].item() == 2.0**-127 and math.isnan(scales[-1].item())
    rng = np.random.default_rng(2)
    a = np.abs(rng.standard_normal(10_000).astype(np.float32)) * 100 + 1e-3
    ref = np.ceil(np.log2(a / np.float32(448.0))).astype(np.int64) + 127
    assert np.array_equal(C.ue8m0_encode(a, 448.0).numpy().astype(np.int64), ref)


# --- Block quantizers against a numpy + ml_dtypes reference ---------------------------------------

def _ref_main_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = x.reshape(*x.shape[:-1], -1, 16)
    amax = np.maximum(np.abs(g).max(-1), np.float32(6 * 2.0**-9))
    s8 = (amax / np.float32(6)).astype(np.float32).astype(F8)
    s = s8.astype(np.float32)[..., None]
    codes = (g / s).astype(np.float32).astype(F4).view(np.uint8).reshape(x.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), s8.view(np.uint8)


def _ref_ue8m0_block(x: np.ndarray, qmax: float, fp4: bool) -> tuple[np.ndarray, np.ndarray]:
    g = x.reshape(*x.shape[:-1], -1, 32)
    e = np.ceil(np.log2(np.abs(g).max(-1) / np.float32(qmax))).astype(np.int64)
    s = np.ldexp(np.float32(1), e).astype(np.float32)[..., None]
    y = (g / s).astype(np.float32).reshape(x.shape)
    if fp4:
        codes = y.astype(F4).view(np.uint8)
        vals = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    else:
        vals = y.astype(F8).view(np.uint8)
    return vals, (e + 127).astype(np.uint8)


def test_main_kv_row_is_288_bytes_and_bit_exact() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 512)) * rng.uniform(1e-3, 50, (300, 1))).astype(np.float32)
    x[0, :16] = 0.0  # an all-zero group: floored scale
    x[1, :16] = 1e-5  # below the floor
    packed, scales = C.quantize_main_kv(x)
    assert packed.shape == (300, 256) and scales.shape == (300, 32)
    assert packed.shape[-1] + scales.shape[-1] == 288
    rp, rs = _ref_main_kv(x)
    assert np.array_equal(scales.numpy(), rs)
    assert np.array_equal(packed.numpy(), rp)
    deq = C.dequantize_main_kv(packed, scales).numpy()
    g_s = rs.view(F8).astype(np.float32).repeat(16, -1)
    assert np.array_equal(deq, C.fp4_decode(C.unpack_fp4(packed)).numpy() * g_s)


def test_indexer_row_is_68_bytes_and_bit_exact() -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((300, 128)) * rng.uniform(1e-2, 50, (300, 1))).astype(np.float32)
    packed, scales = C.quantize_fp4_ue8m0(x)
    assert packed.shape[-1] + scales.shape[-1] == 68
    rp, rs = _ref_ue8m0_block(x, 6.0, fp4=True)
    assert np.array_equal(scales.numpy(), rs)
    assert np.array_equal(packed.numpy(), rp)


def test_swa_row_is_528_bytes_and_bit_exact() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((300, 512)) * rng.uniform(1e-2, 50, (300, 1))).astype(np.float32)
    vals, scales = C.quantize_fp8_ue8m0(x)
    assert vals.shape[-1] + scales.shape[-1] == 528
    rv, rs = _ref_ue8m0_block(x, 448.0, fp4=False)
    assert np.array_equal(scales.numpy(), rs)
    assert np.array_equal(vals.numpy(), rv)


def test_large_input_goes_through_blocks_identically() -> None:
    x = torch.randn(5000, 64)  # more rows than one CPU block
    p, s = C.quantize_main_kv(x)
    p2, s2 = C.quantize_main_kv(x[:100])
    assert torch.equal(p[:100], p2) and torch.equal(s[:100], s2)
    assert p.shape == (5000, 32)


def test_nan_poisons_its_group_only() -> None:
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    for q, dq in ((C.quantize_main_kv, C.dequantize_main_kv), (C.quantize_fp4_ue8m0, C.dequantize_fp4_ue8m0),
                  (C.quantize_fp8_ue8m0, C.dequantize_fp8_ue8m0)):
        y = dq(*q(x))
        clean = dq(*q(torch.ones(2, 64)))
        group = 16 if q is C.quantize_main_kv else 32
        assert torch.isnan(y[0, :group]).all()
        assert torch.equal(y[0, group:], clean[0, group:]) and torch.equal(y[1], clean[1])


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_finite_groups_at_the_largest_scale_decode_finite(fp4: bool) -> None:
    """Groups whose amax is near float32's largest get the largest finite-amax scale (2^120 for
    FP8, 2^126 for FP4): a value that would round up to 2^128 saturates at the largest grid value
    that decodes finite, and every other value decodes as the format rounds it."""
    q, dq, scale, top = ((C.quantize_fp4_ue8m0, C.dequantize_fp4_ue8m0, 2.0**126, 3.0) if fp4 else
                         (C.quantize_fp8_ue8m0, C.dequantize_fp8_ue8m0, 2.0**120, 240.0))
    f32max = float(np.finfo(np.float32).max)
    mags = np.concatenate([np.linspace(1.5 * 2.0**127, f32max, 60),
                           [f32max, float(torch.finfo(torch.bfloat16).max), 1.9375 * 2.0**127, 1.75 * 2.0**127]])
    x = np.concatenate([mags, -mags]).astype(np.float32).reshape(-1, 32)
    x[:, 0] = f32max  # every group at the largest scale
    values, scales = q(x)
    assert (scales.numpy() == 127 + round(math.log2(scale))).all()
    got = dq(values, scales).numpy().astype(np.float64)
    assert np.isfinite(got).all()
    # The format's own rounding, in float64 (where 2^128 is finite), saturated where it overflows.
    ref = (x / np.float32(scale)).astype(F4 if fp4 else F8).astype(np.float64) * scale
    expected = np.where(np.abs(ref) >= 2.0**128, np.sign(x) * top * scale, ref)
    assert np.array_equal(got, expected)
    assert (np.abs(ref) >= 2.0**128).any() and (np.abs(ref) < 2.0**128).any()  # both kinds of value


@pytest.mark.parametrize("encode", [C.fp4_encode, C.e4m3_encode, lambda x: C.ue8m0_encode(x, 6.0),
                                    C.quantize_main_kv, C.quantize_fp4_ue8m0, C.quantize_fp8_ue8m0],
                         ids=["fp4", "e4m3", "ue8m0", "main_kv", "fp4_ue8m0", "fp8_ue8m0"])
def test_float64_and_other_dtypes_are_refused_and_byte_order_is_converted(encode: Callable[[Any], Any]) -> None:
    """float64 would be rounded twice (to float32, then to the format), so it is refused; a
    big-endian float32 array is the same values, so it encodes as the native one does."""
    from kvstore.errors import InvalidInput

    x = np.linspace(-7.0, 7.0, 64).reshape(2, 32)
    for bad in (x, torch.from_numpy(x), x.astype(np.int32), torch.from_numpy(x).to(torch.int64)):
        with pytest.raises(InvalidInput, match="must be float32, float16 or bfloat16 values, not"):
            encode(bad)
    native, big = x.astype(np.float32), x.astype(">f4")
    a, b = encode(native), encode(big)
    for u, v in zip(a, b, strict=True) if isinstance(a, tuple) else ((a, b),):
        assert torch.equal(u, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit() -> None:
    """Codes, scales and decoded values, special values included; a NaN equals any NaN (its payload
    is the hardware's choice)."""
    from kvstore.bench.store_device import codec_mismatches, special_values_input

    x = special_values_input(1000, 512)
    for q, dq in ((C.quantize_main_kv, C.dequantize_main_kv), (C.quantize_fp4_ue8m0, C.dequantize_fp4_ue8m0),
                  (C.quantize_fp8_ue8m0, C.dequantize_fp8_ue8m0)):
        a, b = q(x)
        ca, cb = q(x.cuda())
        for cpu, cuda in ((a, ca), (b, cb), (dq(a, b), dq(ca, cb))):
            assert codec_mismatches(cpu, cuda) == (0, []), q.__name__


def test_the_codec_comparison_counts_bits_and_takes_a_nan_for_any_nan() -> None:
    from kvstore.bench.store_device import codec_mismatches

    a = torch.tensor([1.0, float("nan"), -0.0, 2.0])
    b = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    b[1:2].view(torch.int32).fill_(0x7FFFFFFF)  # another NaN payload: equal
    n, shown = codec_mismatches(a, b)
    assert n == 1 and shown[0].startswith("[2] cpu -0.0 vs 0.0")  # -0.0 and 0.0 differ by a bit
    assert codec_mismatches(torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([1, 3], dtype=torch.uint8))[0] == 1


# --- Properties -----------------------------------------------------------------------------------

_floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([32, 64])), elements=_floats))
def test_round_trips(x: np.ndarray) -> None:
    for q, dq, group in ((C.quantize_main_kv, C.dequantize_main_kv, 16),
                         (C.quantize_fp4_ue8m0, C.dequantize_fp4_ue8m0, 32)):
        packed, scales = q(x)
        y = dq(packed, scales)
        # Quantizing the dequantized values gives back the same values (codes may differ only
        # where the UE8M0 scale can halve: same value, different exponent).
        assert torch.equal(dq(*q(y)), y)
        # Signs survive, and the error is at most one scale (half the widest FP4 step) plus any
        # saturation where a rounded-down E4M3 scale pushes amax past 6.
        t = torch.from_numpy(x)
        assert ((torch.sign(y) == torch.sign(t)) | (y == 0)).all()
        s = (y.abs().reshape(*x.shape[:-1], -1, group).amax(-1) / 6).clamp(min=2.0**-9)
        amax = t.abs().reshape(*x.shape[:-1], -1, group).amax(-1, keepdim=True)
        bound = s.unsqueeze(-1) + (amax - 6 * s.unsqueeze(-1)).clamp(min=0)
        err = (y - t).abs().reshape(*x.shape[:-1], -1, group)
        assert (err <= bound * (1 + 1e-6) + 1e-30).all()
    vals, scales = C.quantize_fp8_ue8m0(x)
    y = C.dequantize_fp8_ue8m0(vals, scales)
    assert torch.equal(C.dequantize_fp8_ue8m0(*C.quantize_fp8_ue8m0(y)), y)
    t = torch.from_numpy(x)
    sc = C.ue8m0_decode(scales).repeat_interleave(32, -1)
    # E4M3 relative step 2^-3 (half of it is the error), or the subnormal step 2^-9 of the scale.
    assert ((y - t).abs() <= torch.maximum(t.abs() * 2.0**-4, sc * 2.0**-10) * (1 + 1e-6)).all()
