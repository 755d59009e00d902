"""The client's checks of what its caller passes, made before anything is sent (or before gRPC
reads a file): one InvalidInput (or InvalidArgumentError, as the service would answer) naming the
argument, never a process abort, a crash over a numpy object array, a traceback from deep inside
protobuf, or a call that silently does something else."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import AsyncKvstoreClient, InvalidArgumentError, KvstoreClient
from kvstore.config.fields import DAY_SECONDS
from kvstore.errors import InvalidInput
from kvstore.layout import EngineLayerGroup, EngineModel
from tests.fixtures.openssl import openssl_or_skip
from tests.fixtures.service import CHUNK, TOY, Service, payloads, tokens

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter: what it checks aborted (SIGABRT) or crashed the process."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


# --- TLS files --------------------------------------------------------------------------------------

def _certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a client certificate and key it signed; (ca, cert, key)."""
    openssl = openssl_or_skip()

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvstore-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "c.key", "-out", "c.csr", "-subj", "/CN=c")
    run("x509", "-req", "-in", "c.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "c.pem",
        "-days", "2")
    return d / "ca.pem", d / "c.pem", d / "c.key"


_CONSTRUCT = """
import json, sys
from kvstore.client import AsyncKvstoreClient, KvstoreClient
from kvstore.errors import InvalidInput
for make in (KvstoreClient, AsyncKvstoreClient):
    for kw in json.loads(sys.argv[1]):
        try:
            make("127.0.0.1:1", **kw)
            print(json.dumps([make.__name__, "constructed"]), flush=True)
        except InvalidInput as e:
            print(json.dumps([make.__name__, str(e)]), flush=True)
"""


def test_tls_files_the_client_cannot_use_are_refused_naming_the_argument_not_an_abort(tmp_path: Path) -> None:
    # gRPC aborted the interpreter (SIGABRT: "Check failed: private_key != nullptr") on a certificate
    # that is no PEM or has no key, went out in plaintext with a key alone, raised a bare
    # FileNotFoundError for a missing CA, and logged from its core on a CA that is no PEM.
    ca, cert, key = _certs(tmp_path)
    hostname = tmp_path / "hostname"
    hostname.write_text("not a certificate\n")
    cases: list[tuple[dict[str, str], str]] = [
        ({"tls_cert": str(hostname)}, "tls_cert and tls_key go together"),
        ({"tls_cert": str(cert)}, "tls_cert and tls_key go together"),
        ({"tls_ca": str(ca), "tls_key": str(key)}, "tls_cert and tls_key go together"),
        ({"tls_key": str(key)}, "tls_cert and tls_key go together"),
        ({"tls_ca": "/nonexistent/ca.pem"}, "tls_ca /nonexistent/ca.pem: No such file"),
        ({"tls_ca": str(hostname)}, f"tls_ca {hostname}: not a PEM CA certificate"),
        ({"tls_cert": str(hostname), "tls_key": str(key)}, f"tls_cert {hostname}: not a PEM certificate"),
        ({"tls_cert": str(cert), "tls_key": str(hostname)}, f"tls_key {hostname}: not the PEM private key of "
                                                           f"tls_cert {cert}"),
        ({"tls_cert": str(cert), "tls_key": str(tmp_path / "ca.key")}, f"tls_key {tmp_path / 'ca.key'}: not the "
                                                                       f"PEM private key of tls_cert {cert}"),
        ({"tls_ca": str(ca), "tls_cert": str(cert), "tls_key": str(key)}, "constructed"),
    ]
    done = _python(_CONSTRUCT, json.dumps([kw for kw, _ in cases]))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    said = [json.loads(line) for line in done.stdout.splitlines()]
    expected = [(name, want) for name in ("KvstoreClient", "AsyncKvstoreClient") for _, want in cases]
    assert len(said) == len(expected), said
    for (name, message), (want_name, want) in zip(said, expected, strict=True):
        assert name == want_name and message.startswith(want), (name, message, want)
    assert "Check failed" not in done.stderr and "E0000" not in done.stderr


