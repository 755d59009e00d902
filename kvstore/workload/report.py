"""Tables and the cliff plot for `kvstore bench workload`.

Role: format a run's summary (`RunResult.summary()`) and a sweep (`SweepResult`) as Markdown
tables, as the JSON pieces of the output contract, and draw the cliff as a PNG. matplotlib is an
optional extra (`pip install 'kvstore[plot]'`); it is imported only when a plot is asked for, and
its absence is a clear error, not a traceback.

What it does not know: how the figures were produced, or where they are printed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidInput
from kvstore.workload.sweep import SweepResult, format_bytes

SMALL_SAMPLE = 100  # fewer samples than this: a p99 is printed as "n<100", not as a precise value


def _ms(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"


def _num(v: float | None, fmt: str = ",.0f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _p99(v: float | None, n: int) -> str:
    """A 99th percentile, or "n<100" where fewer samples than that make it the largest one or two."""
    return "n<100" if v is not None and n < SMALL_SAMPLE else _ms(v)


def cases_table(s: dict[str, Any]) -> str:
    """Per case: requests, share and TTFT. In live mode the TTFT is the cost model's (modelled, on
    what the live service answered) and says so; the measured Resume wall times follow, apart."""
    live = s.get("mode") == "live"
    ttft = "modelled TTFT" if live else "TTFT"
    rows = [f"| case | requests | share | {ttft} p50 (ms) | {ttft} p99 (ms) |", "|---|---:|---:|---:|---:|"]
    for name in ("cold", "warm", "expired"):
        c = s["cases"][name]
        rows.append(f"| {name} | {c['count']:,} | {c['share']:.1%} | {_ms(c['ttft_p50_ms'])} | "
                    f"{_p99(c['ttft_p99_ms'], c['count'])} |")
    if live:
        rows += ["", "TTFT (live) is modelled: the timeline's queue wait + the cost model's time for the prefill, "
                     "replay and bytes the live service's answers called for. Measured on this machine (CPU "
                     "replay included), the Resume calls' wall time:", "",
                 "| case | Resume calls | measured Resume p50 (ms) | measured Resume p99 (ms) |",
                 "|---|---:|---:|---:|"]
        walls = s.get("counters", {}).get("live", {}).get("resume_wall_ms", {})
        for name in ("cold", "warm", "expired"):
            w = walls.get(name) or {}
            n = int(w.get("n", s["cases"][name]["count"]))
            rows.append(f"| {name} | {n:,} | {_num(w.get('p50'), ',.1f')} | "
                        f"{'n<100' if w and n < SMALL_SAMPLE else _num(w.get('p99'), ',.1f')} |")
    reasons = s.get("local_miss_reasons", {})
    if reasons:
        rows.append("")
        rows.append("Local misses by reason: " + ", ".join(f"{k} {v:,}" for k, v in reasons.items()))
    if any(0 < s["cases"][n]["count"] < SMALL_SAMPLE for n in ("cold", "warm", "expired")):
        rows += ["", "p99 over fewer than 100 requests is shown as n<100 (the JSON keeps the value)."]
    return "\n".join(rows)


def hits_table(s: dict[str, Any]) -> str:
    """Where prompt tokens came from: a tier counts only hits the engine used; recomputed is what it
    prefilled, hits loaded and thrown away (expired with replay off) included."""
    h = s["hit_rate_by_tier"]
    rows = [
        "| prompt tokens from | device | DRAM | SSD (LMDB) | recomputed |",
        "|---|---:|---:|---:|---:|",
        f"| share | {h['device']:.1%} | {h['dram']:.1%} | {h['lmdb']:.1%} | {h['miss']:.1%} |",
    ]
    unused = h.get("loaded_unused", 0.0)
    if unused > 0:
        rows += ["", f"Loaded but not usable (expired hits without a replay, then recomputed): {unused:.1%} of "
                     f"prompt tokens, counted as recomputed."]
    return "\n".join(rows)


def bills_table(s: dict[str, Any]) -> str:
    b = s["bills_per_request"]
    rows = [
        "| bill (per request) | value |", "|---|---:|",
        f"| prefill tokens avoided (the global hit, as billed) | {b['prefill_tokens_avoided']:,.0f} |",
        f"| of it used, less replay | {b['net_prefill_tokens_avoided']:,.0f} |",
        f"| prefill FLOPs avoided | {b['prefill_flops_avoided']:.3g} |",
        f"| prefill tokens still run | {b['prefill_tokens']:,.0f} |",
        f"| replay tokens | {b['replay_tokens']:,.1f} |",
        f"| HBM byte-seconds (runtime + device cache share) | {b['hbm_byte_seconds']:.3g} |",
        f"| persistent bytes written (global chunks + local snapshots) | {b['persistent_bytes']:,.0f} |",
        f"| persistent bytes loaded (DRAM, SSD, pool) | {b['persistent_bytes_loaded']:,.0f} |",
        f"| persistent byte-seconds held (DRAM, SSD) | {b['persistent_byte_seconds']:.3g} |",
        f"| local pool byte-seconds held | {b['pool_byte_seconds']:.3g} |",
    ]
    return "\n".join(rows)


def bytes_table(s: dict[str, Any]) -> str:
    p = s["persistent_bytes_per_token"]
    h = s["hbm_bytes_per_token"]
    base = s["baseline"]
    return "\n".join([
        "| bytes per token | kvstore | baseline | ratio |", "|---|---:|---:|---:|",
        f"| persistent (global + local pool, time-averaged) | {p['kvstore']:,.1f} | {p['baseline']:,.0f} | "
        f"{s['persistent_bytes_ratio_vs_baseline']:.4f} |",
        f"| persistent, global KV only | {p['kvstore_global_only']:,.1f} | "
        f"{p['baseline'] * (1 - base['swa_share']):,.0f} | – |",
        f"| HBM, device tier (layout: {s['global_bytes_per_token_layout']:,.1f}) | "
        f"{s['global_bytes_per_token']:,.1f} | – | – |",
        f"| HBM, runtime incl. local state | {_num(h['runtime_with_local_state'], ',.1f')} | – | – |",
        "",
        f"Baseline: global KV at {base['global_factor']:g}x kvstore's bytes per token, local SWA state "
        f"persisted with it (no TTL) and {base['swa_share']:.0%} of its persistent bytes.",
    ])


def throughput_line(s: dict[str, Any]) -> str:
    t = s["throughput"]
    p99 = _p99(t["queue_wait_p99_ms"], int(s.get("requests", SMALL_SAMPLE)))
    return (f"Throughput (middle 80 % of starts): {_num(t['requests_per_second'], '.3f')} req/s, "
            f"{_num(t['prompt_tokens_per_second'])} prompt tokens/s, GPU busy "
            f"{_num(t['gpu_busy_fraction'], '.0%')}; queue wait p50 {_ms(t['queue_wait_p50_ms'])} ms, "
            f"p99 {p99}{'' if p99 in ('n<100', '–') else ' ms'}.")


def run_tables(s: dict[str, Any]) -> str:
    return "\n\n".join([cases_table(s), hits_table(s), bills_table(s), bytes_table(s), throughput_line(s)])


def sweep_json(sweep: SweepResult) -> dict[str, Any]:
    """The contract's `cliff` list, plus every point of the sweep."""
    cliff = [{
        "capacity_bytes": c.capacity.device_bytes + c.capacity.dram_bytes,
        "device_capacity_bytes": c.capacity.device_bytes,
        "dram_capacity_bytes": c.capacity.dram_bytes,
        "lmdb_capacity_bytes": c.capacity.lmdb_bytes,
        "cliff_concurrency": c.cliff_concurrency,
        "peak_concurrency": c.peak_concurrency,
        "peak_requests_per_second": c.peak_requests_per_second,
    } for c in sweep.cliffs]
    points = [{
        "device_capacity_bytes": p.capacity.device_bytes, "dram_capacity_bytes": p.capacity.dram_bytes,
        "lmdb_capacity_bytes": p.capacity.lmdb_bytes, "concurrency": p.concurrency, "requests": p.requests,
        "requests_per_second": p.requests_per_second, "prompt_tokens_per_second": p.prompt_tokens_per_second,
        "gpu_busy_fraction": p.gpu_busy_fraction, "global_hit_rate": p.global_hit_rate,
        "device_hit_rate": p.device_hit_rate, "warm_share": p.warm_share, "expired_share": p.expired_share,
        "cold_share": p.cold_share, "ttft_p50_ms": p.ttft_p50_ms, "ttft_p99_ms": p.ttft_p99_ms,
    } for p in sweep.points]
    return {"cliff": cliff, "cliff_fraction": sweep.cliff_fraction, "sweep_points": points}


