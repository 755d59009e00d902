"""`kvstore runner --connect ADDR`: run the reference CED model as a runner attached to a service.

The process dials the service, announces the model (CUDA when present, else CPU), and rebuilds
local state for the replay jobs it receives until SIGTERM or SIGINT, reconnecting with backoff
when the stream breaks. The service must serve a model whose layout is the reference model's at
the given window and chunk size (the defaults match `reference-toy-8` at 128-token chunks), and
its weights: the runner declares the model's revision (`--revision`, the reference model's "1" by
default) and `--seed` ("1+seed=0"), which must be the revision the service serves the model as (a
model of the reference's layout registered under another revision needs `--revision`) and its
`replay.reference_seed` (it refuses other weights at attach, saying which part differs).
The bearer token comes from `--token` or, better (it stays out of `ps`), `KVSTORE_TOKEN`, as for
`kvstore stats`. `--tls-ca` turns on TLS, and `--tls-cert` with `--tls-key` present a client
certificate to a service that requires one (mTLS).
Exit status: 0 when stopped by a signal, 2 when the service refused the runner (its TLS handshake
included).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

from kvstore.commands.checks import check_target, check_token
from kvstore.commands.stop_signals import stop_on_signals
from kvstore.config.replay import MAX_THREADS
from kvstore.config.store import MAX_CHUNK_TOKENS
from kvstore.errors import InvalidInput
from kvstore.layout import MAX_ENGINE_NAME
from kvstore.wire.tls_files import check_tls_ca, check_tls_client, check_tls_server_name

# A longer window asked torch for terabytes at warm-up (a traceback); 65,536 loads in ~0.8 GB.
MAX_WINDOW_TOKENS = 65_536
# What the hello's uint32 fields carry (a larger value was protobuf's ValueError, a traceback).
MAX_U32 = (1 << 32) - 1
# The seed must be the service's replay.reference_seed, a TOML (64-bit) integer; torch refuses more.
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
# Where the token is read from without --token, as `kvstore stats` reads it: /proc/PID/cmdline
# shows --token to every local user, and the admin token serves (and reads) every tenant.
TOKEN_ENV = "KVSTORE_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, metavar="ADDR",
                   help="the service's gRPC address: host:port, or unix:///PATH for its Unix socket "
                        "(same host: jobs then go through shared memory)")
    p.add_argument("--token", metavar="TOKEN",
                   help=f"bearer token: a tenant's (serves that tenant) or the admin token (serves all); "
                        f"default: ${TOKEN_ENV}, which, unlike --token, other local users cannot read in ps")
    p.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting this CA certificate (PEM)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="client certificate (PEM) for a service that requires one (mTLS); with --tls-key")
    p.add_argument("--tls-key", metavar="FILE", help="the client certificate's unencrypted key (PEM)")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the service's certificate carries, checked instead of --connect's host "
                        "(a service dialled by IP address)")
    p.add_argument("--model", metavar="NAME",
                   help="the model name the service serves it under (default: reference-toy-8, or "
                        "reference-toy-8-wW-cN for another window)")
    p.add_argument("--window", type=int, default=128, metavar="W", help="sliding window of the model (128)")
    p.add_argument("--chunk-tokens", type=int, default=128, metavar="N",
                   help="the service's chunk size in tokens (store.chunk_tokens, 128)")
    p.add_argument("--seed", type=int, default=0,
                   help="weight seed; must be the service's replay.reference_seed and the engine's (0)")
    p.add_argument("--revision", metavar="REV",
                   help="the model revision to declare; must be the one the service serves the model as "
                        "(default: the reference model's, 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="CPU threads for the model (0: 1 per 4 CPUs, 1 to 4)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="jobs run together in one batch (8)")
    p.add_argument("--max-concurrent-jobs", type=int, default=16, metavar="N",
                   help="jobs the service may queue here at once (16)")
    p.add_argument("--name", default="", help="a name for the service's logs and stats")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _say(line: str) -> None:
    print(f"kvstore runner: {line}", file=sys.stderr, flush=True)


def check_revision(revision: str | None) -> None:
    """A revision the service could hold (as RegisterModel checks one): else every attach is refused."""
    if revision is None:
        return
    if not revision or len(revision) > MAX_ENGINE_NAME or not revision.isprintable():
        shown = repr(revision[:40]) + ("..." if len(revision) > 40 else "")
        raise InvalidInput(f"--revision must be 1 to {MAX_ENGINE_NAME} printable characters, got {shown}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for key in ("max_batch", "max_concurrent_jobs"):
        if not 1 <= getattr(args, key) <= MAX_U32:
            raise InvalidInput(f"--{key.replace('_', '-')} must be 1 to {MAX_U32:,}, got {getattr(args, key):,}")
    # Before the model loads: a huge window or chunk asked torch or numpy for terabytes (a
    # traceback), or warmed up for minutes.
    if not 1 <= args.window <= MAX_WINDOW_TOKENS:
        raise InvalidInput(f"--window must be 1 to {MAX_WINDOW_TOKENS:,} tokens, got {args.window:,}")
    if not (0 < args.chunk_tokens <= MAX_CHUNK_TOKENS and args.chunk_tokens % 8 == 0):
        raise InvalidInput(f"--chunk-tokens must be a positive multiple of 8, at most {MAX_CHUNK_TOKENS:,} "
                           f"(store.chunk_tokens' bound), got {args.chunk_tokens:,}")
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise InvalidInput(f"--seed must be a 64-bit integer (as replay.reference_seed), got {args.seed:,}")
    if not 0 <= args.threads <= MAX_THREADS:
        raise InvalidInput(f"--threads must be 0 (auto) to {MAX_THREADS}")
    check_revision(args.revision)
    # Before the model loads: a token gRPC cannot send, a bad port or an unreadable CA would
    # otherwise fail each reconnect for ever.
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    check_token(token, "--token" if args.token is not None else TOKEN_ENV)
    check_target(args.connect, "--connect")
    check_tls_ca(args.tls_ca, "--tls-ca")
    check_tls_client(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
    check_tls_server_name(args.tls_server_name, "--tls-server-name", bool(args.tls_ca or args.tls_cert))
    from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
    from replay.inprocess import ReferenceReplayer, device_option
    from replay.reference.config import ModelConfig
    from replay.runner import seeded_weights

    try:
        cfg = replace(ModelConfig(), window=args.window, chunk_tokens=args.chunk_tokens, seed=args.seed)
    except ValueError as e:
        raise InvalidInput(f"--window/--chunk-tokens: {e}") from None
    # The service checks the layout id, which hashes the layout's name: announce the layout under
    # the name the service serves the model by.
    name = args.model or ("reference-toy-8" if cfg.window == ModelConfig().window else cfg.layout().name)
    layout = replace(cfg.layout(), name=name)
    from replay.threads import use_threads

    use_threads(args.threads)
    replayer = ReferenceReplayer({layout.name: cfg}, device_option(args.device))
    replayer.load()
    model = replayer.model(layout.name)
    assert model is not None  # loaded just now under this name
    identity = RunnerIdentity(
        model=layout.name, layout_id=layout.layout_id, device=replayer.device_name,
        max_concurrent_jobs=args.max_concurrent_jobs, max_batch=args.max_batch,
        name=args.name or f"reference runner ({replayer.device_name})",
        # Declared so that the service refuses a runner whose seed gives other weights than its
        # own: their snapshots have the right size and would be pooled as the model's.
        weights=seeded_weights(args.revision if args.revision is not None else model.spec.revision, cfg.seed),
    )
    opts = AttachOptions(args.connect, token, args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         tls_server_name=args.tls_server_name)
    runner = AttachedRunner(identity, replayer.run_batch, opts, say=_say)
    stop = stop_on_signals()
    _say(f"model {layout.name} (window {cfg.window}, chunks of {cfg.chunk_tokens} tokens, weights "
         f"{identity.weights}) on {replayer.device_name}; connecting to {args.connect}")
    rc = runner.run(stop)
    _say(f"stopped after {runner.jobs_done} job(s)" if rc == 0 else "giving up: the service refused this runner")
    return rc
