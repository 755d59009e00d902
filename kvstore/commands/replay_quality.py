"""`kvstore replay-quality`: bounded vs exact replay error on the reference CED model.

Prints a table (or `--json`) of per-layer SWA-row error, downstream KL and top-1 agreement over
the next greedy tokens, and whether cached global rows stayed byte-identical; see
`replay/reference/quality.py` for what each figure means. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from kvstore.bench.flags import count, finite
from kvstore.commands.json_out import dump_json
from kvstore.config.replay import MAX_THREADS
from kvstore.errors import InvalidInput

# Bounds checked as the flags are parsed, before torch loads: the model runs the whole prefix at once
# (32,768 tokens and 4,096 more took ~0.9 GB and 30 s on a 2-core machine); much larger ones ran
# out of memory with a traceback.
MAX_PREFIX_TOKENS = 32_768
MAX_NEW_TOKENS = 4_096
# Beyond this the sharpened attention is one-hot already; from ~1e37 the query weights overflow
# float32, and every figure was NaN (written as NaN, which JSON does not have).
MAX_SHARPNESS = 1e6
# torch's seeds are 64-bit: a larger one failed as "Overflow when unpacking long long", naming no flag.
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be integers, got '{text}'") from None
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one prefix size")
    if any(not 0 < s <= MAX_PREFIX_TOKENS for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be 1 to {MAX_PREFIX_TOKENS:,} tokens, got '{text}'")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--sizes", type=_sizes, default=(128, 1024, 4096), metavar="N[,N...]",
        help=f"prefix lengths in tokens, multiples of the chunk size, at most {MAX_PREFIX_TOKENS:,} "
             "(default: 128,1024,4096)",
    )
    parser.add_argument("--sharpness", type=finite(-math.inf, MAX_SHARPNESS), default=4.0,
                        help=f"query-weight multiplier of the sharpened variant, at most {MAX_SHARPNESS:g}; <= 1 "
                             "skips it (default: 4)")
    parser.add_argument("--suffix-tokens", type=count(1, MAX_NEW_TOKENS), default=32,
                        help=f"new tokens after the hit, 1 to {MAX_NEW_TOKENS:,} (default: 32)")
    parser.add_argument("--generate-tokens", type=count(1, MAX_NEW_TOKENS), default=16,
                        help=f"greedy tokens compared, 1 to {MAX_NEW_TOKENS:,} (default: 16)")
    parser.add_argument("--seed", type=count(*SEED_RANGE), default=0,
                        help="weights and token seed, a 64-bit integer (default: 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch intra-op CPU threads (default 0: 1 per 4 CPUs, 1 to 4: the model's matrices are so small "
             "that a second thread mostly waits, measured 8x slower on a busy 2-core machine)",
    )


def run(args: argparse.Namespace) -> int:
    from replay.reference.quality import QualityConfig, run_quality
    from replay.threads import use_threads

    if not 0 <= args.threads <= MAX_THREADS:  # torch's thread pool crashed the process beyond it
        raise InvalidInput(f"--threads must be 0 (auto) to {MAX_THREADS}, got {args.threads}")
    use_threads(args.threads)
    qc = QualityConfig(
        sizes=args.sizes, suffix_tokens=args.suffix_tokens, generate_tokens=args.generate_tokens,
        sharpness=args.sharpness, seed=args.seed, device=args.device,
    )
    try:
        report = run_quality(qc, progress=lambda msg: print(f"replay-quality: {msg}", file=sys.stderr))
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    if args.json:
        dump_json(report, sys.stdout)
    else:
        _print_table(report)
    return 0


def _fmt_errs(errs: list[float]) -> str:
    return " ".join(f"{e:.3f}" for e in errs)


def _print_variant(title: str, v: dict[str, Any]) -> None:
    print(title)
    print(f"  {'prefix':>7} {'mode':8} {'replayed':>8}  {'SWA rel. error by layer':28} {'bit-exact':9} "
          f"{'KL mean':>9} {'top-1':>6}")
    for size, r in v["by_prefix"].items():
        for mode in ("bounded", "exact"):
            m = r[mode]
            print(f"  {size:>7} {mode:8} {r['replay_tokens'][mode]:>8}  {_fmt_errs(m['layer_rel_err']):28} "
                  f"{'yes' if m['bit_exact'] else 'no':9} {m['kl_mean']:>9.2e} {m['top1_agreement']:>6.2f}")
    b, e = v["bounded"], v["exact"]
    yes = {True: "yes", False: "NO"}
    print(f"  bounded: layer 0 exact: {yes[b['layer0_exact']]}; exact: max |err| {e['max_abs_err']:.3g}; "
          f"global rows unchanged: {yes[v['global_rows_unchanged']]}; "
          f"warm resume == one go: {yes[v['warm_equals_one_go']]}")


def _print_table(report: dict[str, Any]) -> None:
    print(f"replay quality on {report['model']} (W={report['window']}, {report['encoder_layers']} encoder layers, "
          f"exact replay {report['exact_replay_tokens']} tokens, device {report['device']})")
    print(f"downstream: {report['suffix_tokens']} new tokens, then {report['generate_tokens']} greedy steps "
          "compared with the true path (KL(true||replayed), top-1 agreement)")
    _print_variant("random weights", report)
    if "sharpened" in report:
        _print_variant(f"sharpened attention (query weights x{report['sharpened']['attn_sharpness']:g})",
                       report["sharpened"])
    print(f"({report['elapsed_s']} s)")
