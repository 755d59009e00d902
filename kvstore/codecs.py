"""Low-precision codecs for KV records: FP4 E2M1, FP8 E4M3, and the E4M3 / UE8M0 block scales.

These are the byte formats of docs/architecture.md §5.1, implemented as vectorised torch operations that run
on CPU and CUDA tensors alike (numpy arrays are accepted as input and converted). Values to encode
are float32, float16 or bfloat16 (numpy: float32 or float16, either byte order), each exact in
float32; float64 and other dtypes are refused with InvalidInput, since a float64 would be rounded
twice (to float32, then to the format):

- FP4 E2M1 codes: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} as codes 0..7, sign in bit 3; round to
  nearest with ties to the even code; saturate at 6. Two codes per byte, the even channel in the
  LOW nibble.
- E4M3 (float8_e4m3fn): round to nearest even, as torch and ml_dtypes do.
- UE8M0: a bare power of two, stored as its exponent + 127.
- Main KV: one E4M3 scale per 16 channels, `s = e4m3(max(amax, 6·2⁻⁹) / 6)`, values divided by the
  rounded scale then FP4-encoded (4.5 bits per value).
- Indexer K: FP4 with one UE8M0 scale per 32, `2^ceil(log2(amax / 6))`.
- SWA rows: FP8 E4M3 with one UE8M0 scale per 32, `2^ceil(log2(amax / 448))`.

Special values (documented because the references disagree on them):
- FP4 has no NaN or infinity. ±inf saturates to ±6 (as ml_dtypes does). A NaN encodes as a zero
  whose sign is the NaN's sign bit (ml_dtypes also yields a zero; its sign there is an artefact).
  Inside `quantize_*` a NaN never reaches the FP4 step silently: it poisons its group's scale
  (E4M3 NaN, or the UE8M0 NaN byte 0xFF), so the whole group decodes as NaN.
- E4M3 with `saturate=True` (the default, and what every scale uses) clamps finite and infinite
  values to ±448; NaN stays NaN (0x7F, or 0xFF with the sign bit). With `saturate=False` the result
  is ml_dtypes' behaviour: |x| > 464 and ±inf become NaN, everything else rounds to nearest even.
- UE8M0: amax = 0 (an all-zero group) is floored to the smallest scale 2⁻¹²⁷ (byte 0) so that it
  decodes to zeros; exponents are clamped to [-127, 127]; a NaN amax gives byte 0xFF, which decodes
  to NaN; +inf saturates at 2¹²⁷.
- Block-scaled UE8M0 groups (FP8 values, FP4 values) of finite values decode finite: at the largest
  scale a finite amax gets (2¹²⁰ for FP8, 2¹²⁶ for FP4), a value that would round up to 2¹²⁸
  (|x| >= 1.9375·2¹²⁷ in FP8, 1.75·2¹²⁷ in FP4) saturates at 240·2¹²⁰ or 3·2¹²⁶ instead. In a
  group holding an infinity (scale 2¹²⁷) such values decode infinite too.

This module knows nothing about layouts, records or models: callers choose the group sizes and
lay the returned arrays out into bytes themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from kvstore.errors import InvalidInput

FP4_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
E4M3_MAX = 448.0
MAIN_KV_GROUP = 16
UE8M0_GROUP = 32
# Smallest main-KV amax: 6·2⁻⁹ / 6 = 2⁻⁹ is the smallest E4M3 subnormal, so the scale is never 0.
MAIN_KV_AMAX_FLOOR = 6.0 * 2.0**-9
UE8M0_NAN = 255

ArrayLike = Tensor | np.ndarray
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NUMPY_VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_VALUE_DTYPE_NAMES = "float32, float16 or bfloat16"

# Decision thresholds between adjacent FP4 magnitudes, with the comparison that sends an exact
# tie to the even code: at 0.25 the lower code (0) is even so a tie stays down (strict >), at 0.75
# the upper code (2) is even so a tie goes up (>=), and so on alternately.
_FP4_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True),
)
# Elements per block when working through a large CPU tensor: small enough that the dozen passes
# of an encode stay in cache (measured ~4x faster than whole-tensor passes on 512 M values).
_CPU_BLOCK_ELEMENTS = 1 << 18
# The largest UE8M0 scale a finite amax gets (amax < 2^128): 2^120 over E4M3's 448, 2^126 over
# FP4's 6. At it a value that rounds up to its binade's top (|x| >= 1.9375·2^127 in E4M3, 1.75·2^127
# in FP4) would decode to 2^128, past float32's largest, so it saturates instead at the largest grid
# value that decodes finite (240·2^120, 3·2^126); every other value encodes as it rounds.
_E4M3_TOP_SCALE_BYTE, _E4M3_TOP_SCALE_MAX = 127 + 120, 240.0
_FP4_TOP_SCALE_BYTE, _FP4_TOP_SCALE_MAX = 127 + 126, 3.0


def _as_tensor(x: ArrayLike) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _values(x: ArrayLike) -> Tensor:
    """Values to encode as float32: float32, float16 or bfloat16, each exact in float32. float64
    (and anything else) is refused: rounding it to float32 first would round some values twice,
    and the result would differ from the format's single rounding."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f" and not x.dtype.isnative:  # byte order only: converted exactly
            x = x.astype(x.dtype.newbyteorder("="))
        if x.dtype not in _NUMPY_VALUE_DTYPES:
            raise InvalidInput(f"codec input must be {_VALUE_DTYPE_NAMES} values, not numpy {x.dtype}")
    t = _as_tensor(x)
    if t.dtype not in _VALUE_DTYPES:
        raise InvalidInput(f"codec input must be {_VALUE_DTYPE_NAMES} values, not {t.dtype}")
    return t.float()


