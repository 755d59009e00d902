"""Replay quality: how far a bounded or exact replay of the encoder local state is from the truth.

For each prefix length H (a multiple of the chunk size) the reference model prefills H random
tokens cold: that gives the cached global chunks and the true local snapshot (the full
recompute). Then, per replay mode, it rebuilds the snapshot from the cached chunks and the
replayed tokens, and measures
- per encoder layer, the relative error of the rebuilt SWA rows (dequantized, Frobenius norm),
  the largest absolute error, and whether the snapshot is bit-identical;
- downstream: a request that resumes at H with `suffix_tokens` new tokens, then 16 greedy decode
  steps. The true path (resumed from the true snapshot; a test shows it equals one-go
  processing) picks the tokens; the replayed path is fed the same tokens (teacher forcing) so the
  two distributions are compared at the same positions: mean/max KL(true || replayed) and top-1
  agreement;
- that the cached global rows are byte-identical after the replay and after the resume.
A second pass repeats everything with sharpened attention (query weights scaled up), because with
random weights attention is diffuse and truncation errors would look smaller than they are.

This module knows the model's public operations only; it does no I/O besides progress lines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from replay.reference.cache import decode_snapshot
from replay.reference.config import ModelConfig
from replay.reference.model import ModelState, ReferenceModel, ReplayMode

MODES: tuple[ReplayMode, ...] = ("bounded", "exact")


@dataclass(frozen=True)
class QualityConfig:
    sizes: tuple[int, ...] = (128, 1024, 4096)
    suffix_tokens: int = 32
    generate_tokens: int = 16
    sharpness: float = 4.0  # query-weight multiplier of the sharpened variant; <= 1 skips it
    seed: int = 0
    window: int = 128
    chunk_tokens: int = 128
    device: str | None = None


def _teacher_forced(model: ReferenceModel, state: ModelState, tokens: Sequence[int]) -> list[torch.Tensor]:
    """Logits before each of `tokens`, feeding each in turn."""
    out = [state.logits.clone()]
    for tok in tokens[:-1]:
        out.append(model.decode_step(state, tok).clone())
    return out


def _compare_logits(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    p = torch.stack(ref).double().log_softmax(-1)  # [steps, vocab]
    q = torch.stack(got).double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = (p.argmax(-1) == q.argmax(-1)).double()
    return {
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(agree.mean()),
        "logit_max_abs_diff": float((torch.stack(ref) - torch.stack(got)).abs().max()),
    }


def measure_prefix(model: ReferenceModel, tokens: Sequence[int], prefix: int, qc: QualityConfig) -> dict[str, Any]:
    """All figures for one prefix length; `tokens` holds at least prefix + suffix_tokens ids."""
    cfg = model.cfg
    request = list(tokens[: prefix + qc.suffix_tokens])
    cold = model.prefill(request[:prefix])
    payloads = cold.chunk_payloads
    assert cold.snapshot is not None and cold.boundary == prefix
    payload_copy = [bytes(p) for p in payloads]
    truth = decode_snapshot(cfg, cold.snapshot, prefix, model.device)

    true_resume = model.prefill(request, payloads, cold.snapshot)
    one_go = model.prefill(request)
    state = true_resume.state
    true_logits = [state.logits.clone()]
    greedy: list[int] = []
    for _ in range(qc.generate_tokens):
        greedy.append(int(state.logits.argmax()))
        model.decode_step(state, greedy[-1])
        true_logits.append(state.logits.clone())
    true_logits = true_logits[: qc.generate_tokens]

    out: dict[str, Any] = {
        "prefix_tokens": prefix,
        "warm_equals_one_go": bool(torch.equal(true_resume.logits, one_go.logits)),
        "replay_tokens": {},
    }
    unchanged = True
    for mode in MODES:
        span = model.replay_span(prefix, mode)
        t0 = time.perf_counter()
        snap = model.replay(request[span.start : prefix], span, payloads)
        replay_ms = (time.perf_counter() - t0) * 1e3
        rebuilt = decode_snapshot(cfg, snap, prefix, model.device)
        rel, exact, max_abs = [], [], 0.0
        for t_rows, r_rows in zip(truth, rebuilt, strict=True):
            diff = (r_rows.values - t_rows.values).double()
            rel.append(float(diff.norm() / t_rows.values.double().norm().clamp(min=1e-30)))
            exact.append(bool(torch.equal(r_rows.raw, t_rows.raw)))
            max_abs = max(max_abs, float(diff.abs().max()) if diff.numel() else 0.0)
        resumed = model.prefill(request, payloads, snap)
        got = _teacher_forced(model, resumed.state, greedy)
        unchanged &= payloads == payload_copy and resumed.chunk_payloads[: len(payloads)] == payload_copy
        out["replay_tokens"][mode] = len(span)
        out[mode] = {
            "layer_rel_err": rel, "layer_exact": exact, "layer0_exact": exact[0], "bit_exact": all(exact),
            "max_abs_err": max_abs, "replay_ms": round(replay_ms, 3), **_compare_logits(true_logits, got),
        }
    out["global_rows_unchanged"] = unchanged
    return out


def _aggregate(by_prefix: dict[str, dict[str, Any]]) -> dict[str, Any]:
    runs = list(by_prefix.values())
    agg: dict[str, Any] = {
        "global_rows_unchanged": all(r["global_rows_unchanged"] for r in runs),
        "warm_equals_one_go": all(r["warm_equals_one_go"] for r in runs),
    }
    for mode in MODES:
        ms = [r[mode] for r in runs]
        agg[mode] = {
            # worst case over the prefix lengths
            "layer_rel_err": [max(vals) for vals in zip(*(m["layer_rel_err"] for m in ms), strict=True)],
            "layer0_exact": all(m["layer0_exact"] for m in ms),
            "bit_exact": all(m["bit_exact"] for m in ms),
            "max_abs_err": max(m["max_abs_err"] for m in ms),
            "kl_mean": max(m["kl_mean"] for m in ms),
            "kl_max": max(m["kl_max"] for m in ms),
            "top1_agreement": min(m["top1_agreement"] for m in ms),
        }
    return agg


def _one_variant(
    mcfg: ModelConfig, qc: QualityConfig, tokens: list[int], progress: Callable[[str], None]
) -> dict[str, Any]:
    model = ReferenceModel(mcfg, qc.device)
    by_prefix = {}
    for size in qc.sizes:
        progress(f"sharpness {mcfg.attn_sharpness:g}: prefix {size} tokens")
        by_prefix[str(size)] = measure_prefix(model, tokens, size, qc)
    return {**_aggregate(by_prefix), "by_prefix": by_prefix, "device": str(model.device)}


def run_quality(qc: QualityConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The full report as a JSON-ready dict (see the module docstring)."""
    mcfg = ModelConfig(window=qc.window, chunk_tokens=qc.chunk_tokens, seed=qc.seed)
    for size in qc.sizes:
        if size <= 0 or size % mcfg.chunk_tokens:
            raise ValueError(f"prefix size {size} is not a positive multiple of the chunk size {mcfg.chunk_tokens}")
    gen = torch.Generator().manual_seed(qc.seed + 1)
    tokens = torch.randint(0, mcfg.vocab_size, (max(qc.sizes) + qc.suffix_tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    base = _one_variant(mcfg, qc, tokens, progress)
    report: dict[str, Any] = {
        "model": mcfg.layout().name, "window": mcfg.window, "encoder_layers": mcfg.n_encoder_layers,
        "exact_replay_tokens": mcfg.exact_replay_tokens, "seed": qc.seed, "device": base.pop("device"),
        "prefixes": list(qc.sizes), "suffix_tokens": qc.suffix_tokens, "generate_tokens": qc.generate_tokens,
        **base,
    }
    if qc.sharpness > 1:
        sharp = _one_variant(replace(mcfg, attn_sharpness=qc.sharpness), qc, tokens, progress)
        sharp.pop("device")
        report["sharpened"] = {"attn_sharpness": qc.sharpness, **sharp}
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    assert all(math.isfinite(x) for x in report["bounded"]["layer_rel_err"])
    return report