def test_a_tls_argument_that_is_no_file_name_is_refused() -> None:
    with pytest.raises(InvalidInput, match="tls_ca must be a file name"):
        KvstoreClient("127.0.0.1:1", tls_ca=5)  # open(5) reads file descriptor 5


# --- buffers that hold no plain bytes ---------------------------------------------------------------

_LOAD_INTO_OBJECTS = """
import sys
import numpy as np
from kvstore.client import KvstoreClient
from kvstore.errors import InvalidInput
kv = KvstoreClient(sys.argv[1], timeout_seconds=10)
buf = np.empty(int(sys.argv[2]), dtype=object)
buf[:] = [object() for _ in range(len(buf))]
try:
    kv.load_into("reference-toy-8", [int(t) for t in sys.argv[3].split(",")], buf)
    print("written")
except InvalidInput as e:
    print(e)
print(len(set(map(type, buf))))  # reads every item: a crash if KV bytes were written over one
"""


def test_load_into_refuses_an_object_array_instead_of_writing_over_its_pointers(service: Service) -> None:
    kv = service.client()
    cb = service.chunk_bytes(TOY)
    prompt = tokens(401, 3 * CHUNK)
    kv.store(TOY, prompt, payloads(401, 3, cb))
    done = _python(_LOAD_INTO_OBJECTS, service.address, str(3 * cb // 8 + 1), ",".join(map(str, prompt)))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["the load_into buffer must hold bytes or numbers; it holds Python objects "
                                        "(format 'O')", "1"], done.stdout


def test_store_refuses_payloads_of_python_objects(service: Service) -> None:
    kv = service.client()
    cb = service.chunk_bytes(TOY)
    prompt = tokens(402, 2 * CHUNK)
    blob = np.empty(2 * cb // 8, dtype=object)
    blob[:] = "x"
    with pytest.raises(InvalidInput, match="payloads must hold bytes or numbers; it holds Python objects"):
        kv.store(TOY, prompt, blob)  # its heap addresses were stored as the KV
    chunk = np.empty(cb // 8, dtype=object)
    with pytest.raises(InvalidInput, match=r"payloads\[1\] must hold bytes or numbers"):
        kv.store(TOY, prompt, [payloads(402, 1, cb)[0], chunk])
    with pytest.raises(InvalidInput, match="snapshot must hold bytes or numbers"):
        kv.store_local(TOY, prompt, np.empty(service.snapshot_bytes(TOY) // 8, dtype=object))
    assert kv.lookup(TOY, prompt).hit_chunks == 0
    # Plain numbers of any width are bytes as before.
    assert kv.store(TOY, prompt, np.ones(2 * cb // 4, dtype=np.float32)).stored_chunks == 2


# --- payloads -----------------------------------------------------------------------------------------

def test_store_takes_a_generator_of_payloads(service: Service) -> None:
    # The size check consumed the generator; the join then sent nothing: stored_chunks=0, no error.
    kv = service.client()
    prompt = tokens(403, 2 * CHUNK)
    sent = payloads(403, 2, service.chunk_bytes(TOY))
    assert kv.store(TOY, prompt, (p for p in sent)).stored_chunks == 2
    assert [bytes(c) for c in kv.load(TOY, prompt).chunks] == sent
    other = tokens(404, 2 * CHUNK)
    assert kv.store(TOY, other, iter(sent)).stored_chunks == 2


@pytest.mark.parametrize(("make", "message"), [
    (lambda cb: [np.zeros(2 * cb, np.uint8)[::2], bytes(cb)], r"payloads\[0\] must be C-contiguous"),
    (lambda cb: torch.zeros(2 * cb, dtype=torch.uint8), r"payloads is a torch tensor, not a buffer: pass "
                                                        r"tensor\.cpu\(\)\.numpy\(\)"),
    (lambda cb: [torch.zeros(cb, dtype=torch.uint8)] * 2, r"payloads\[0\] is a torch tensor"),
    (lambda cb: None, "payloads must be a list of chunk payloads or one buffer of them all, got NoneType"),
    (lambda cb: "x" * cb, "payloads must be a list of chunk payloads or one buffer of them all, got str"),
    (lambda cb: [bytes(cb), None], r"payloads\[1\] must be bytes-like \(bytes, a memoryview, a numpy array\), "
                                   "got NoneType"),
])
def test_payloads_of_the_wrong_kind_are_said_as_such(service: Service, make: Callable[[int], Any],
                                                     message: str) -> None:
    kv = service.client()
    with pytest.raises(InvalidInput, match=message):
        kv.store(TOY, tokens(405, 2 * CHUNK), make(service.chunk_bytes(TOY)))


@pytest.mark.parametrize(("make", "message"), [
    (lambda sb: np.zeros(2 * sb, np.uint8)[::2], "snapshot must be C-contiguous"),
    (lambda sb: None, "snapshot must be bytes-like .* got NoneType"),
    (lambda sb: "x" * sb, "snapshot must be bytes-like .* got str"),
    (lambda sb: torch.zeros(sb, dtype=torch.uint8), "snapshot is a torch tensor"),
])
def test_a_snapshot_of_the_wrong_kind_is_said_as_such(service: Service, make: Callable[[int], Any],
                                                      message: str) -> None:
    kv = service.client()
    with pytest.raises(InvalidInput, match=message):
        kv.store_local(TOY, tokens(406, 2 * CHUNK), make(service.snapshot_bytes(TOY)))


# --- timeouts ---------------------------------------------------------------------------------------

def test_a_timeout_past_a_day_is_refused_not_failed_at_once(service: Service) -> None:
    # gRPC's deadline in nanoseconds overflowed past ~9.2e9 s: sys.maxsize, a common "no timeout",
    # failed every call DEADLINE_EXCEEDED at once; wait_ready(1e300) raised OverflowError.
    with pytest.raises(InvalidInput, match=r"timeout_seconds must be a number of seconds > 0 and at most 86,400"):
        KvstoreClient(service.address, timeout_seconds=sys.maxsize)
    kv = service.client(timeout_seconds=DAY_SECONDS)  # a day is the most
    assert kv.lookup(TOY, tokens(407, CHUNK)).hit_tokens == 0
    for call in (lambda: kv.lookup(TOY, tokens(407, CHUNK), timeout_seconds=1e10),
                 lambda: kv.stats(timeout_seconds=DAY_SECONDS + 1), lambda: kv.wait_ready(1e300)):
        with pytest.raises(InvalidInput, match="at most 86,400"):
            call()


def test_the_async_client_refuses_a_timeout_past_a_day(service: Service) -> None:
    import asyncio

    async def run() -> None:
        async with AsyncKvstoreClient(service.address) as kv:
            with pytest.raises(InvalidInput, match="at most 86,400"):
                await kv.lookup(TOY, tokens(408, CHUNK), timeout_seconds=float(sys.maxsize))

    asyncio.run(run())
    with pytest.raises(InvalidInput, match="at most 86,400"):
        AsyncKvstoreClient(service.address, timeout_seconds=1e10)


# --- arguments that must be strings or bools ------------------------------------------------------

_HELD = "0" * 32
_STRING_ARGUMENTS: list[tuple[str, Callable[[KvstoreClient, np.ndarray], object]]] = [
    ("model", lambda kv, t: kv.lookup(5, t)),
    ("model", lambda kv, t: kv.load(5, t)),
    ("model", lambda kv, t: kv.lookup(TOY.encode(), t)),  # load took bytes, lookup not
    ("model", lambda kv, t: kv.load(TOY.encode(), t)),
    ("model", lambda kv, t: kv.load_into([TOY], t, bytearray(16))),
    ("model", lambda kv, t: kv.store_local(5, t, b"")),
    ("model", lambda kv, t: kv.load_local(None, t)),
    ("model", lambda kv, t: kv.resume(5, t)),
    ("model", lambda kv, t: kv.lookup_held(5, t, 1)),
    ("model", lambda kv, t: list(kv.iter_load(5, t))),
    ("cache_salt", lambda kv, t: kv.lookup(TOY, t, cache_salt=5)),
    ("cache_salt", lambda kv, t: kv.load(TOY, t, cache_salt=b"x")),
    ("cache_salt", lambda kv, t: kv.store(TOY, t, [], cache_salt=5)),
    ("replay_mode", lambda kv, t: kv.lookup(TOY, t, replay_mode=5)),
    ("replay_mode", lambda kv, t: kv.resume(TOY, t, replay_mode=None)),
    ("request_id", lambda kv, t: kv.lookup(TOY, t, request_id=5)),
    ("request_id", lambda kv, t: kv.resume(TOY, t, request_id=5)),
    ("session", lambda kv, t: kv.lookup(TOY, t, session=5)),
    ("session", lambda kv, t: kv.load_local(TOY, t, session=5)),
    ("purpose", lambda kv, t: kv.lookup(TOY, t, purpose=5)),  # crashed in its message
    ("purpose", lambda kv, t: kv.lookup(TOY, t, purpose=None)),
    ("into_session", lambda kv, t: kv.lookup_held(TOY, t, 1, into_session=5)),
    ("service", lambda kv, t: kv.health(service=5)),
]


@pytest.mark.parametrize(("name", "call"), _STRING_ARGUMENTS)
def test_an_argument_that_must_be_a_string_is_refused_naming_it(
        service: Service, name: str, call: Callable[[KvstoreClient, np.ndarray], object]) -> None:
    kv = service.client()
    with pytest.raises(InvalidInput, match=rf"^{name} must be a string, got "):
        call(kv, tokens(409, CHUNK))


def test_skip_chunks_must_be_a_bool(service: Service) -> None:
    kv = service.client()
    for value in ("yes", None, 1):
        with pytest.raises(InvalidInput, match=r"^skip_chunks must be True or False, got "):
            kv.resume(TOY, tokens(410, CHUNK), skip_chunks=value)
    assert kv.resume(TOY, tokens(410, CHUNK), skip_chunks=np.True_).chunks == []


def test_skip_present_must_be_a_bool(service: Service) -> None:
    # "no" is truthy: it skipped the chunks held, the opposite of what it says.
    kv = service.client()
    for value in ("no", None, 0):
        with pytest.raises(InvalidInput, match=r"^skip_present must be True or False, got "):
            kv.store(TOY, tokens(411, CHUNK), [bytes(service.chunk_bytes(TOY))], skip_present=value)
    assert kv.store(TOY, tokens(411, CHUNK), [bytes(service.chunk_bytes(TOY))], skip_present=False).stored_chunks == 1


# --- register_model -----------------------------------------------------------------------------------

_GROUP = EngineLayerGroup("full", 2, 2, 64, "bfloat16")
_MODEL = dict(model="m", revision="r1", groups=(_GROUP,), chunk_tokens=CHUNK, vocab_size=1000)


def _group(**changed: Any) -> EngineModel:
    fields = dict(name="full", num_layers=2, kv_heads=2, head_size=64, dtype="bfloat16") | changed
    return EngineModel(**{**_MODEL, "groups": (_GROUP, EngineLayerGroup(**fields))})


@pytest.mark.parametrize(("model", "message"), [
    (EngineModel(**{**_MODEL, "chunk_tokens": -16}), r"model\.chunk_tokens must be an integer from 0 to 4294967295, "
                                                     "got -16"),
    (EngineModel(**{**_MODEL, "chunk_tokens": 16.0}), r"model\.chunk_tokens must be an integer"),
    (EngineModel(**{**_MODEL, "vocab_size": 2**32 + 1000}), r"model\.vocab_size must be an integer"),
    (EngineModel(**{**_MODEL, "groups": None}), r"model\.groups must be a tuple of EngineLayerGroup"),
    (EngineModel(**{**_MODEL, "groups": ({"name": "full"},)}), r"model\.groups\[0\] must be a "
                                                               r"kvstore\.layout\.EngineLayerGroup, got dict"),
    (EngineModel(**{**_MODEL, "revision": None}), r"model\.revision must be a string"),
    (EngineModel(**{**_MODEL, "prefill_flops_per_token": "x"}), r"model\.prefill_flops_per_token must be a number"),
    (_group(num_layers=-1), r"model\.groups\[1\]\.num_layers must be an integer"),
    (_group(num_layers=2**32), r"model\.groups\[1\]\.num_layers must be an integer"),
    (_group(sliding_window=-1), r"model\.groups\[1\]\.sliding_window must be an integer"),
    (_group(kv_heads=1.5), r"model\.groups\[1\]\.kv_heads must be an integer"),
    (_group(latent="yes"), r"model\.groups\[1\]\.latent must be True or False"),
    (_group(dtype=None), r"model\.groups\[1\]\.dtype must be a string"),
    ({"model": "m"}, "register_model takes a kvstore.layout.EngineModel, got dict"),
])
def test_register_model_names_the_field_its_request_cannot_hold(service: Service, model: Any, message: str) -> None:
    kv = service.client()
    with pytest.raises((InvalidInput, InvalidArgumentError), match=message):
        kv.register_model(model)


def test_register_model_still_takes_numpy_integers_and_a_list_of_groups(service: Service) -> None:
    kv = service.client()
    name = kv.register_model(EngineModel(**_MODEL)).model
    same = EngineModel(**{**_MODEL, "groups": [_GROUP], "vocab_size": np.int64(1000)})
    assert kv.register_model(same).model == name


# --- token ids --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[True] * CHUNK, [5] * (CHUNK - 1) + [True], (5, False) * (CHUNK // 2),
                                 [7, 3, 2, 0, 9, 1, True, 8] * 2])
def test_bools_are_no_token_ids_in_a_list_either(service: Service, ids: list[Any]) -> None:
    # A list went through the array module, which packs True as 1, while np.ones(16, bool) was refused.
    kv = service.client()
    with pytest.raises(InvalidArgumentError, match="token ids must be integers in \\[0, 2\\*\\*32\\)"):
        kv.lookup(TOY, ids)


def test_token_ids_zero_and_one_are_still_token_ids(service: Service) -> None:
    kv = service.client()
    ids = [0, 1] + [int(t) for t in tokens(411, CHUNK - 2)]
    kv.store(TOY, ids, payloads(411, 1, service.chunk_bytes(TOY)))
    assert kv.lookup(TOY, ids).hit_tokens == CHUNK
    assert kv.lookup(TOY, tuple(ids)).hit_tokens == CHUNK


# --- load_into a buffer that holds no chunk ---------------------------------------------------------

def test_load_into_a_buffer_too_small_for_one_chunk_makes_no_call(service: Service) -> None:
    # It sent max_chunks=0, which means "all": the service leased and sent every chunk of the hit,
    # and the client dropped them.
    kv = service.client()
    cb = service.chunk_bytes(TOY)
    prompt = tokens(412, 3 * CHUNK)
    kv.store(TOY, prompt, payloads(412, 3, cb))  # its lookup tells the client the chunk size
    service.app.flush_observers()
    methods: list[str] = []
    service.app.observers.append(lambda rec: methods.append(rec.method))
    got = kv.load_into(TOY, prompt, bytearray(cb - 1))
    assert (got.loaded_chunks, got.hit_tokens, got.chunk_bytes, got.chunk_tokens, got.chunk_tiers) == (
        0, 0, cb, CHUNK, ())
    one = kv.load_into(TOY, prompt, bytearray(cb))
    assert one.loaded_chunks == 1
    service.app.flush_observers()
    assert methods.count("Load") == 1, methods  # only the second load_into called
    with pytest.raises(InvalidInput, match="model must be a string"):  # its arguments are checked all the same
        kv.load_into(5, prompt, bytearray(cb - 1))