def _fp4_codes(mag: Tensor, signed: Tensor) -> Tensor:
    """FP4 codes from magnitudes `mag` (>= 0 or NaN) and the tensor whose sign bits they carry.

    Seven compares accumulated into one uint8 buffer through a reused bool buffer: adding offsets
    before rounding loses the bits that decide near-ties, and torch.bucketize or a byte lookup
    table measured 3-8x slower on CPU than this.
    """
    code = (mag > _FP4_THRESHOLDS[0][0]).view(torch.uint8)
    buf = torch.empty_like(mag, dtype=torch.bool)
    for threshold, strict in _FP4_THRESHOLDS[1:]:
        (torch.gt if strict else torch.ge)(mag, threshold, out=buf)
        code += buf.view(torch.uint8)
    torch.signbit(signed, out=buf)
    return code.add_(buf.view(torch.uint8), alpha=8)


def fp4_encode(x: ArrayLike) -> Tensor:
    """float tensor [...] -> uint8 FP4 codes [...] (one code per byte; see `pack_fp4`)."""
    x = _values(x)
    return _fp4_codes(x.abs(), x)


def _fp4_table(device: torch.device) -> Tensor:
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # [16]: code -> value (code 8 is -0.0)


def _fp4_pair_table(device: torch.device) -> Tensor:
    t = _fp4_table(device)
    b = torch.arange(256, device=device)
    return torch.stack([t[b & 15], t[b >> 4]], dim=-1)  # [256, 2]: byte -> (even, odd) channel values


def fp4_decode(codes: ArrayLike) -> Tensor:
    """uint8 FP4 codes [...] (low 4 bits used) -> float32 values [...]."""
    codes = _as_tensor(codes)
    return _lookup(_fp4_table(codes.device), codes & 15)


def pack_fp4(codes: ArrayLike) -> Tensor:
    """uint8 codes [..., D] (D even) -> packed bytes [..., D/2]; channel 2i in the low nibble."""
    codes = _as_tensor(codes)
    assert codes.shape[-1] % 2 == 0, f"FP4 packing needs an even channel count, got {codes.shape[-1]}"
    return _pack_codes(codes & 15)


def _pack_codes(codes: Tensor) -> Tensor:
    return torch.add(codes[..., 0::2], codes[..., 1::2], alpha=16)  # codes already in 0..15


