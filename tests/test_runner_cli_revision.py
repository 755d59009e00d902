"""`kvstore runner --revision`: a model of the reference model's layout that the service serves under
another revision than the reference model's "1" (registered so) expects runners to declare that
revision. Without the flag every such runner was refused, told to change its `--seed`. Real
service, real gRPC, the real `kvstore runner` process attaching over the service's own Runners
servicer (tests/helpers/attach_service.py)."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from kvstore.layout import MAX_ENGINE_NAME, register_model
from tests.fixtures.service import Service
from tests.helpers.attach_service import AttachService, start_attach_service
from tests.test_replay_coordinator import SPEC, wait_for
from tests.test_runner_weights import spawn_runner

# The reference model's layout, served as a model of its own at revision "r2".
R2 = "reference-toy-8-r2"
SPEC_R2 = replace(SPEC, name=R2, revision="r2", layout=replace(SPEC.layout, name=R2))
register_model(SPEC_R2)


@pytest.fixture
def serving_r2(make_service: Callable[..., Service]) -> Iterator[AttachService]:
    yield start_attach_service(make_service, [SPEC.name, R2])


def test_a_runner_of_the_reference_revision_is_told_the_revision_differs_not_the_seed(
        serving_r2: AttachService) -> None:
    r = serving_r2
    proc = spawn_runner(r.address, "--model", R2)  # declares "1+seed=0"
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if "refused this runner: INVALID_ARGUMENT" in ln]
    assert "'1+seed=0'" in line and "'r2+seed=0'" in line, line
    assert "its revision '1' is not the model's revision 'r2'" in line and "--revision=r2" in line, line
    assert "--seed" not in line.split("start the runner with", 1)[1], line  # the seed is right
    assert r.svc.app.runners.runners() == [] and r.servicer.refused_total == 1


def test_a_runner_declaring_the_served_revision_attaches(serving_r2: AttachService) -> None:
    r = serving_r2
    proc = spawn_runner(r.address, "--model", R2, "--revision", "r2")
    try:
        wait_for(lambda: len(r.svc.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert [x.model for x in r.svc.app.runners.runners()] == [R2]
        assert (r.servicer.refused_total, r.servicer.unverified_total) == (0, 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "weights r2+seed=0" in out, out


def test_both_parts_wrong_names_both_flags() -> None:
    from kvstore.service.runners_servicer import expected_weights

    want = expected_weights({R2: SPEC_R2}, 16, 3)(R2)
    assert want is not None and want.identity == "r2+seed=3"
    said = want.mismatch("1+seed=0")
    assert "revision '1'" in said and "seed '0'" in said and said.endswith("--revision=r2 --seed 3"), said
    assert want.mismatch("r2+seed=0").endswith("start the runner with --seed 3")
    # No seed in it at all (another kind of runner): both parts to set.
    assert want.mismatch("weights-abc").startswith("start the runner with --revision=r2 --seed 3")


@pytest.mark.parametrize("bad", ["", "a\nb", "x" * (MAX_ENGINE_NAME + 1)])
def test_a_bad_revision_is_one_line_before_anything_is_dialled(bad: str) -> None:
    # Port 1: nothing listens there; the flag is refused before the model loads or anything is dialled.
    cmd = [sys.executable, "-m", "kvstore", "runner", "--connect", "127.0.0.1:1", "--revision", bad]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore runner: --revision must be 1 to 128 printable"), lines
    assert "Traceback" not in done.stderr and len(lines[0]) < 200


@pytest.mark.parametrize("declared", ["1+seed=0", "weights-abc"])
def test_the_hint_for_a_revision_starting_with_a_dash_parses_as_that_revision(declared: str) -> None:
    # RegisterModel accepts a revision "-r2"; the hint said `--revision -r2`, which argparse reads
    # as a flag without its value ("expected one argument").
    from kvstore.cli import build_parser
    from kvstore.commands.runner import check_revision
    from kvstore.layout import _check_name
    from kvstore.service.runners_servicer import expected_weights

    _check_name("revision", "-r2")
    spec = replace(SPEC, name="toy-dash", revision="-r2", layout=replace(SPEC.layout, name="toy-dash"))
    want = expected_weights({"toy-dash": spec}, 16, 0)("toy-dash")
    assert want is not None
    flags = shlex.split(want.mismatch(declared).split("start the runner with ", 1)[1].split(" (", 1)[0])
    args = build_parser().parse_args(["runner", "--connect", "127.0.0.1:1", *flags])
    assert (args.revision, args.seed) == ("-r2", 0), flags
    check_revision(args.revision)
