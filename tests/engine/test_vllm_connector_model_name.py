"""The connector's default model name (the model's directory or file name) is one the service
takes: a directory named with more than 128 characters, or with a tab, made every RegisterModel
fail and the engine ran with caching off. Real model directories; the check is the service's own
(`engine_model_spec`, what RegisterModel runs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.connector import model_identity
from kvstore.layout import EngineLayerGroup, EngineModel, engine_model_spec

LONG = "Qwen2.5-7B-Instruct-" + "finetune-" * 14  # 146 characters


def _name(root: Path, dirname: str) -> str:
    d = root / dirname
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    mc = SimpleNamespace(model=str(d), revision=None, quantization=None, dtype="bfloat16", hf_overrides=None)
    name, revision = model_identity(mc, ConnectorConfig.from_extra({"address": "127.0.0.1:1", "revision": "r1"}))
    # What RegisterModel checks: it raised InvalidInput("model must be 1-128 printable characters").
    engine_model_spec(EngineModel(model=name, revision=revision, chunk_tokens=16, vocab_size=1000,
                                  groups=(EngineLayerGroup("full", 2, 2, 64, "bfloat16"),)))
    return name


def test_a_model_directory_name_the_service_would_refuse_becomes_one_it_takes(tmp_path: Path) -> None:
    assert _name(tmp_path, "Llama-3.1-8B") == "Llama-3.1-8B"  # a valid one stays as it is
    assert _name(tmp_path, "m" * 128) == "m" * 128
    for dirname, start in (("m" * 129, "m" * 96 + "~"), (LONG, LONG[:96] + "~"), ("weird\tname", "weird_name~")):
        name = _name(tmp_path, dirname)
        assert name.startswith(start) and len(name) <= 128 and name.isprintable(), name
        assert _name(tmp_path, dirname) == name  # the same at every start: the same namespace


def test_distinct_long_or_unprintable_names_stay_distinct(tmp_path: Path) -> None:
    # The same readable start, and names that differ only where a replacement character goes.
    given = [LONG + "a", LONG + "b", "m" * 200, "m" * 201, "weird\tname", "weird\nname", "weird_name"]
    names = [_name(tmp_path, g) for g in given]
    assert len(set(names)) == len(given), names


def test_a_configured_model_name_that_is_no_valid_name_is_still_refused_at_start() -> None:
    for bad in ("m" * 129, "weird\tname"):
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.model_name"):
            ConnectorConfig.from_extra({"address": "127.0.0.1:1", "model_name": bad})
