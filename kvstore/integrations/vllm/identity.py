"""Model identity: a fingerprint of the weight files, so changed weights never reuse old KV.

The fingerprint is a SHA-256 over every weight file's name and contents. Hashing gigabytes at
every start would cost minutes, so each file's digest is remembered in a small JSON cache keyed
by (path, size, mtime): an unchanged file is not read again; a rewritten one is.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
CONFIG_FILES = ("config.json",)  # the architecture is identity too (same weights, other config)
READ_BYTES = 8 << 20


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore" / "weight-fingerprints.json"


def weight_files(model_dir: Path) -> list[Path]:
    files = [p for p in model_dir.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES)]
    return sorted(files, key=lambda p: p.name)


def fingerprint(model_dir: Path, cache_path: Path | None = None) -> str:
    """The weights' fingerprint (hex, 32 chars); raises ValueError when there are no weight files."""
    files = weight_files(model_dir)
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    cache_path = cache_path or default_cache_path()
    cache = _read_cache(cache_path)
    changed = False
    total = hashlib.sha256(b"kvstore.weights\x00")
    for p in files:
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = cache.get(key)
        if digest is None:
            digest = _file_digest(p)
            cache[key] = digest
            changed = True
        total.update(p.name.encode() + b"\x00" + bytes.fromhex(digest))
    if changed:
        _write_cache(cache_path, cache)
    return total.hexdigest()[:32]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(READ_BYTES):
            h.update(block)
    return h.hexdigest()


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: rehash (it is only a cache)
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 64}


def _write_cache(path: Path, cache: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        tmp.replace(path)  # atomic: two engines starting together never leave half a file
    except OSError:
        pass  # read-only home: the fingerprint is still right, only computed again next time
