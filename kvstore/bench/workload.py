"""`kvstore bench workload`: the agentic workload benchmark, its three bills, the ⅛ claim and the cliff.

Modes:
- `--mode simulated` (default): the workload against byte-accounting models of the store, pool and
  replay with the real policies, in simulated time (`kvstore.workload.simulator`);
- `--mode live`: the same workload and timeline against the real service, self-started in process
  with a simulated clock, or a running one (`--target`), through `kvstore.client.sync_client`
  (`kvstore.workload.live`).
`--sweep` adds the cliff: throughput against concurrency for several device/DRAM capacities
(simulated). `--plot FILE` draws it (matplotlib, the `plot` extra). `--markdown FILE` writes the
tables; the `bench` dispatcher prints them on stdout (progress goes to stderr).

What it does not know: how a run works (kvstore.workload) or how the result is printed (the
`bench` dispatcher prints the returned dict, as JSON with `--json`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from kvstore.bench.flags import count, finite, seconds, writable_file
from kvstore.config.local_pool import MAX_TTL_SECONDS, TtlPolicyConfig
from kvstore.errors import InvalidInput
from kvstore.workload import report
from kvstore.workload.costmodel import CostModel, parse_cost_overrides
from kvstore.workload.generator import SEED_LIMIT, WorkloadSpec, generate
from kvstore.workload.results import Baseline
from kvstore.workload.simulator import SimConfig, simulate, stderr_progress
from kvstore.workload.sweep import (
    DEFAULT_SWEEP_CAPACITIES,
    DEFAULT_SWEEP_CONCURRENCY,
    MAX_SWEEP_CONCURRENCY,
    Capacity,
    parse_capacities,
    parse_concurrencies,
    parse_size,
    run_sweep,
)
from kvstore.workload.thinktime import DEFAULT_THINK_TIME
from kvstore.workload.tracing import run_trace, write_trace

_SIM = SimConfig()
_W = WorkloadSpec()
# Scale differs by mode: the simulated mode runs a GPU's worth of long sessions in seconds; the live
# mode moves every byte through the service, so its defaults are small.
_SCALE_FLAGS = {
    "sessions": "sessions in total",
    "concurrency": "sessions running at once; 0: all",
    "turns": "turns per session",
    "context-tokens": "prompt tokens of a session's last turn",
    "system-tokens": "each tenant's shared system prompt",
    "output-tokens": "tokens generated per turn",
}
_SCALE_DEFAULTS: dict[str, dict[str, int]] = {
    "simulated": {"sessions": 256, "concurrency": 64, "turns": _W.turns, "context-tokens": _W.context_tokens,
                  "system-tokens": _W.system_tokens, "output-tokens": _W.output_tokens},
    "live": {"sessions": 16, "concurrency": 8, "turns": 6, "context-tokens": 8_192, "system-tokens": 1_024,
             "output-tokens": 128},
}


# Bounds on the scale flags, checked as parsed: the run is held in memory whole (100,000 sessions of
# 12 turns took ~1.9 GB; ten times that ran out of memory with a traceback). Zero, where the
# workload cannot take it, is said by the workload itself.
_SCALE_MOST = {"sessions": 100_000, "concurrency": MAX_SWEEP_CONCURRENCY, "turns": 10_000, "context-tokens": 1 << 24,
               "system-tokens": 1 << 24, "output-tokens": 1 << 20}


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("simulated", "live"), default="simulated",
                   help="simulated: byte models in simulated time (default); live: the real service")
    p.add_argument("--model", default=None,
                   help="model layout (default: deepseek-v4.1-flash simulated, reference-toy-8 live)")
    w = p.add_argument_group("workload (defaults: simulated / live)")
    for flag, help_text in _SCALE_FLAGS.items():
        sim, live = _SCALE_DEFAULTS["simulated"][flag], _SCALE_DEFAULTS["live"][flag]
        w.add_argument(f"--{flag}", type=count(0, _SCALE_MOST[flag]), default=None,
                       help=f"{help_text} (default {sim:,} / {live:,})")
    # The workload's own checks name its fields (tenant_skew); these name the flags, as parsed.
    w.add_argument("--tenants", type=count(1, _SCALE_MOST["sessions"]), default=_W.tenants,
                   help=f"tenants, at most --sessions (default {_W.tenants})")
    # Any finite exponent runs (past ~100 every session is the largest tenant's already); a bound
    # only to keep it finite.
    w.add_argument("--tenant-skew", type=finite(0.0, 1e6), default=_W.tenant_skew,
                   help="Zipf exponent of tenant sizes (default 1; 0: equal)")
    w.add_argument("--think-time", default=DEFAULT_THINK_TIME,
                   help=f"think-time mixture, e.g. '{DEFAULT_THINK_TIME}' (seconds; kinds: fixed(s), "
                        "exp(mean), lognormal(median,sigma), uniform(lo,hi))")
    w.add_argument("--ramp-seconds", type=seconds(), default=_W.ramp_seconds,
                   help="the first sessions start uniformly over this many seconds (default 60)")
    w.add_argument("--seed", type=count(0, SEED_LIMIT - 1), default=0, help="workload seed (default 0)")
    d = p.add_argument_group("deployment (simulated; live self-started service)")
    d.add_argument("--device-capacity-bytes", type=_size, default=None,
                   help="HBM for KV: runtime KV of requests in flight + device tier (default 32GiB; live 256MiB)")
    d.add_argument("--dram-capacity-bytes", type=_size, default=None, help="DRAM tier (default 256GiB; live 1GiB)")
    d.add_argument("--lmdb-capacity-bytes", type=_size, default=None, help="SSD tier (default 4TiB; live 16GiB)")
    d.add_argument("--pool-capacity-bytes", type=_size, default=None, help="local pool (default 8GiB; live 512MiB)")
    d.add_argument("--local-ttl-seconds", type=finite(0.0, MAX_TTL_SECONDS, "seconds", above=True), default=300.0,
                   help="local snapshot TTL (default 300)")
    d.add_argument("--ttl-policy", choices=("fixed", "sliding", "adaptive"), default="fixed",
                   help="local TTL policy (default fixed)")
    d.add_argument("--replay-mode", choices=("bounded", "exact", "off"), default="bounded",
                   help="bounded: W=128 tokens; exact: L(W-1)+1; off: recompute (default bounded)")
    d.add_argument("--eviction-policy", choices=("lru", "s3fifo", "cost-aware"), default=_SIM.eviction_policy)
    d.add_argument("--admission-policy", choices=("always", "second-sighting"), default=_SIM.admission_policy)
    d.add_argument("--write-policy", choices=("write-through", "write-back"), default=_SIM.write_policy)
    d.add_argument("--page-bytes", type=_size, default=0,
                   help="model the arenas' page rounding (e.g. 16KiB; default 0: exact payload bytes)")
    # At most the chunks of the longest context (--context-tokens' bound, 1-token chunks).
    d.add_argument("--block-chunks", type=count(0, _SCALE_MOST["context-tokens"]), default=0,
                   help="chunks per eviction key in the simulation (default 0: 1 where affordable)")
    d.add_argument("--no-hbm-sharing", action="store_true",
                   help="do not shrink the device tier by the runtime KV of requests in flight")
    d.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TTFT cost-model parameter, e.g. dram_bandwidth_bytes_per_second=25e9")
    d.add_argument("--baseline-global-factor", type=finite(0.0, 1e6, above=True), default=Baseline.global_factor,
                   help="baseline global KV bytes/token over kvstore's (default 4)")
    d.add_argument("--baseline-swa-share", type=finite(0.0, 1.0, below=True), default=Baseline.swa_share,
                   help="SWA share of the baseline's persistent bytes (default 0.5)")
    s = p.add_argument_group("cliff sweep (simulated)")
    s.add_argument("--sweep", action="store_true", help="also sweep concurrency x capacity for the cliff")
    s.add_argument("--sweep-concurrency", default=",".join(map(str, DEFAULT_SWEEP_CONCURRENCY)),
                   help="concurrencies (default %(default)s)")
    s.add_argument("--sweep-capacities", default=",".join(
        f"{c[0] >> 30}GiB:{c[1] >> 30}GiB" for c in DEFAULT_SWEEP_CAPACITIES),
        help="DEVICE:DRAM[:SSD] points (default %(default)s)")
    s.add_argument("--sweep-lmdb-capacity-bytes", type=_size, default=0,
                   help="SSD tier for sweep points that name none (default 0: the in-memory tiers' cliff)")
    s.add_argument("--sweep-full", action="store_true", help="keep sweeping past a capacity's cliff")
    o = p.add_argument_group("output")
    # Checked as parsed: written after the run (or the whole sweep), a bad path cost all its time.
    o.add_argument("--plot", type=writable_file(make_parents=True), default=None, metavar="FILE",
                   help="save the cliff plot as PNG (needs --sweep)")
    o.add_argument("--markdown", type=writable_file(), default=None, metavar="FILE",
                   help="write the tables as Markdown")
    o.add_argument("--trace", type=writable_file(), default=None, metavar="FILE",
                   help="write the run's requests in the trace format (kvstore tune)")
    # Refused without --mode live rather than taken to mean it: the scale defaults differ by mode,
    # so `--target` alone would quietly run another workload than the simulated one asked for.
    lv = p.add_argument_group("live mode (these need --mode live; without it they are refused)")
    lv.add_argument("--target", default=None, help="HOST:PORT of a running service (default: start one)")
    lv.add_argument("--token", default=None, help="bearer token for --target")
    lv.add_argument("--time-scale", type=float, default=None,
                    help="--target only: wall seconds per simulated second (default 1)")


def _sim_config(args: argparse.Namespace, model: str) -> SimConfig:
    cost = parse_cost_overrides(CostModel(), args.cost)
    ttl = TtlPolicyConfig(kind=args.ttl_policy, ttl_seconds=args.local_ttl_seconds)
    ttl.validate("local_pool.ttl")

    def pick(v: int | None, default: int) -> int:
        return default if v is None else v

    return SimConfig(
        model=model,
        device_capacity_bytes=pick(args.device_capacity_bytes, _SIM.device_capacity_bytes),
        dram_capacity_bytes=pick(args.dram_capacity_bytes, _SIM.dram_capacity_bytes),
        lmdb_capacity_bytes=pick(args.lmdb_capacity_bytes, _SIM.lmdb_capacity_bytes),
        pool_capacity_bytes=pick(args.pool_capacity_bytes, _SIM.pool_capacity_bytes),
        eviction_policy=args.eviction_policy, admission_policy=args.admission_policy,
        write_policy=args.write_policy, page_bytes=args.page_bytes, ttl=ttl, replay_mode=args.replay_mode,
        block_chunks=args.block_chunks, hbm_shared=not args.no_hbm_sharing, cost=cost,
    )


def _workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    scale = _SCALE_DEFAULTS[args.mode]

    def get(flag: str) -> int:
        v = getattr(args, flag.replace("-", "_"))
        return scale[flag] if v is None else int(v)

    if 1 <= get("sessions") < args.tenants:  # the workload's own check names its field, `tenants`
        raise InvalidInput(f"--tenants ({args.tenants:,}) must be at most --sessions ({get('sessions'):,})")
    return WorkloadSpec(
        sessions=get("sessions"), turns=get("turns"), context_tokens=get("context-tokens"),
        system_tokens=get("system-tokens"), output_tokens=get("output-tokens"), tenants=args.tenants,
        tenant_skew=args.tenant_skew, think_time=args.think_time, concurrency=get("concurrency"),
        ramp_seconds=args.ramp_seconds, seed=args.seed,
    )


def run_workload_bench(args: argparse.Namespace) -> dict[str, Any]:
    live_only = [f for f, v in (("--target", args.target), ("--token", args.token), ("--time-scale", args.time_scale))
                 if v is not None]
    if live_only and args.mode != "live":  # else ignored: a simulated run, exit 0, nothing dialled
        raise InvalidInput(f"{', '.join(live_only)} {'is' if len(live_only) == 1 else 'are'} for --mode live "
                           "(the default, simulated mode runs no service): add --mode live")
    if args.time_scale is not None and args.target is None:  # else ignored, exit 0
        raise InvalidInput("--time-scale is for --target (a self-started service runs on a simulated clock, "
                           "no wall time to scale): add --target HOST:PORT or leave it out")
    if args.plot and not args.sweep:
        raise InvalidInput("--plot draws the cliff: add --sweep")
    if args.sweep and args.mode == "live":
        raise InvalidInput("the cliff sweep is simulated; run it with --mode simulated")
    progress = stderr_progress("bench workload")
    baseline = Baseline(args.baseline_global_factor, args.baseline_swa_share)
    spec = _workload_spec(args)
    # The sweep's flags are checked before the main run, not after it (a bad one cost its whole time).
    capacities = parse_capacities(args.sweep_capacities, args.sweep_lmdb_capacity_bytes) if args.sweep else []
    concurrencies = parse_concurrencies(args.sweep_concurrency) if args.sweep else []
    workload = generate(spec)
    if args.mode == "live":
        from kvstore.workload.live import run_live

        model = args.model or "reference-toy-8"
        result = run_live(workload, _live_options(args, model), progress, baseline)
    else:
        model = args.model or "deepseek-v4.1-flash"
        cfg = _sim_config(args, model)  # a bad --cost or TTL is said before any progress
        progress(f"simulating {workload.requests:,} requests of {spec.sessions:,} sessions "
                 f"({spec.context_tokens:,}-token contexts, {model})")
        result = simulate(workload, cfg, progress, baseline)
    out = result.summary()
    tables = [f"## {out['mode']} run: {spec.sessions:,} sessions x {spec.turns} turns, "
              f"{spec.context_tokens:,}-token contexts, {model}", report.run_tables(out)]
    if args.trace:
        n = write_trace(run_trace(result, workload), args.trace)
        progress(f"wrote {n:,} trace records to {args.trace}")
    if args.sweep:
        sweep = run_sweep(
            spec, dataclasses.replace(_sim_config(args, model), block_chunks=args.block_chunks),
            capacities, concurrencies, progress, stop_after_cliff=not args.sweep_full,
        )
        out.update(report.sweep_json(sweep))
        tables += ["## cliff", report.cliff_table(sweep), report.sweep_table(sweep)]
        if args.plot:
            path = report.plot_cliff(sweep, args.plot, title=f"{model}: {spec.turns} turns, "
                                     f"{spec.context_tokens:,}-token contexts, TTL {args.local_ttl_seconds:g} s")
            out["plot"] = str(path)
            progress(f"saved the plot to {path}")
    text = "\n\n".join(tables) + "\n"
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    out["tables"] = text  # the readable view: the dispatcher prints it on stdout (not with --json)
    return out


def _live_options(args: argparse.Namespace, model: str) -> Any:
    from kvstore.workload.live import LiveOptions

    sim = _sim_config(args, model)
    return LiveOptions(
        model=model, target=args.target, token=args.token, sim=sim,
        time_scale=1.0 if args.time_scale is None else args.time_scale,
        device_capacity_bytes=args.device_capacity_bytes, dram_capacity_bytes=args.dram_capacity_bytes,
        lmdb_capacity_bytes=args.lmdb_capacity_bytes, pool_capacity_bytes=args.pool_capacity_bytes,
    )


__all__ = ["Capacity", "add_workload_arguments", "run_workload_bench"]
