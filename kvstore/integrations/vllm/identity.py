"""Model identity: a fingerprint of the weight files, so changed weights never reuse old KV.

The fingerprint is a SHA-256 over every weight file's name and contents (a model directory's,
or a single weight file's, as a GGUF model is), its config (config.json, params.json) and its
modeling code (*.py, run with trust_remote_code). Hashing gigabytes at every start would cost
minutes, so each file's digest is remembered in a small JSON cache keyed by (path, size, mtime,
inode, ctime): an unchanged file is not read again; a rewritten one is, even one given back its
old size and mtime (cp -p, rsync -a, tar), since its ctime moved (only the kernel sets it). A
LoRA adapter's files are fingerprinted the same way (`adapter_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# The architecture is identity too (same weights, other config): a Mistral-format model's is
# params.json, and a model run with trust_remote_code computes with its own *.py modeling files.
CONFIG_FILES = ("config.json", "params.json")
CODE_SUFFIX = ".py"
ADAPTER_FILES = ("adapter_config.json",)  # a LoRA adapter's rank, alpha and target modules
READ_BYTES = 8 << 20
# Digests this process already read or computed, by the cache's key: a LoRA adapter is
# fingerprinted at each request, which then costs a stat per file, not a read of the JSON cache.
_KNOWN: dict[str, str] = {}
_DIGEST = re.compile(r"[0-9a-f]{64}")


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore" / "weight-fingerprints.json"


def weight_files(model_dir: Path, config_files: tuple[str, ...] = CONFIG_FILES) -> list[Path]:
    """A directory's weight and config files by name; a single weight file (GGUF) is itself."""
    if model_dir.is_file():
        return [model_dir]
    files = [p for p in model_dir.iterdir()
             if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.suffix == CODE_SUFFIX or p.name in config_files)]
    return sorted(files, key=lambda p: p.name)


def fingerprint(model_dir: Path, cache_path: Path | None = None, config_files: tuple[str, ...] = CONFIG_FILES) -> str:
    """The weights' fingerprint (hex, 32 chars) of a model directory or a single weight file;
    raises ValueError when there are no weight files."""
    files = weight_files(model_dir, config_files)
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    keys = [_cache_key(p) for p in files]
    cache: dict[str, str] | None = None
    changed = False
    total = hashlib.sha256(b"kvstore.weights\x00")
    for p, key in zip(files, keys, strict=True):
        digest = _KNOWN.get(key)
        if digest is None:
            if cache is None:
                cache = _read_cache(cache_path or default_cache_path())
            digest = cache.get(key)
            if digest is None:
                digest = cache[key] = _file_digest(p)
                changed = True
                _forget_older(cache, key)
            _KNOWN[key] = digest
        total.update(p.name.encode() + b"\x00" + bytes.fromhex(digest))
    if changed and cache is not None:
        _write_cache(cache_path or default_cache_path(), cache)
    return total.hexdigest()[:32]


def adapter_fingerprint(adapter_dir: Path, cache_path: Path | None = None) -> str:
    """A LoRA adapter's fingerprint: its weights and its adapter_config.json, as `fingerprint`."""
    return fingerprint(adapter_dir, cache_path, CONFIG_FILES + ADAPTER_FILES)


def local_files(name: str, revision: str | None = None) -> Path | None:
    """Where `name` (a path, or a Hugging Face repo already in the local cache) lies on this host;
    None where it is neither (never downloaded: vLLM fetches it later)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # not a repo id, or not in the cache: huggingface_hub raises several kinds
        return None


def _cache_key(p: Path) -> str:
    # A file rewritten in place keeps its inode and may be given back its size and mtime; its
    # ctime (set by the kernel on every write or utime) moves all the same.
    st = p.stat()
    return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


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
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and _DIGEST.fullmatch(v)}


def _forget_older(cache: dict[str, str], key: str) -> None:
    """Drop the digests of the same path's earlier contents: the file is rewritten, they can
    never be asked for again, and a cache kept for years would grow at every rewrite."""
    path = key.split("|", 1)[0] + "|"
    for old in [k for k in cache if k.startswith(path) and k != key]:
        del cache[old]


def _write_cache(path: Path, cache: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
    except OSError:
        return  # read-only home: the fingerprint is still right, only computed again next time
    try:
        tmp.write_text(json.dumps(cache, sort_keys=True))
        tmp.replace(path)  # atomic: two engines starting together never leave half a file
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file left per engine pid
