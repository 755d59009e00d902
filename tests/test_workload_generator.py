"""The workload generator: deterministic from its seed, prefix-consistent, shaped as specified."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidInput
from kvstore.observe.trace_file import TraceRecord, read_trace
from kvstore.workload.generator import Workload, WorkloadSpec, generate, tenant_sizes
from kvstore.workload.thinktime import ThinkTime
from kvstore.workload.tracing import planned_trace, write_trace

SPEC = WorkloadSpec(sessions=40, turns=6, context_tokens=20_000, system_tokens=2_048, output_tokens=200,
                    tenants=3, concurrency=10, seed=7)


def test_same_seed_same_requests_and_tokens() -> None:
    a, b = generate(SPEC), generate(SPEC)
    assert a == b
    assert a.planned_requests() == b.planned_requests()
    s = a.sessions[5]
    np.testing.assert_array_equal(a.context_token_ids(s, 129_280), b.context_token_ids(b.sessions[5], 129_280))


def test_different_seed_different_requests_and_tokens() -> None:
    a = generate(SPEC)
    b = generate(WorkloadSpec(**{**SPEC.__dict__, "seed": 8}))
    assert a.sessions != b.sessions
    assert [r.time_seconds for r in a.planned_requests()] != [r.time_seconds for r in b.planned_requests()]
    assert not np.array_equal(a.context_token_ids(a.sessions[0], 512), b.context_token_ids(b.sessions[0], 512))


def test_turns_grow_a_prefix_to_the_context_length() -> None:
    w = generate(SPEC)
    for s in w.sessions:
        prompt = s.system_tokens
        for t in s.turns:
            assert t.tool_tokens >= 0 and t.user_tokens >= 0 and t.new_tokens >= 1
            prompt += t.new_tokens
            assert t.prompt_tokens == prompt
            prompt += t.output_tokens
        assert s.turns[-1].prompt_tokens == SPEC.context_tokens  # exactly, by construction
        assert s.turns[0].think_seconds == 0.0 and all(t.think_seconds > 0 for t in s.turns[1:])
    s = w.sessions[3]
    ctx = w.context_token_ids(s, 512)
    assert ctx.shape == (s.turns[-1].context_after_tokens,)
    for k in range(len(s.turns)):  # each prompt is a prefix of the whole context
        np.testing.assert_array_equal(w.prompt_token_ids(s, k, 512), ctx[: s.turns[k].prompt_tokens])
    other = next(o for o in w.sessions if o.tenant == s.tenant and o.index != s.index)
    np.testing.assert_array_equal(w.context_token_ids(other, 512)[: SPEC.system_tokens], ctx[: SPEC.system_tokens])


def test_tenants_have_zipf_sizes_and_slots_bound_concurrency() -> None:
    assert tenant_sizes(SPEC) == [21, 11, 8]  # 37 spare sessions split 1 : 1/2 : 1/3, plus one each
    w = generate(SPEC)
    counts = [sum(1 for s in w.sessions if s.tenant_index == i) for i in range(3)]
    assert counts == tenant_sizes(SPEC)
    slots = w.sessions_by_slot()
    assert len(slots) == 10 and all(len(slot) == 4 for slot in slots)
    assert all(slot[0].first_in_slot and not any(s.first_in_slot for s in slot[1:]) for slot in slots)
    times = [r.time_seconds for r in w.planned_requests()]
    assert times == sorted(times) and len(times) == w.requests == 40 * 6


def test_think_time_mixture_straddles_the_ttl() -> None:
    think = ThinkTime.parse("0.6*lognormal(4,0.8)+0.4*lognormal(200,1.0)")
    gaps = think.sample(np.random.default_rng(0), 200_000)
    for ttl in (30.0, 300.0, 1000.0):
        assert float(np.mean(gaps > ttl)) == pytest.approx(think.fraction_above(ttl), abs=0.005)
    assert 0.05 < think.fraction_above(300.0) < 0.3  # some returns expire, most do not
    assert ThinkTime.parse("fixed(5)").describe() == "1*fixed(5)"
    for bad in ("", "lognormal(1)", "2*nope(3)", "uniform(5,1)", "-1*fixed(2)"):
        with pytest.raises(InvalidInput):
            ThinkTime.parse(bad)


@pytest.mark.parametrize(("spec", "said"), [
    # A NaN passed `nan < 0` and met an assertion in the pool model; inf gaps never ended; weights whose
    # sum overflowed ended in numpy's "probabilities do not sum to 1"; lognormal(1,1000) drew inf gaps,
    # and a gap of 1e300 s overflowed simulated time to inf after a few turns.
    ("fixed(nan)", "has a value that is not a finite number"),
    ("fixed(inf)", "has a value that is not a finite number"),
    ("1e400*fixed(1)", "has a value that is not a finite number"),
    ("uniform(1,inf)", "has a value that is not a finite number"),
    ("1e308*fixed(1)+1e308*fixed(2)", "weights sum to inf; the sum must be a finite number"),
    ("lognormal(1,1000)", "lognormal needs sigma in (0, 10]"),
    ("fixed(1e300)", "has a time above 1e+09 s"),
    ("exp(2e9)", "has a time above 1e+09 s"),
])
def test_a_think_time_that_is_not_finite_or_overflows_is_refused(spec: str, said: str) -> None:
    with pytest.raises(InvalidInput) as e:
        ThinkTime.parse(spec)
    assert said in str(e.value) and "\n" not in str(e.value), e.value


def test_a_uniform_think_time_of_no_width_is_a_fixed_one() -> None:
    # fraction_above divided by b - a: a ZeroDivisionError from `kvstore bench workload`.
    think = ThinkTime.parse("uniform(5,5)")
    assert [think.fraction_above(t) for t in (0.0, 4.9, 5.0, 300.0)] == [1.0, 1.0, 0.0, 0.0]
    assert [think.fraction_above(t) for t in (0.0, 4.9, 5.0, 300.0)] == [
        ThinkTime.parse("fixed(5)").fraction_above(t) for t in (0.0, 4.9, 5.0, 300.0)]
    w = generate(WorkloadSpec(sessions=4, turns=3, context_tokens=4_096, system_tokens=256, output_tokens=16,
                              tenants=1, think_time="uniform(5,5)"))
    assert {t.think_seconds for s in w.sessions for t in s.turns[1:]} == {5.0}


def test_a_steep_tenant_skew_gives_the_first_tenant_the_spare_sessions() -> None:
    # (i+1)**2000 overflowed (OverflowError); a negative power underflows to 0 instead.
    spec = WorkloadSpec(sessions=10, turns=2, context_tokens=4_096, system_tokens=256, output_tokens=16, tenants=3,
                        tenant_skew=2000.0)
    assert tenant_sizes(spec) == [8, 1, 1]
    assert tenant_sizes(WorkloadSpec(sessions=10, turns=2, context_tokens=4_096, system_tokens=256,
                                     output_tokens=16, tenants=2, tenant_skew=0.0)) == [5, 5]


def test_bad_specs_fail_fast() -> None:
    with pytest.raises(InvalidInput, match="no room"):
        WorkloadSpec(sessions=1, turns=10, context_tokens=1000, system_tokens=900, tenants=1)
    with pytest.raises(InvalidInput, match="tenants"):
        WorkloadSpec(sessions=2, tenants=3)


@pytest.mark.parametrize("field", ["ramp_seconds", "tenant_skew", "length_jitter_sigma"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_float_that_is_not_finite_is_refused(field: str, value: float) -> None:
    # NaN passed the `< 0` checks and ended in an OverflowError (ramp) or NaN tenant sizes later.
    with pytest.raises(InvalidInput, match=f"{field} must be a finite number"):
        WorkloadSpec(sessions=4, turns=2, context_tokens=4_096, system_tokens=256, output_tokens=16, tenants=2,
                     **{field: value})


@pytest.mark.parametrize("seed", [-1, 2**32, 2**32 + 7])
def test_a_seed_outside_32_bits_is_refused_not_wrapped(seed: int) -> None:
    # 2**32 + 7 was the workload of seed 7, silently.
    with pytest.raises(InvalidInput, match=r"seed must be in \[0, 2\*\*32\)"):
        WorkloadSpec(sessions=4, seed=seed)
    WorkloadSpec(sessions=4, seed=2**32 - 1)


def test_plan_writes_the_trace_format(tmp_path: Path) -> None:
    w = generate(SPEC)
    records = planned_trace(w, ttl_seconds=300.0, chunk_tokens=128, snapshot_bytes=1_351_680, replay_tokens=128)
    assert len(records) == w.requests
    n = write_trace(records, tmp_path / "plan.jsonl")
    back = list(read_trace(tmp_path / "plan.jsonl"))
    assert n == len(back) == w.requests and back == records
    first = [r for r in back if r.local_outcome == "absent"]
    assert len(first) == SPEC.sessions  # every first turn hits its tenant's system prompt
    gaps = {(s.name, t.turn): t.think_seconds for s in w.sessions for t in s.turns}
    for r in back:
        if r.local_outcome in ("hit", "replayed"):
            assert (r.local_outcome == "hit") == (gaps[(r.session, _turn(w, r))] <= 300.0)


def _turn(w: Workload, r: TraceRecord) -> int:
    s = next(s for s in w.sessions if s.name == r.session)
    return next(t.turn for t in s.turns if t.prompt_tokens == r.prefix_tokens)


def test_a_trace_written_is_whole_or_not_there_and_killed_writers_temps_are_swept(tmp_path: Path) -> None:
    # `bench workload --trace FILE` cut FILE in place: a run killed part-way left a shorter trace
    # that read as complete. And a killed `tune --save-trace` left its hidden temp file for good.
    import subprocess
    import sys

    records = planned_trace(generate(SPEC), ttl_seconds=300.0, chunk_tokens=128, snapshot_bytes=1_351_680,
                            replay_tokens=128)
    path = tmp_path / "plan.jsonl"
    assert write_trace(records, path) == len(records)

    def cut_short() -> Iterator[TraceRecord]:
        yield from records[:10]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_trace(cut_short(), path)
    assert list(read_trace(path)) == records  # the old trace, whole
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".plan.jsonl.{dead}-0a1b2c3d.tmp"
    live = tmp_path / f".plan.jsonl.{os.getpid()}-0a1b2c3d.tmp"  # a writer still at work: left alone
    stale.write_text("{}\n")
    live.write_text("{}\n")
    assert write_trace(records[:3], path) == 3
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "plan.jsonl"])
