"""A file a flag names that cannot be written after the run (a full disk; /dev/full here) ends the
command with one line naming the flag and the path, exit 1, not an OSError traceback."""

from __future__ import annotations

import pytest

from kvstore.cli import main

_SMALL = ["bench", "workload", "--sessions", "4", "--turns", "2"]


@pytest.mark.parametrize("flag", ["--markdown", "--trace"])
def test_an_output_that_cannot_be_written_is_one_line_naming_the_flag(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_SMALL, flag, "/dev/full"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"kvstore bench: {flag} /dev/full: cannot write it: No space left on device"
    assert not any(line.startswith("Traceback") for line in err)


def test_two_outputs_and_a_failed_write_name_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_SMALL, "--markdown", "/dev/full", "--trace", "/dev/full"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvstore bench: cannot write an output (--markdown /dev/full, --trace /dev/full): No space left on device")