def unpack_fp4(packed: ArrayLike) -> Tensor:
    """packed bytes [..., D/2] -> uint8 codes [..., D]."""
    packed = _as_tensor(packed)
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def decode_packed_fp4(packed: ArrayLike) -> Tensor:
    """packed bytes [..., D/2] -> float32 [..., D] in one table lookup per byte."""
    packed = _as_tensor(packed)
    return _lookup(_fp4_pair_table(packed.device), packed).flatten(-2)


def _lookup(table: Tensor, idx: Tensor) -> Tensor:
    """table[idx] for a byte index; index_select measured ~1.5x faster than advanced indexing."""
    return table.index_select(0, idx.reshape(-1).long()).reshape(*idx.shape, *table.shape[1:])


def e4m3_encode(x: ArrayLike, saturate: bool = True) -> Tensor:
    """float tensor -> uint8 E4M3 bytes (float8_e4m3fn bit patterns). See the module docstring."""
    x = _values(x)
    # Clamp before the cast: torch versions differ on overflow (older ones produce NaN, newer ones
    # saturate), so the cast never sees a value it could disagree about. clamp keeps NaN.
    out = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_code = torch.where(torch.signbit(x), 0xFF, 0x7F).to(torch.uint8)
    bad = torch.isnan(x)
    if not saturate:
        bad |= x.abs() > 464.0  # 464 is the tie between 448 and the NaN pattern; it rounds to 448
    return torch.where(bad, nan_code, out)


def e4m3_decode(b: ArrayLike) -> Tensor:
    """uint8 E4M3 bytes -> float32."""
    b = _as_tensor(b)
    return b.contiguous().view(torch.float8_e4m3fn).float()


def ue8m0_encode(amax: ArrayLike, qmax: float) -> Tensor:
    """Per-group amax -> UE8M0 byte of the scale `2^ceil(log2(amax / qmax))` (exponent + 127)."""
    amax = _values(amax)
    v = (amax / qmax).clamp(min=2.0**-127)
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1): exact, unlike log2
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two needs no rounding up
    exp = torch.where(torch.isinf(v), 127, exp)  # frexp(inf) reports exponent 0
    byte = (exp.clamp(-127, 127) + 127).to(torch.uint8)
    return torch.where(torch.isnan(v), UE8M0_NAN, byte).to(torch.uint8)


def _ue8m0_table(device: torch.device) -> Tensor:
    vals = [math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan]
    return torch.tensor(vals, dtype=torch.float32, device=device)  # powers of two: exact in float32


def ue8m0_decode(b: ArrayLike) -> Tensor:
    """UE8M0 bytes -> float32 scales 2^(b-127); 0xFF -> NaN."""
    b = _as_tensor(b)
    return _lookup(_ue8m0_table(b.device), b)


