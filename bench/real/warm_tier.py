"""Can LMCache be the warm tier here? A probe on the real tier's vLLM CPU build.

``python -m carryover.bench.real.warm_tier [--ttl 40] [--out results/warm-tier]`` (docs/warm-tier.md):

1. an environment beside the real tier's (its packages through a ``.pth`` file, so the tier
   itself is untouched) with LMCache's wheel installed without its CUDA dependencies;
2. a standalone ``lmcache server``, and a P/D pair whose engines each compose NIXL (P/D,
   bidirectional) and LMCache (``LMCacheMPConnector`` against that server) with vLLM's
   ``MultiConnector``; D also stores chunks that hold generated tokens;
3. turn 1 through P and D; D's handle is left to expire (``decoder_kv_blocks_ttl``); P's own
   prefix cache is emptied (as load would); turn 2, the whole history plus a new message, goes
   to P with no handle;
4. what each engine computed, hit locally and loaded (vLLM's ``prompt_tokens_by_source``), and
   turn 2's answer against a cold reference (the same prompt with a ``cache_salt``).

It prints a JSON report; nothing here is used by the router or the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.fleet_counters import engine_prompt_sources
from carryover.bench.ports import free_port
from carryover.bench.real.launch import SERVED_NAME, _serve_args, ensure_model
from carryover.bench.real.lmcache import LMCACHE, LmcacheServer, ensure_lmcache_env, multi_connector
from carryover.bench.real.process import bind_workers, offline_env, spawn, stop_group, wait_healthy

__all__ = ["probe"]

#: Each engine's role and the core its model runs on.
_CORES = (("prefill", 0), ("decode", 1))


def _kv_config(role: str, server: LmcacheServer, ttl: float) -> dict[str, Any]:
    producer = role == "prefill"
    nixl: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if producer else "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    }
    if producer:
        nixl["kv_load_failure_policy"] = "fail"
        return multi_connector(nixl, server)
    nixl["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] = ttl
    # Chunks that hold the answer, too (it stored none: docs/warm-tier.md).
    return multi_connector(nixl, server, **{"lmcache.mp.save_decode_cache": True})


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def probe(out: Path, *, ttl: float = 40.0) -> dict[str, Any]:
    python = ensure_lmcache_env()
    model = ensure_model()
    out.mkdir(parents=True, exist_ok=True)
    server = LmcacheServer(out / "lmcache.log")
    processes: list[subprocess.Popen[bytes]] = []
    report: dict[str, Any] = {"lmcache": LMCACHE, "decoder_kv_blocks_ttl": ttl}
    try:
        server.start()
        urls: dict[str, str] = {}
        for role, core in _CORES:
            port = free_port()
            args = [
                *("nice", "-n", "10", str(python), "-m", "vllm.entrypoints.openai.api_server"),
                *_serve_args(model, port),
                "--enable-prompt-tokens-details",
                *("--kv-transfer-config", json.dumps(_kv_config(role, server, ttl))),
            ]
            env = offline_env(
                VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_CPU_OMP_THREADS_BIND=str(core),  # one core each: two spinning engines
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
                VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            )
            processes.append(spawn(args, out / f"{role}.log", env))
            urls[role] = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        for (role, url), popen in zip(urls.items(), processes, strict=True):
            wait_healthy(popen, url, out / f"{role}.log", deadline=started + 900, what=role)
        for popen, (_, core) in zip(processes, _CORES, strict=True):
            bind_workers(popen, core)
        report["start_s"] = round(time.monotonic() - started, 1)
        report.update(_turns(urls["prefill"], urls["decode"], ttl))
    finally:
        stop_group(*processes, timeout=30)
        server.stop()
    (out / "warm-tier.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


def _turns(p: str, d: str, ttl: float) -> dict[str, Any]:
    client = httpx.Client(timeout=600)

    def complete(url: str, prompt: list[int], tokens: int, **extra: Any) -> dict[str, Any]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_token_ids": True,
            **extra,
        }
        answer = client.post(f"{url}/v1/completions", json=body)
        answer.raise_for_status()
        found: dict[str, Any] = answer.json()
        return found

    first = list(range(1000, 2200))  # 1,200 prompt tokens, 100 answered: 1,300 in all
    before = {"p": engine_prompt_sources(p), "d": engine_prompt_sources(d)}
    p1 = complete(p, first, 1, kv_transfer_params={"do_remote_decode": True})
    d1 = complete(d, first, 100, kv_transfer_params=p1["kv_transfer_params"])
    turn1 = {
        "p": _delta(engine_prompt_sources(p), before["p"]),
        "d": _delta(engine_prompt_sources(d), before["d"]),
    }
    second = first + d1["choices"][0]["token_ids"] + list(range(3000, 3300))
    # The handle is never sent: D's TTL passes, as it does while a person reads the answer.
    time.sleep(ttl + 15)
    client.post(f"{p}/reset_prefix_cache").raise_for_status()
    before = {"p": engine_prompt_sources(p), "d": engine_prompt_sources(d)}
    p2 = complete(p, second, 1, kv_transfer_params={"do_remote_decode": True})
    warm = complete(d, second, 8, kv_transfer_params=p2["kv_transfer_params"])["choices"][0]
    turn2 = {
        "p": _delta(engine_prompt_sources(p), before["p"]),
        "d": _delta(engine_prompt_sources(d), before["d"]),
    }
    before_ref = engine_prompt_sources(d)
    cold = complete(d, second, 8, cache_salt="cold reference")["choices"][0]
    reference = _delta(engine_prompt_sources(d), before_ref)
    return {
        "turn1": {"prompt_tokens": len(first), "sources": turn1},
        "turn2": {
            "prompt_tokens": len(second),
            "sources": turn2,
            "p_cached_tokens": p2["usage"]["prompt_tokens_details"]["cached_tokens"],
        },
        "reference_sources_on_d": reference,
        "answers_equal": warm["token_ids"] == cold["token_ids"],
        "max_logprob_difference": max(
            abs(a - b)
            for a, b in zip(
                warm["logprobs"]["token_logprobs"], cold["logprobs"]["token_logprobs"], strict=True
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", type=float, default=40.0, help="D's decoder_kv_blocks_ttl")
    parser.add_argument("--out", type=Path, default=Path("results/warm-tier"))
    args = parser.parse_args()
    probe(args.out, ttl=args.ttl)


if __name__ == "__main__":
    main()
