"""`kvstore --help` and building the parser import neither torch nor grpc: every bench module
imports what it measures, and `kvstore --help`, `kvstore layout list` or `kvstore tune` paid for
all of them (1.4 s, most of it torch). Each case runs in a fresh interpreter, the only place
where "not imported yet" means anything."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "grpc")

# Python run in a fresh process; it prints which of HEAVY it imported, as JSON, on its last line.
CASES = {
    "build_parser": "from kvstore.cli import build_parser\nbuild_parser()",
    "--help": "from kvstore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "bench --help": "from kvstore.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass",
    "stats --help": "from kvstore.cli import main\ntry:\n    main(['stats', '--help'])\nexcept SystemExit:\n    pass",
    "explain --help": "from kvstore.cli import main\ntry:\n    main(['explain', '--help'])\nexcept SystemExit:\n"
                      "    pass",
    "layout list": "from kvstore.cli import main\nmain(['layout', 'list'])",
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_parser_and_help_import_neither_torch_nor_grpc(case: str) -> None:
    code = CASES[case] + f"\nimport sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], f"{case} imported them"


def test_a_bench_still_gets_its_flags_and_its_runner_when_chosen() -> None:
    # Its flags come in as its parser is used: the bench chosen, and only it, is imported.
    code = ("import json, sys\nfrom kvstore.cli import build_parser\n"
            "a = build_parser().parse_args(['bench', 'pool', '--ops', '3'])\n"
            "print(json.dumps([a.ops, a._bench.__name__, 'kvstore.bench.store' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [3, "run_pool_bench", False]
