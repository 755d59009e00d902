"""`kvstore bench dataplane`: chunk bytes through same-host shared memory against gRPC streams and
a plain memory copy, in one run.

For a 32,768- and a 131,072-token DeepSeek-V4.1 prefix held in the DRAM tier of one `kvstore
serve` (listening on TCP and on a Unix socket, as deployed), each figure is the best of several
passes, the passes of the contenders taking turns:
- `memcpy_gbps`: the same chunk bytes copied chunk by chunk into one destination buffer, in
  process, on one thread (the ceiling of a load into an engine's memory on one core);
- `memcpy_threads_gbps`: the same bytes copied over `copy_threads` threads, as a load's copy
  is (the client's default: the cores it may use, at most 4), from chunks spaced as the DRAM
  tier's arena spaces them (page-rounded), each thread copying its share as one strided copy, as
  the load copies a run of evenly spaced chunks;
- `shm_load_gbps`: `KvstoreClient.load_into` over the Unix socket (shared memory: the client
  copies each chunk into its buffer from where the DRAM tier holds it, in the tenant's part of
  the tier it maps read-only; `shm_in_place_share` says what share of the loaded bytes went so),
  its copies of 2 MiB and more split over `copy_threads` threads; `shm_load_1_thread_gbps`: the
  same with `copy_threads=1`;
- `grpc_load_gbps`: the same `load_into` over TCP (gRPC messages);
- `shm_store_gbps` / `grpc_store_gbps`: a Store of a new prompt of the same size each pass,
  through the store segment and through messages (timed from the call to its durable reply);
- `shm_control_ms` (not a target; it explains the others): a shared-memory load that copies
  nothing (`load_shared`, its views left unread): the call, the hold and the release, about what
  `shm_load` spends besides its copy (it makes a view per run where `load_into` copies each
  run). Since a load's copy runs on `copy_threads` threads and cannot go faster than the same
  copies over as many threads, `memcpy_threads_gbps / grpc_load_gbps` bounds
  `shm_load_gbps / grpc_load_gbps` from above (`memcpy_gbps`, one thread, does not);
- `shm_load_4_clients_gbps`: four client processes loading through shared memory at once,
  bytes over the wall time of all of them; `memcpy_4_clients_gbps` beside it, four processes each
  copying as many bytes chunk by chunk in process (what the machine's cores and memory allow).
- `snapshot`: the local snapshot at the first prefix's end (1.35 MB for V4.1): `store_local`,
  `load_local` and a warm `resume` of the whole prefix with it, over the Unix socket (the
  snapshot one span of the store or load segment) and over TCP (messages), taking turns: best ms
  of each (`shm_store_local_ms`, `grpc_store_local_ms`, `shm_load_local_ms`, ...,
  `grpc_resume_ms`). Not a target.
Targets: `shm_load_gbps` >= 0.5 x `memcpy_threads_gbps` (a copy over as many threads as the load's)
and >= 4 x `grpc_load_gbps`;
`shm_load_4_clients_gbps` >= 1.5 x `shm_load_gbps`. Benchmarks print; tests never assert on speed.

The first section: a new session's first load, which copies into a load segment no one has
written yet. Two services hold the same 8,192-token prefix in LMDB only (restarted after the
Store): one as configured by default (a spare load segment with its first `shm_prefault_bytes`
resident is ready for each new session), one with `shm_prefault_bytes = 0`. Trials alternate
between them: a new client opens its session, and after a pause (the spare is remade) loads the
prefix twice: `prefaulted_first_load_ms`, `prefaulted_second_load_ms` and the same two of the
other service, `not_prefaulted_...` (medians). Not a target.

The runner section: a replay job's data path to an attached runner and back. One `kvstore
serve` with two tenants holds the first prefix for each; each tenant has a runner of its own in
this process, one attached over the Unix socket (its job chunks and its result through its
session's segments) and one over TCP (in messages). Neither runner computes: each answers with
a fixed snapshot, so what is timed is the data path. A pass is an expired `Resume` of the prefix
per tenant (`skip_chunks`: the engine holds the chunks; no snapshot is held, so the service
replays the window), its boundary one chunk shorter each pass so that no replay is shared:
`shm_replay_resume_ms` and `grpc_replay_resume_ms`, best and median of the passes, taking turns;
`job_bytes`, the chunk bytes each timed pass's job carried (as its runner received them).
Not a target.

The gpu section (where CUDA and cupy are present; `--sections`) holds the same prefixes in the
device tier of a second `kvstore serve`, on the GPU, and loads them into a tensor on that GPU:
- `gpu_d2d_copy_gbps`: torch copying the same bytes from one GPU tensor into another (the ceiling);
- `gpu_ipc_load_gbps`: `load_into` the GPU tensor through a session that opened the device tier's
  memory by CUDA IPC: device to device, no host round trip;
- `gpu_host_path_load_gbps`: the same load through a session without GPU memory: the service
  copies the chunks down into the load segment, the client copies them up.
No target was set for these; they are reported beside each other.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.flags import count
from kvstore.bench.machine import machine
from kvstore.bench.names import names_note
from kvstore.bench.sections import pick_sections, positive_ints
from kvstore.bench.serve_proc import start_serve
from kvstore.config.store import StoreConfig
from kvstore.dataplane.host_copy import in_parts
from kvstore.errors import InvalidInput
from kvstore.local_pool.redis_process import die_with

MiB = 1 << 20


SECTIONS = ("host", "first", "runner", "gpu")
# The runner section's two tenants: each has a runner of its own, one per path.
RUNNER_TOKENS = {"shm": "bench-runner-shm-0123456789", "grpc": "bench-runner-tcp-0123456789"}
FIRST_LOAD_TOKENS = 8192
FIRST_LOAD_TRIALS = 12
NAMED_CLIENTS = {"clients": ("4_clients", 4)}  # the client count the figures' names carry (`shm_load_4_clients_gbps`)


def add_dataplane_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=None, metavar="S,S",
                   help="parts to run, of host,first,runner,gpu (default: host, first and runner, and gpu where "
                        "CUDA and cupy are present)")
    p.add_argument("--model", default="deepseek-v4.1-flash")
    p.add_argument("--prefixes", default="32768,131072", help="prefix lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=count(1, 1000), default=7, help="passes of each contender per figure")
    p.add_argument("--clients", type=count(1, 256), default=NAMED_CLIENTS["clients"][1],
                   help="concurrent client processes")
    p.add_argument("--store-repeats", type=count(1, 1000), default=3, help="timed Stores per path")


def _loader(address: str, model: str, tokens: bytes, nbytes: int, loads: int, start_at: float) -> tuple[int, float,
                                                                                                       float, str]:
    from kvstore.client.sync_client import KvstoreClient

    arr = np.frombuffer(tokens, dtype="<u4")
    dst = bytearray(nbytes)
    with KvstoreClient(address) as kv:
        kv.load_into(model, arr, dst)  # the session opened, the buffer touched
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        moved = sum(kv.load_into(model, arr, dst).loaded_chunks for _ in range(loads))
        return moved, t0, time.time(), kv.data_path_in_use


def _copier(nbytes: int, chunk_bytes: int, passes: int, start_at: float) -> tuple[int, float, float, str]:
    """The baseline beside `_loader`: copy the same number of bytes, chunk by chunk, in process."""
    rng = np.random.default_rng(os.getpid())
    sources = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes() for _ in range(nbytes // chunk_bytes)]
    dst = memoryview(bytearray(nbytes))
    _copy_chunks(sources, dst, chunk_bytes)  # pages touched, as the loaders' first load touches theirs
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    for _ in range(passes):
        _copy_chunks(sources, dst, chunk_bytes)
    return passes * len(sources), t0, time.time(), "memcpy"


def _copy_chunks(sources: list[bytes], dst: memoryview, chunk_bytes: int) -> None:
    """The memcpy baseline: chunk i copied to byte i * chunk_bytes of `dst`."""
    for i, c in enumerate(sources):
        dst[i * chunk_bytes : (i + 1) * chunk_bytes] = c


def _spaced_like_the_arena(blob: bytes, chunk_bytes: int) -> np.ndarray:
    """`blob`'s chunks as a [chunks, chunk_bytes] view whose rows lie as the DRAM tier's arena lays
    out one Store's chunks: each at a whole number of pages (`store.page_bytes`) from the last."""
    page = StoreConfig().page_bytes  # the bench's services keep the default
    stride = -(-chunk_bytes // page) * page
    n = len(blob) // chunk_bytes
    held = np.zeros(n * stride, np.uint8)
    rows = np.ndarray((n, chunk_bytes), np.uint8, buffer=held, strides=(stride, 1))
    rows[:] = np.frombuffer(blob, np.uint8, n * chunk_bytes).reshape(n, chunk_bytes)
    return rows


def _copy_chunks_threaded(sources: np.ndarray, dst: np.ndarray, threads: int) -> None:
    """The copy a shared-memory load makes (ShmPath.copy_chunks_out): each of `threads` threads
    copies its share of the rows of `sources` (chunks evenly spaced) as one strided copy (numpy's
    copy lets go of the GIL); `dst` is [chunks, chunk_bytes]."""
    in_parts(len(sources), threads, lambda a, b: np.copyto(dst[a:b], sources[a:b]))


def _config(tmp: Path, model: str, nbytes: int, sock: Path, gpu: bool = False, store: str = "",
            service: str = "", runner: str = "none", more: str = "") -> Path:
    cfg = tmp / ("bench-gpu.toml" if gpu else "bench.toml")
    tiers = (f"device = \"cuda\"\ndevice_capacity_bytes = {nbytes + 256 * MiB}\ndram_capacity_bytes = {256 * MiB}\n"
             if gpu else  # every chunk in the GPU's device tier
             f"device = \"cpu\"\ndevice_capacity_bytes = 0\ndram_capacity_bytes = {nbytes + 256 * MiB}\n")
    cfg.write_text(
        f"[store]\n{tiers}"  # else no device tier: every chunk in DRAM
        f"lmdb_capacity_bytes = {2 * nbytes + 512 * MiB}\n"
        f"lmdb_durability = \"async\"\ncompression = \"none\"\nprefault_arenas = true\n{store}"
        f"[service]\nunix_socket_path = \"{sock}\"\nmodels = [\"{model}\"]\n"
        f"shm_load_segment_bytes = {256 * MiB}\nshm_store_segment_bytes = {256 * MiB}\n{service}"
        f"[replay]\nrunner = \"{runner}\"\n[local_pool]\ncapacity_bytes = 16777216\n{more}")
    return cfg


def run_dataplane_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.bench.timing import interleaved_best_rates
    from kvstore.client.sync_client import KvstoreClient
    from kvstore.dataplane.cuda_ipc import cuda_ipc_unavailable
    from kvstore.layout import get_model

    sections = pick_sections("dataplane", args.sections, SECTIONS,
                             ["host", "first", "runner"] if cuda_ipc_unavailable() else
                             ["host", "first", "runner", "gpu"])

    spec = get_model(args.model)
    layout = spec.layout
    cb, ct = layout.chunk_bytes, layout.chunk_tokens
    prefixes = positive_ints("dataplane", "--prefixes", args.prefixes)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, spec.vocab_size, n).astype("<u4") for n in prefixes}
    blobs = {n: rng.integers(0, 256, (n // ct) * cb, dtype=np.uint8).tobytes() for n in prefixes}
    held = sum(len(b) for b in blobs.values())
    store_bytes = (prefixes[0] // ct) * cb * 2 * args.store_repeats
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"model": args.model, "chunk_bytes": cb, "machine": machine(), "prefixes": {},
                           "sections": sections}
    targets: list[dict[str, Any]] = []
    if "gpu" in sections:
        out["gpu"] = _gpu_figures(args, prompts, blobs, held, cb, interleaved_best_rates)
    if "first" in sections:
        print("dataplane: first loads of new sessions", file=sys.stderr)
        out["first_load"] = _first_load_figures(args.model, spec.vocab_size, cb, ct)
    if "runner" in sections and layout.local_snapshot_bytes:
        print(f"dataplane: replay jobs through attached runners ({prefixes[0]:,}-token prefix)", file=sys.stderr)
        out["runner"] = _runner_figures(args, prompts[prefixes[0]], blobs[prefixes[0]], cb,
                                        layout.layout_id, layout.local_snapshot_bytes)
    if "host" not in sections:
        out["targets"] = targets
        return out
    with tempfile.TemporaryDirectory(prefix="kvs-bench-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        sock = tmp / "kv.sock"
        proc, tcp_address = start_serve(_config(tmp, args.model, held + store_bytes, sock), tmp / "data")
        unix_address = f"unix://{sock}"
        try:
            with KvstoreClient(unix_address) as shm, KvstoreClient(tcp_address) as tcp, \
                    KvstoreClient(unix_address, copy_threads=1) as shm1:
                for n in prefixes:
                    r = tcp.store(args.model, prompts[n], blobs[n])
                    assert r.stored_chunks == n // ct, r
                for n in prefixes:
                    print(f"dataplane: {n:,}-token prefix ({len(blobs[n]) / 1e6:.0f} MB)", file=sys.stderr)
                    out["prefixes"][str(n)] = _prefix_figures(args, ctx, (shm, shm1, tcp), unix_address,
                                                              prompts[n], blobs[n], cb, interleaved_best_rates)
                    f = out["prefixes"][str(n)]
                    # The copy a load makes is split over the client's copy threads: the memcpy it is
                    # measured against copies the same bytes over as many threads.
                    targets += [
                        {"name": f"{n} tokens: shm_load_gbps / memcpy_threads_gbps (both {f['copy_threads']} "
                         "copy threads)", "value": f["shm_load_gbps"] / f["memcpy_threads_gbps"], "target": ">= 0.5",
                         "ok": f["shm_load_gbps"] >= 0.5 * f["memcpy_threads_gbps"]},
                        {"name": f"{n} tokens: shm_load_gbps / grpc_load_gbps", "value": f["shm_load_gbps"] /
                         f["grpc_load_gbps"], "target": ">= 4", "ok": f["shm_load_gbps"] >= 4 * f["grpc_load_gbps"]},
                        {"name": f"{n} tokens: shm_load_4_clients_gbps / shm_load_1_client_gbps (both over wall "
                         "time, one process each)", "value": f["shm_load_4_clients_gbps"] / f["shm_load_1_client_gbps"],
                         "target": ">= 1.5", "ok": f["shm_load_4_clients_gbps"] >= 1.5 * f["shm_load_1_client_gbps"]},
                    ]
                plane = shm.stats().data_plane
                sessions = plane.sessions if plane is not None else ()
                loaded = sum(s.loaded_bytes for s in sessions)
                out["shm_in_place_share"] = sum(s.in_place_bytes for s in sessions) / loaded if loaded else 0.0
                print("dataplane: stores", file=sys.stderr)
                out["store"] = _store_figures(args, shm, tcp, prefixes[0], cb, ct, spec.vocab_size)
                print("dataplane: local snapshots", file=sys.stderr)
                out["snapshot"] = _snapshot_figures(args, shm, tcp, prompts[prefixes[0]], layout.local_snapshot_bytes)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out.update(names_note(args, NAMED_CLIENTS))
    out["targets"] = targets
    return out


def _prefix_figures(args: argparse.Namespace, ctx: Any, clients: tuple[Any, Any, Any], unix_address: str,
                    prompt: np.ndarray, blob: bytes, cb: int, interleaved_best_rates: Any) -> dict[str, Any]:
    shm, shm1, tcp = clients  # the Unix socket (default copy threads, then one), TCP
    n_chunks = len(blob) // cb
    sources = [blob[i * cb : (i + 1) * cb] for i in range(n_chunks)]
    memcpy_dst = memoryview(bytearray(len(blob)))
    shm_dst, shm1_dst, tcp_dst = bytearray(len(blob)), bytearray(len(blob)), bytearray(len(blob))
    threads = shm.copy_threads
    arrays = _spaced_like_the_arena(blob, cb)
    threaded_dst = np.zeros((n_chunks, cb), np.uint8)

    def memcpy() -> int:
        _copy_chunks(sources, memcpy_dst, cb)
        return len(blob)

    def memcpy_threads() -> int:
        _copy_chunks_threaded(arrays, threaded_dst, threads)
        return len(blob)

    def shm_load() -> int:
        return shm.load_into(args.model, prompt, shm_dst).loaded_chunks * cb

    def shm_load_1_thread() -> int:
        return shm1.load_into(args.model, prompt, shm1_dst).loaded_chunks * cb

    def grpc_load() -> int:
        return tcp.load_into(args.model, prompt, tcp_dst).loaded_chunks * cb

    def shm_control() -> int:
        # A shared-memory load that copies nothing: its call, the hold of every chunk and the
        # release, about what `shm_load` costs besides its copy. Counted as the blob's bytes so
        # that its time comes out of the same best-rate bookkeeping.
        with shm.load_shared(args.model, prompt) as r:
            assert len(r.chunks) == n_chunks, len(r.chunks)
        return len(blob)

    contenders = {"memcpy": memcpy, "memcpy_threads": memcpy_threads, "shm": shm_load,
                  "shm_1_thread": shm_load_1_thread, "grpc": grpc_load, "control": shm_control}
    for fn in contenders.values():  # warm: pages touched, sessions open
        fn()
    assert shm.data_path_in_use == "shm" and shm1.data_path_in_use == "shm", shm.shm_detail
    assert bytes(shm_dst) == blob and bytes(shm1_dst) == blob and bytes(tcp_dst) == blob
    assert threaded_dst.tobytes() == blob
    rates = interleaved_best_rates(contenders, repeats=args.repeats)
    # Many clients against one, measured alike: client processes loading `repeats` times from a
    # common start, their bytes over the wall time from the first start to the last end, one
    # client and then all of them, twice in turn (the better of each kept).
    aggregate: dict[str, float] = {}
    with ctx.Pool(args.clients, die_with, (os.getpid(),)) as pool:
        for _ in range(2):
            for name, work, task, n_clients in (
                ("shm_1", _loader, (unix_address, args.model, prompt.tobytes(), len(blob), args.repeats), 1),
                ("shm", _loader, (unix_address, args.model, prompt.tobytes(), len(blob), args.repeats), args.clients),
                ("memcpy", _copier, (len(blob), cb, args.repeats), args.clients),
            ):
                start_at = time.time() + 3.0
                results = pool.starmap(work, [(*task, start_at) for _ in range(n_clients)])
                assert all(r[3] == name.split("_")[0] for r in results), [r[3] for r in results]
                wall = max(r[2] for r in results) - min(r[1] for r in results)
                aggregate[name] = max(aggregate.get(name, 0.0), sum(r[0] for r in results) * cb / wall / 1e9)
    return {
        "bytes": len(blob), "chunks": n_chunks,
        "memcpy_gbps": rates["memcpy"], "shm_load_gbps": rates["shm"], "grpc_load_gbps": rates["grpc"],
        "copy_threads": threads, "memcpy_threads_gbps": rates["memcpy_threads"],
        "shm_load_1_thread_gbps": rates["shm_1_thread"],
        "shm_control_ms": len(blob) / rates["control"] / 1e6,
        "shm_load_4_clients_gbps": aggregate["shm"], "memcpy_4_clients_gbps": aggregate["memcpy"],
        "shm_load_1_client_gbps": aggregate["shm_1"],
        "clients": args.clients,
    }


def _store_figures(args: argparse.Namespace, shm: Any, tcp: Any, n_tokens: int, cb: int, ct: int,
                   vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    blob = rng.integers(0, 256, (n_tokens // ct) * cb, dtype=np.uint8).tobytes()
    best = {"shm": 0.0, "grpc": 0.0}
    for _ in range(args.store_repeats):
        for name, kv in (("shm", shm), ("grpc", tcp)):
            prompt = rng.integers(0, vocab, n_tokens).astype("<u4")  # new chunks every time
            t0 = time.perf_counter()
            r = kv.store(args.model, prompt, blob)
            dt = time.perf_counter() - t0
            assert r.stored_chunks == n_tokens // ct and r.durable, r
            best[name] = max(best[name], len(blob) / dt / 1e9)
    return {"tokens": n_tokens, "bytes": len(blob), "shm_store_gbps": best["shm"], "grpc_store_gbps": best["grpc"]}


def _snapshot_figures(args: argparse.Namespace, shm: Any, tcp: Any, prompt: np.ndarray,
                      snapshot_bytes: int) -> dict[str, Any]:
    if not snapshot_bytes:
        return {"snapshot_bytes": 0}
    snapshot = np.random.default_rng(2).integers(0, 256, snapshot_bytes, dtype=np.uint8).tobytes()
    r = tcp.store_local(args.model, prompt, snapshot)
    assert r.stored, r
    best: dict[str, float] = {}

    def timed(name: str, call: Any) -> None:
        t0 = time.perf_counter()
        got = call()
        dt = (time.perf_counter() - t0) * 1e3
        assert got.snapshot == snapshot, name
        best[name] = min(best.get(name, dt), dt)

    for _ in range(args.repeats):
        for path, kv in (("shm", shm), ("grpc", tcp)):
            t0 = time.perf_counter()
            stored = kv.store_local(args.model, prompt, snapshot)  # the same bytes again: it is replaced
            dt = (time.perf_counter() - t0) * 1e3
            assert stored.stored, stored
            best[f"{path}_store_local_ms"] = min(best.get(f"{path}_store_local_ms", dt), dt)
            timed(f"{path}_load_local_ms", lambda kv=kv: kv.load_local(args.model, prompt))
            timed(f"{path}_resume_ms", lambda kv=kv: kv.resume(args.model, prompt))
    return {"tokens": len(prompt), "snapshot_bytes": snapshot_bytes, **best}


def _runner_figures(args: argparse.Namespace, prompt: np.ndarray, blob: bytes, cb: int, layout_id: bytes,
                    snapshot_bytes: int) -> dict[str, Any]:
    from kvstore.client.sync_client import KvstoreClient
    from replay.attached import AttachedRunner, AttachOptions, RunnerIdentity
    from replay.runner import ReplayResult

    snapshot = np.random.default_rng(3).integers(0, 256, snapshot_bytes, dtype=np.uint8).tobytes()
    n_chunks = len(blob) // cb
    passes = min(args.repeats, n_chunks - 1)
    if passes < 1:
        raise InvalidInput("dataplane: the runner section needs a prefix of at least two chunks")

    # The chunk bytes each job brought its runner, in order (the first pass's too): what a pass
    # carried, read where it arrived (pass i's boundary is i chunks short of the prefix's end).
    carried: dict[str, list[int]] = {path: [] for path in RUNNER_TOKENS}

    def runner_for(path: str, target: str) -> AttachedRunner:
        def answer(jobs: Any) -> list[ReplayResult]:
            carried[path].extend(sum(memoryview(c).nbytes for c in job.chunks) for job in jobs)
            return [ReplayResult(snapshot) for _ in jobs]

        ident = RunnerIdentity(args.model, layout_id, "cpu", max_concurrent_jobs=1, max_batch=1, name=f"bench-{path}")
        return AttachedRunner(ident, answer, AttachOptions(target, token=RUNNER_TOKENS[path]), say=lambda _: None)

    tenants = "".join(f"[tenants.{path}]\ntokens = [\"{token}\"]\n" for path, token in RUNNER_TOKENS.items())
    times: dict[str, list[float]] = {path: [] for path in RUNNER_TOKENS}
    with tempfile.TemporaryDirectory(prefix="kvs-bench-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        cfg = _config(tmp, args.model, 2 * len(blob), tmp / "kv.sock", runner="attached", more=tenants)
        proc, tcp_address = start_serve(cfg, tmp / "data")
        stop = threading.Event()
        runners = {"shm": runner_for("shm", f"unix://{tmp / 'kv.sock'}"), "grpc": runner_for("grpc", tcp_address)}
        threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in runners.values()]
        try:
            for t in threads:
                t.start()
            clients = {path: KvstoreClient(tcp_address, token=token) for path, token in RUNNER_TOKENS.items()}
            for kv in clients.values():
                assert kv.store(args.model, prompt, blob).stored_chunks == n_chunks
            give_up = time.monotonic() + 60
            while not all(r.sessions for r in runners.values()):
                if time.monotonic() > give_up:
                    raise RuntimeError("bench dataplane: the runners did not attach in 60 s")
                time.sleep(0.05)
            for i in range(passes + 1):  # the first pass warms up (sessions, pages) and is not timed
                for path, kv in clients.items():
                    t0 = time.perf_counter()
                    r = kv.resume(args.model, prompt, max_chunks=n_chunks - i, skip_chunks=True)
                    dt = (time.perf_counter() - t0) * 1e3
                    assert (r.local_state, r.snapshot == snapshot) == ("replayed", True), (path, r.local_state,
                                                                                             r.replay_status)
                    if i:
                        times[path].append(dt)
            for kv in clients.values():
                kv.close()
            assert all(r.jobs_done == passes + 1 for r in runners.values()), [r.jobs_done for r in runners.values()]
        finally:
            stop.set()
            for t in threads:
                t.join(15)
            proc.terminate()
            proc.wait(timeout=30)
    if carried["shm"] != carried["grpc"]:
        raise RuntimeError(f"bench dataplane: the runners' jobs carried {carried} chunk bytes: not the same work")
    # The timed passes' jobs: the first pass warms up and is not timed.
    out: dict[str, Any] = {"tokens": len(prompt), "job_bytes": carried["shm"][1:], "snapshot_bytes": snapshot_bytes,
                           "passes": passes}
    for path, ms in times.items():
        out[f"{path}_replay_resume_ms"] = min(ms)
        out[f"{path}_replay_resume_median_ms"] = float(np.median(ms))
    return out


def _first_load_figures(model: str, vocab: int, cb: int, ct: int) -> dict[str, Any]:
    from kvstore.client.sync_client import KvstoreClient

    rng = np.random.default_rng(2)
    prompt = rng.integers(0, vocab, FIRST_LOAD_TOKENS).astype("<u4")
    blob = rng.integers(0, 256, (FIRST_LOAD_TOKENS // ct) * cb, dtype=np.uint8).tobytes()
    dst = bytearray(len(blob))
    variants = {"prefaulted": "", "not_prefaulted": "shm_prefault_bytes = 0\n"}
    times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
    with tempfile.TemporaryDirectory(prefix="kvs-bench-", dir="/tmp") as tmpdir:
        procs: dict[str, tuple[Any, str]] = {}
        try:
            for name, extra in variants.items():
                tmp = Path(tmpdir) / name
                tmp.mkdir()
                cfg = _config(tmp, model, 2 * len(blob), tmp / "kv.sock", store="promote_on_hit = false\n",
                              service=extra)
                proc, tcp = start_serve(cfg, tmp / "data")
                procs[name] = (proc, "")
                with KvstoreClient(tcp) as kv:
                    assert kv.store(model, prompt, blob).durable
                proc.terminate()
                proc.wait(timeout=30)
                proc, _ = start_serve(cfg, tmp / "data")  # the chunks now in LMDB only
                procs[name] = (proc, f"unix://{tmp / 'kv.sock'}")
            for _ in range(FIRST_LOAD_TRIALS):
                for name, (_, address) in procs.items():
                    with KvstoreClient(address) as kv:
                        assert kv.shm_session_id(), kv.shm_detail
                        time.sleep(0.3)  # the service makes its next spare segment meanwhile
                        t0 = time.perf_counter()
                        first = kv.load_into(model, prompt, dst)
                        t1 = time.perf_counter()
                        kv.load_into(model, prompt, dst)
                        t2 = time.perf_counter()
                        assert first.loaded_chunks == len(blob) // cb and set(first.chunk_tiers) == {"lmdb"}, first
                        assert kv.data_path_in_use == "shm" and bytes(dst) == blob
                    times[name][0].append((t1 - t0) * 1e3)
                    times[name][1].append((t2 - t1) * 1e3)
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                proc.wait(timeout=30)
    out: dict[str, Any] = {"tokens": FIRST_LOAD_TOKENS, "bytes": len(blob), "trials": FIRST_LOAD_TRIALS}
    for name, (first_ms, second_ms) in times.items():
        out[f"{name}_first_load_ms"] = float(np.median(first_ms))
        out[f"{name}_second_load_ms"] = float(np.median(second_ms))
    return out


def _gpu_figures(args: argparse.Namespace, prompts: dict[int, np.ndarray], blobs: dict[int, bytes], held: int,
                 cb: int, interleaved_best_rates: Any) -> dict[str, Any]:
    """The gpu section: the prefixes held in the device tier on the GPU, loaded into a GPU tensor."""
    import torch

    from kvstore.client.sync_client import KvstoreClient
    from kvstore.dataplane.cuda_ipc import cuda_ipc_unavailable

    why = cuda_ipc_unavailable()
    if why:
        raise InvalidInput(f"dataplane: the gpu section needs CUDA and cupy: {why}")
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_properties(0).name, "prefixes": {}}
    with tempfile.TemporaryDirectory(prefix="kvs-bench-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        sock = tmp / "kv.sock"
        proc, tcp_address = start_serve(_config(tmp, args.model, held, sock, gpu=True), tmp / "data")
        try:
            with KvstoreClient(tcp_address) as tcp, \
                    KvstoreClient(f"unix://{sock}", data_path="shm", gpu_memory=True) as ipc, \
                    KvstoreClient(f"unix://{sock}", data_path="shm", gpu_memory=False) as host:
                for n, prompt in prompts.items():
                    r = tcp.store(args.model, prompt, blobs[n])
                    assert r.stored_chunks == len(blobs[n]) // cb, r
                for n, prompt in prompts.items():
                    blob = blobs[n]
                    print(f"dataplane: gpu, {n:,}-token prefix ({len(blob) / 1e6:.0f} MB)", file=sys.stderr)
                    src = torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda()
                    dst = torch.empty_like(src)

                    def d2d(src: Any = src, dst: Any = dst) -> int:
                        dst.copy_(src)
                        torch.cuda.synchronize()
                        return int(src.numel())

                    def load(kv: KvstoreClient, prompt: np.ndarray = prompt, dst: Any = dst) -> int:
                        got = kv.load_into(args.model, prompt, dst)
                        torch.cuda.synchronize()
                        return got.loaded_chunks * cb

                    first = ipc.load_into(args.model, prompt, dst)
                    assert set(first.chunk_tiers) == {"device"}, set(first.chunk_tiers)
                    assert ipc._shm is not None and "device" in ipc._shm.device_arenas, "no GPU memory was opened"
                    assert torch.equal(dst, src), "the GPU load's bytes differ"
                    dst.zero_()
                    assert load(host) == len(blob) and torch.equal(dst, src), "the host path's bytes differ"
                    rates = interleaved_best_rates({"gpu_d2d_copy_gbps": d2d,
                                                    "gpu_ipc_load_gbps": lambda: load(ipc),
                                                    "gpu_host_path_load_gbps": lambda: load(host)},
                                                   repeats=args.repeats)
                    rates = {k: round(v, 3) for k, v in rates.items()}
                    out["prefixes"][str(n)] = {
                        "bytes": len(blob), **rates,
                        "ipc_over_d2d": round(rates["gpu_ipc_load_gbps"] / rates["gpu_d2d_copy_gbps"], 3),
                        "ipc_over_host_path": round(rates["gpu_ipc_load_gbps"] / rates["gpu_host_path_load_gbps"], 2),
                    }
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return out
