"""`kvstore layout show NAME [--json]`: a model's cache layout and its capacity arithmetic."""

from __future__ import annotations

import argparse
import json

from kvstore.config.store import MAX_CHUNK_TOKENS
from kvstore.errors import InvalidInput
from kvstore.layout import CacheLayout, get_model, model_names

# The baseline for "persisted bytes per token": a policy that also persists the local SWA state
# once per chunk boundary (what a cache without a separate local pool keeps), amortised per token.


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="layout_cmd", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print one layout")
    show.add_argument("name", help=f"model or layout name: {', '.join(model_names())}")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("--chunk-tokens", type=int, default=None, help="override the chunk size")
    sub.add_parser("list", help="list the known layouts")


def describe(layout: CacheLayout) -> dict[str, object]:
    per_token = layout.global_bytes_per_token
    local_per_token = layout.local_snapshot_bytes / layout.chunk_tokens
    return {
        "name": layout.name,
        "layout_id": layout.layout_id.hex(),
        "global_bytes_per_token": per_token,
        "local_snapshot_bytes": layout.local_snapshot_bytes,
        "chunk_tokens": layout.chunk_tokens,
        "chunk_bytes": layout.chunk_bytes,
        "bytes_per_million_tokens": int(per_token * 1_000_000),
        "persisted_bytes_per_token": per_token,
        "persisted_bytes_per_token_with_local": per_token + local_per_token,
        "groups": [
            {"name": g.name, "layers": [g.layers[0], g.layers[-1]], "ratio": g.ratio,
             "record_bytes": g.record_bytes}
            for g in layout.groups
        ],
        "local": {
            "row_bytes": layout.local.row_bytes,
            "window_tokens": layout.local.window_tokens,
            "persisted_layers": list(layout.local.persisted_layers),
        },
        "encoder_layers": layout.encoder_layers,
    }


def run(args: argparse.Namespace) -> int:
    if args.layout_cmd == "list":
        for name in model_names():
            lay = get_model(name).layout
            print(f"{name:24s} {lay.global_bytes_per_token:>10,.1f} B/token  chunk {lay.chunk_bytes:,} B")
        return 0
    layout = get_model(args.name).layout
    if args.chunk_tokens is not None:
        if not 0 < args.chunk_tokens <= MAX_CHUNK_TOKENS or args.chunk_tokens % 8:
            raise InvalidInput(f"--chunk-tokens must be a positive multiple of 8, at most {MAX_CHUNK_TOKENS:,} "
                               f"(store.chunk_tokens' bound), got {args.chunk_tokens:,}")
        layout = layout.with_chunk_tokens(args.chunk_tokens)
    d = describe(layout)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"layout {d['name']} (id {d['layout_id']})")
    for g in layout.groups:
        print(f"  group {g.name:8s} layers {g.layers[0]}-{g.layers[-1]:<3d} ratio {g.ratio}  "
              f"record {g.record_bytes} B -> {g.record_bytes / g.ratio:g} B/token")
    print(f"  global KV per token        {layout.global_bytes_per_token:,.1f} B")
    print(f"  one million tokens         {int(layout.global_bytes_per_token * 1e6):,} B "
          f"({layout.global_bytes_per_token * 1e6 / 1e9:.2f} GB)")
    print(f"  chunk                      {layout.chunk_tokens} tokens = {layout.chunk_bytes:,} B")
    print(f"  local snapshot (SWA)       {layout.local_snapshot_bytes:,} B "
          f"({len(layout.local.persisted_layers)} layers x {layout.local.window_tokens} rows x "
          f"{layout.local.row_bytes} B)")
    print(f"  persisted per token        {d['persisted_bytes_per_token']:,.1f} B (kvstore: global only)")
    print(f"  ... if local state were persisted at every chunk boundary: "
          f"{d['persisted_bytes_per_token_with_local']:,.1f} B")
    return 0
