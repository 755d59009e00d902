"""`kvstore serve`: run the gRPC service (and the admin HTTP port) until SIGTERM or SIGINT.

With no `--config` it runs the embedded default and says what that is: tiers and capacities, the
device backend, the data directory, the local pool, the runner, and that auth is off and the
service binds loopback only. It prints `kvstore: gRPC listening on HOST:PORT` once it accepts
calls (tests and scripts parse that line; `--grpc-port 0` picks a free port).

SIGTERM/SIGINT: health NOT_SERVING, new calls refused, calls in flight get `grace_seconds`, the
store (LMDB) closes cleanly, exit 0. SIGHUP, or an edit of `--config`, re-reads the file and applies
what can change without a restart (the local TTL policy); a bad new file is rejected with one log
line and the old config stays. A SIGHUP before the service listens is acted on once it does (an edit
made while it started is a change too); one while it drains is said and ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import resource
import signal
import stat
import sys
from types import FrameType

from kvstore import __version__
from kvstore.commands.checks import check_not_empty, check_server_tls
from kvstore.commands.socket_flag import add_socket_flag, check_socket_flag, socket_over
from kvstore.commands.stop_signals import stop_on_signals
from kvstore.config import KvstoreConfig, binds_collide, load_config
from kvstore.config.service import is_host
from kvstore.config.warnings import config_warnings
from kvstore.errors import ConfigError, InvalidInput, KvstoreError, StorageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: the embedded default)")
    p.add_argument("--grpc-host", metavar="HOST", help="address to bind (default: service.grpc_host)")
    p.add_argument("--grpc-port", type=int, metavar="N", help="gRPC port (0: any free port)")
    p.add_argument("--admin-port", type=int, metavar="N", help="admin HTTP port (0: any free port, -1: none)")
    add_socket_flag(p, "also serve gRPC on this Unix socket, with same-host shared memory beside it")
    p.add_argument("--data-dir", metavar="DIR", help="where LMDB lives (default: data_dir in the config)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _say(line: str) -> None:
    """A status line on stdout. One that cannot be written (the reader has gone: `serve | head`, a
    log shipper that died) is dropped, said once on stderr: it must never stop the service or
    skip the clean shutdown."""
    global _stdout_gone
    try:
        print(f"kvstore: {line}", flush=True)
    except (OSError, ValueError) as e:  # ValueError: stdout closed
        if not _stdout_gone:
            _stdout_gone = True
            logging.getLogger("kvstore.serve").warning("status lines dropped from now on: stdout: %s", e)


_stdout_gone = False


def _stopped_while_starting(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGINT before the service starts serving: nothing acknowledged is in flight and LMDB
    survives any stop, so end now, saying so (as PID 1 in a container, a signal's default action
    would be dropped, and a start-up that loads a large index would ignore `docker stop`)."""
    print(f"kvstore serve: stopped while starting ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _say_in_handler(line: str) -> None:
    """`_say` from a signal handler: one that came while a status line was being written (stdout
    full) would raise "reentrant call" into whatever the main thread was doing; the line is dropped."""
    with contextlib.suppress(RuntimeError):
        _say(line)


class _HupsOutsideTheReloader:
    """SIGHUP while no reloader handles it. Its default action ends the process: while starting it
    is noted (acted on once the reloader, or the line saying there is none, is in place); while
    draining it is said and ignored."""

    def __init__(self) -> None:
        self.pending = False
        self.draining = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.draining:
            _say_in_handler("SIGHUP while shutting down: ignored (nothing is reloaded)")
        else:
            self.pending = True


def _check_host_memory(cfg: KvstoreConfig) -> None:
    """Refuse a start whose host memory backed at start (prefaulted or pinned arenas) is more than
    this process may take (its memory cgroup's limit): it would listen, then be killed seconds
    later, a crash loop under a restart policy. What may not fit otherwise is warned about."""
    from kvstore.commands.host_memory_plan import host_memory_verdict

    verdict = host_memory_verdict(cfg)
    if verdict.refusal:
        raise StorageError(verdict.refusal)
    if verdict.warning:
        logging.getLogger("kvstore.config").warning("%s", verdict.warning)


def _raise_descriptor_limit() -> None:
    """The soft limit on open descriptors raised to the hard one: every client connection, same-host
    session segment and LMDB file is one, and systemd's default soft limit (1,024) is reached by
    a few hundred clients; gRPC then refuses everyone's calls."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    signal.signal(signal.SIGINT, _stopped_while_starting)
    hups = _HupsOutsideTheReloader()
    signal.signal(signal.SIGHUP, hups)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_descriptor_limit()
    # '' read as the current directory: "cannot read config file .", or LMDB made in it.
    check_not_empty(args.config, "--config", "file")
    check_not_empty(args.data_dir, "--data-dir", "directory")
    from kvstore.local_pool.reload import file_signature
    from kvstore.service.app import build_app
    from kvstore.service.auth import check_bind_allowed
    from kvstore.service.server import KvstoreServer

    # Before the file is read: an edit made while the service starts is then a change to reload.
    read_at = file_signature(args.config) if args.config is not None else None
    cfg = load_config(args.config)
    check_server_tls(cfg.service.tls_cert_file, cfg.service.tls_key_file, cfg.service.tls_client_ca_file)
    host = args.grpc_host or cfg.service.grpc_host
    # Else a bad flag is blamed, at bind time, on the config's grpc_port or on missing auth.
    if args.grpc_host is not None and not is_host(args.grpc_host):
        raise InvalidInput(f"--grpc-host {args.grpc_host!r} is not an IP address or a host name (no port, "
                           "no brackets: the port is --grpc-port)")
    try:
        check_bind_allowed(cfg, host)  # before opening anything
    except ConfigError as e:
        if args.grpc_host is None:
            raise
        raise InvalidInput(f"--grpc-host {host}: {e.problem}") from None
    if args.grpc_port is not None and not 0 <= args.grpc_port <= 65535:
        raise InvalidInput("--grpc-port must be in 0..65535")
    # Checked before anything opens: the admin port is bound only after gRPC has started.
    if args.admin_port is not None and not -1 <= args.admin_port <= 65535:
        raise InvalidInput("--admin-port must be -1 (none) or in 0..65535")
    # The config's own rule, for the ports the flags make: else the admin port's bind is refused
    # after gRPC has started, blamed on another process holding the port.
    grpc_port = cfg.service.grpc_port if args.grpc_port is None else args.grpc_port
    admin_port = cfg.admin.port if args.admin_port is None else args.admin_port
    if grpc_port > 0 and grpc_port == admin_port and binds_collide(host, cfg.admin.host):
        raise InvalidInput(f"gRPC and the admin port would both be {grpc_port} on one address "
                           "(--grpc-port, --admin-port or the config's ports): the two ports must differ")
    check_socket_flag(args.unix_socket)
    if args.data_dir is not None and "\0" in args.data_dir:
        raise InvalidInput("--data-dir must not contain a NUL character (no path can)")
    cfg = socket_over(cfg, args.unix_socket)
    for w in config_warnings(cfg):  # with the socket's own (same-host session shares)
        logging.getLogger("kvstore.config").warning("%s", w)
    _check_host_memory(cfg)  # before any arena is allocated
    app = build_app(cfg, args.data_dir, progress=_say)
    # From here a stop drains: calls are answered from the moment gRPC starts, before the line that
    # says it listens (the pool's probe below may take call_budget_seconds).
    stop = stop_on_signals()
    try:
        server = KvstoreServer(app, host, args.grpc_port, args.admin_port, unix_socket=args.unix_socket).start()
    except KvstoreError as e:
        app.close()
        if isinstance(e, ConfigError) and e.key == "service.grpc_host" and args.grpc_host is not None:
            e = InvalidInput(f"--grpc-host {host}: {e.problem}")
        # As at a clean stop (below): gRPC's core threads may abort a finalizing interpreter.
        print(f"kvstore serve: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except BaseException:
        app.close()
        raise
    svc = cfg.service
    _say(f"{__version__} running " + ("the embedded default (no config file)" if args.config is None
                                      else f"config {args.config}"))
    for line in app.describe():
        _say(line)
    if app.local_pool is not None:
        # One round trip now: a Redis that is down at start is said here, not at the first miss.
        pool = app.local_pool.probe()
        if pool.status != "ok":
            _say(f"local pool {pool.status}: {pool.reason}; window state reads as a miss (rebuilt by "
                 "replay where a runner is attached) until it answers")
            server.health.refresh()  # health was first read before this probe: say so now, not in 2 s
    security = "mTLS" if svc.tls_client_ca_file else "TLS" if svc.tls_cert_file else "plaintext"
    split = "shared by share_weight" if len(cfg.share_weights()) > 1 else "one tenant"
    _say(f"limits: {svc.max_concurrent_calls} concurrent calls, {svc.max_staged_bytes >> 20} MiB staged, "
         f"{svc.max_runners} runners ({split}); messages <= {svc.max_message_bytes} B; streams idle "
         f"{svc.stream_idle_seconds:g} s; grace {svc.grace_seconds:g} s; reflection "
         f"{'on' if svc.reflection else 'off'}")
    reloader = None
    if args.config is not None and _regular_file(args.config):
        from kvstore.local_pool.reload import ConfigReloader

        # SIGHUP and edits of the file re-read it; the TTL policy applies to new writes. Compared
        # with the config in force, and with the file as it was before serve read it.
        reloader = ConfigReloader(args.config, app.reload_local_pool, cfg, read_at=read_at,
                                  with_flags=lambda new: socket_over(new, args.unix_socket))
        reloader.start()
        reloader.install_sighup()  # in place of `hups`, which it puts back when stopped
        if hups.pending:
            _say("SIGHUP while starting: reading the config file again now")
            reloader.reload_soon()
    else:
        # A pipe (`--config <(envsubst < tmpl)`) gave its bytes once: nothing to read again.
        why = ("no config file to reload (the embedded default is running)" if args.config is None else
               f"the config came from {args.config}, not a regular file: nothing to reload")
        signal.signal(signal.SIGHUP, lambda signum, frame: _say_in_handler(f"SIGHUP: {why}"))
        if hups.pending:
            _say(f"SIGHUP while starting: {why}")
    # What start-up built (modules, torch, the recovered index: ~260,000 objects) is kept out of the
    # cycle collector's scans (reference counting still frees it): a full collection, which Store
    # traffic triggers every few seconds, then stalls every call for a few ms, not 130-180 ms.
    gc.freeze()
    if server.admin is not None:
        _say(f"admin HTTP on http://{cfg.admin.host}:{server.admin.port}/")
    if server.unix_socket:
        shm = server.shm
        spare = (f"a spare load segment with {min(svc.shm_prefault_bytes, svc.shm_load_segment_bytes) >> 20} MiB "
                 "prefaulted" if svc.shm_prefault_bytes else "no spare load segment")
        _say(f"gRPC also on unix://{server.unix_socket} (plaintext; the same authentication as TCP); " + (
            f"same-host shared memory on {shm.path}: segments of {svc.shm_load_segment_bytes >> 20} MiB (load) "
            f"and {svc.shm_store_segment_bytes >> 20} MiB (store) per session, leases {svc.shm_lease_seconds:g} s, "
            f"{spare}"
            if shm is not None and shm.enabled else
            f"no shared memory ({'service.shm_enabled is off' if shm is None else shm.detail})"))
    _say(f"gRPC listening on {server.address} ({security})")
    while not stop.wait(0.5):
        pass
    hups.draining = True
    if reloader is not None:
        reloader.stop()
    signal.signal(signal.SIGHUP, hups)
    _say("shutting down: health NOT_SERVING, refusing new calls, "
         f"waiting up to {svc.grace_seconds:g} s for calls in flight")
    finished = server.stop()
    app.close()
    _say("stopped cleanly" if finished else "stopped (some calls were cancelled after the grace period)")
    # Everything is closed (LMDB synced, the pool and the ports shut). Finalizing the interpreter
    # while gRPC's core threads wind down aborted the process now and then ("terminate called
    # without an active exception", exit -6): leave without it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone changes nothing now
            stream.flush()
    os._exit(0)