def cliff_table(sweep: SweepResult) -> str:
    rows = ["| device | DRAM | SSD | peak req/s | at concurrency | cliff concurrency |",
            "|---:|---:|---:|---:|---:|---:|"]
    for c in sweep.cliffs:
        cap = c.capacity
        cliff = f"{c.cliff_concurrency:,}" if c.cliff_concurrency is not None else "none in sweep"
        rows.append(f"| {format_bytes(cap.device_bytes)} | {format_bytes(cap.dram_bytes)} | "
                    f"{format_bytes(cap.lmdb_bytes) if cap.lmdb_bytes else '–'} | "
                    f"{c.peak_requests_per_second:.3f} | {c.peak_concurrency:,} | {cliff} |")
    return "\n".join(rows)


def sweep_table(sweep: SweepResult) -> str:
    rows = ["| device / DRAM | concurrency | req/s | hit rate | warm | expired | cold | TTFT p50 (ms) | "
            "TTFT p99 (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sweep.points:
        cap = p.capacity
        rows.append(
            f"| {format_bytes(cap.device_bytes)} / {format_bytes(cap.dram_bytes)} | {p.concurrency:,} | "
            f"{p.requests_per_second:.3f} | {p.global_hit_rate:.1%} | {p.warm_share:.1%} | "
            f"{p.expired_share:.1%} | {p.cold_share:.1%} | {_ms(p.ttft_p50_ms)} | {_p99(p.ttft_p99_ms, p.requests)} |")
    return "\n".join(rows)


def plot_cliff(sweep: SweepResult, path: str | Path, title: str = "") -> Path:
    """Throughput and hit rate against concurrency, one line per capacity, the cliffs marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInput(
            "--plot needs matplotlib, an optional extra: pip install 'kvstore[plot]'") from None
    out = Path(path)
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(12, 4.8))
    for cliff in sweep.cliffs:
        pts = sorted((p for p in sweep.points if p.capacity == cliff.capacity), key=lambda p: p.concurrency)
        xs = [p.concurrency for p in pts]
        (line,) = ax_t.plot(xs, [p.requests_per_second for p in pts], marker="o", label=cliff.capacity.label)
        ax_h.plot(xs, [p.global_hit_rate for p in pts], marker="o", color=line.get_color(),
                  label=cliff.capacity.label)
        ax_t.axhline(sweep.cliff_fraction * cliff.peak_requests_per_second, color=line.get_color(),
                     linestyle=":", linewidth=0.8)
        if cliff.cliff_concurrency is not None:
            ax_t.axvline(cliff.cliff_concurrency, color=line.get_color(), linestyle="--", linewidth=0.8)
    ticks = sorted({p.concurrency for p in sweep.points})
    for ax in (ax_t, ax_h):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{c:,}" for c in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent sessions")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("throughput (requests/s)")
    ax_t.set_title(f"throughput; dotted: {sweep.cliff_fraction:.0%} of peak, dashed: cliff")
    ax_h.set_ylabel("prompt tokens served from cache")
    ax_h.set_ylim(0, 1)
    ax_h.set_title("cache hit rate")
    ax_h.legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