def _grouped(x: Tensor, group: int) -> Tensor:
    assert x.shape[-1] % group == 0, f"last dim {x.shape[-1]} is not a multiple of the group {group}"
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _blockwise(
    fn: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor, out_dims: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Apply a row-wise quantizer to x [..., D], in cache-sized row blocks when on CPU."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    step = max(1, _CPU_BLOCK_ELEMENTS // max(d, 1))
    if x.device.type != "cpu" or n <= step:
        a, b = fn(rows)
    else:
        a = torch.empty(n, out_dims[0], dtype=torch.uint8)
        b = torch.empty(n, out_dims[1], dtype=torch.uint8)
        for i in range(0, n, step):
            a[i : i + step], b[i : i + step] = fn(rows[i : i + step])
    return a.reshape(*lead, out_dims[0]), b.reshape(*lead, out_dims[1])


def quantize_main_kv(x: ArrayLike, group: int = MAIN_KV_GROUP) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (packed FP4 [..., D/2] uint8, E4M3 scales [..., D/group] uint8)."""
    x = _values(x)

    def rows(r: Tensor) -> tuple[Tensor, Tensor]:
        g = _grouped(r, group)  # [n, D/group, group]
        a = g.abs()
        amax = a.amax(dim=-1).clamp(min=MAIN_KV_AMAX_FLOOR)  # NaN propagates into the scale
        s_byte = e4m3_encode(amax / FP4_MAX)
        mag = a.div_(e4m3_decode(s_byte).unsqueeze(-1))  # divided by the *rounded* scale
        return _pack_codes(_fp4_codes(mag, g).flatten(-2)), s_byte

    return _blockwise(rows, x, (x.shape[-1] // 2, x.shape[-1] // group))


def dequantize_main_kv(packed: ArrayLike, scales: ArrayLike, group: int = MAIN_KV_GROUP) -> Tensor:
    """(packed FP4 [..., D/2], E4M3 scales [..., D/group]) -> float32 [..., D]."""
    v = decode_packed_fp4(packed)
    s = e4m3_decode(scales)
    return (_grouped(v, group) * s.unsqueeze(-1)).flatten(-2)


def quantize_fp4_ue8m0(x: ArrayLike, group: int = UE8M0_GROUP) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (packed FP4 [..., D/2] uint8, UE8M0 scales [..., D/group] uint8)."""
    x = _values(x)

    def rows(r: Tensor) -> tuple[Tensor, Tensor]:
        g = _grouped(r, group)
        a = g.abs()
        s_byte = ue8m0_encode(a.amax(dim=-1), FP4_MAX)
        mag = a.div_(ue8m0_decode(s_byte).unsqueeze(-1))
        top = _finite_max(s_byte, FP4_MAX, _FP4_TOP_SCALE_BYTE, _FP4_TOP_SCALE_MAX)
        if top is not None:  # FP4 codes saturate at FP4_MAX by themselves
            mag.clamp_(max=top)
        return _pack_codes(_fp4_codes(mag, g).flatten(-2)), s_byte

    return _blockwise(rows, x, (x.shape[-1] // 2, x.shape[-1] // group))


def dequantize_fp4_ue8m0(packed: ArrayLike, scales: ArrayLike, group: int = UE8M0_GROUP) -> Tensor:
    """(packed FP4 [..., D/2], UE8M0 scales [..., D/group]) -> float32 [..., D]."""
    v = decode_packed_fp4(packed)
    return (_grouped(v, group) * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2)


def quantize_fp8_ue8m0(x: ArrayLike, group: int = UE8M0_GROUP) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (E4M3 values [..., D] uint8, UE8M0 scales [..., D/group] uint8)."""
    x = _values(x)

    def rows(r: Tensor) -> tuple[Tensor, Tensor]:
        g = _grouped(r, group)
        s_byte = ue8m0_encode(g.abs().amax(dim=-1), E4M3_MAX)
        y = (g / ue8m0_decode(s_byte).unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
        top = _finite_max(s_byte, E4M3_MAX, _E4M3_TOP_SCALE_BYTE, _E4M3_TOP_SCALE_MAX)
        if top is not None:
            y.clamp_(-top, top)
        # |y| <= 448 by construction, and a NaN here means the group's scale byte is already the
        # NaN byte, so the cast needs none of e4m3_encode's special-value handling.
        return y.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2), s_byte

    return _blockwise(rows, x, (x.shape[-1], x.shape[-1] // group))


def _finite_max(s_byte: Tensor, qmax: float, top_byte: int, top_max: float) -> Tensor | None:
    """Per group ([..., groups, 1]), the largest magnitude to encode: qmax, or at the largest
    scale of a finite amax the largest grid value that decodes finite (see _E4M3_TOP_SCALE_BYTE).
    None (no clamp needed) where no group has that scale, checked on CPU only (on a GPU the check
    would wait for the device): the per-group clamp made fp8's encode ~1.5x slower on CPU."""
    if s_byte.device.type == "cpu" and not bool((s_byte == top_byte).any()):
        return None
    return torch.where(s_byte == top_byte, top_max, qmax).unsqueeze(-1)


def dequantize_fp8_ue8m0(values: ArrayLike, scales: ArrayLike, group: int = UE8M0_GROUP) -> Tensor:
    """(E4M3 values [..., D], UE8M0 scales [..., D/group]) -> float32 [..., D]."""
    v = e4m3_decode(values)
    return (_grouped(v, group) * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2)
