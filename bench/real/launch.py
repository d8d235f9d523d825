"""Start a real vLLM prefill/decode pair on this machine (CPU build, NIXL, bidirectional).

P and D start and stop together: restarting P alone while D ran hung P's start for minutes on
a 2-core machine (``docs/vllm-protocol.md`` §7). Each instance's model runs on a core of its
own (``bind_workers``), and an idle instance keeps a core busy, so stop them when done.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.ports import free_port
from carryover.bench.real.env import ensure_env, env_dir
from carryover.bench.real.lmcache import LmcacheServer, ensure_lmcache_env, multi_connector
from carryover.bench.real.process import (
    StartTimedOut,
    bind_workers,
    offline_env,
    spawn,
    stop_group,
    vllm_module,
    wait_healthy,
)
from carryover.router.render.chat_template import bundled_qwen3_dir

__all__ = [
    "FAMILIES",
    "SERVED_NAME",
    "EngineDied",
    "VllmInstance",
    "VllmPair",
    "ensure_model",
    "served_name",
    "single_engine",
]

SERVED_NAME = "tiny-qwen3"
CPU_BLOCK_SIZE = 128  # vLLM's CPU build


class EngineDied(RuntimeError):
    """An instance exited during the warm-up (seen here: a first NIXL transfer whose worker
    hung until vLLM's five-minute RPC deadline killed the engine); the pair is started anew."""


#: The model families the tier builds (``make_model.py``): Qwen3 serves every test but
#: those that show the render check and reuse on the others.
FAMILIES = ("qwen3", "llama2", "mistral")


def served_name(family: str = "qwen3") -> str:
    return SERVED_NAME if family == "qwen3" else f"tiny-{family}"


def ensure_model(family: str = "qwen3") -> Path:
    """The seeded random tiny model of ``family``, generated on first use next to the
    environment, in a folder named by what generates it (a changed script or template
    makes a new one)."""
    python = ensure_env()
    script = Path(__file__).with_name("make_model.py")
    digest = hashlib.sha256(script.read_bytes())
    template = script.parent / "templates" / f"{family}.jinja"
    if template.exists():
        digest.update(template.read_bytes())
    folder = env_dir().parent / f"rand-{family}-{digest.hexdigest()[:10]}"
    if not (folder / "model.safetensors").exists():
        source = [str(bundled_qwen3_dir())] if family == "qwen3" else []
        subprocess.run([str(python), str(script), family, str(folder), *source], check=True)
    return folder


_API_SERVER = "vllm.entrypoints.openai.api_server"
#: On every engine process's path: NIXL's progress thread waits instead of spinning
#: (engine_site/sitecustomize.py).
ENGINE_SITE = Path(__file__).parent / "engine_site"


def _serve_args(model: Path, port: int, name: str = SERVED_NAME) -> list[str]:
    """What every engine of this tier is started with: the tiny model in float32, a 2k
    context, eager mode (no compile time on the CPU build), loopback."""
    return [
        *("--model", str(model), "--served-model-name", name),
        *("--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8"),
        "--enforce-eager",
        *("--host", "127.0.0.1", "--port", str(port)),
    ]


@contextmanager
def single_engine(
    log: Path, *extra: str, family: str = "qwen3", env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """One ``vllm serve`` of the tiny model of ``family``, no P/D (``extra``: parsers,
    ``--tokens-only``; ``env``: more of its environment); its URL and pid, stopped with its
    whole group on exit."""
    port = free_port()
    serve = _serve_args(ensure_model(family), port, served_name(family))
    args = [*vllm_module(_API_SERVER, nice=False), *serve, *extra]
    popen = spawn(args, log, offline_env(VLLM_CPU_KVCACHE_SPACE="1", **(env or {})))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(popen, url, log, deadline=time.monotonic() + 600, what="the engine")
        yield url, popen.pid
    finally:
        stop_group(popen, timeout=60)


@dataclass
class VllmInstance:
    role: str  # "prefill" | "decode"
    port: int
    side_port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    @property
    def core(self) -> int:
        """The core its model runs on: P on the first, D on the second."""
        return 0 if self.role == "prefill" else 1

    @property
    def kv_events(self) -> str:
        """Where a subscriber connects (vLLM binds ``tcp://*:port``)."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def kv_events_replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class VllmPair:
    log_dir: Path
    p_extra: dict[str, Any] = field(default_factory=dict)
    d_extra: dict[str, Any] = field(default_factory=dict)
    p_args: list[str] = field(default_factory=list)
    d_args: list[str] = field(default_factory=list)
    kv_events: bool = False  # both engines publish KV events (and keep them for replay)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache and the like
    tokens_only: bool = False  # --tokens-only: /inference/v1/generate, no tokenizer
    # A warm tier: both engines also reach this LMCache server (vLLM's MultiConnector).
    lmcache: LmcacheServer | None = None
    prefill: VllmInstance | None = None
    decode: VllmInstance | None = None
    family: str = "qwen3"  # the model both serve (FAMILIES)

    @property
    def served_name(self) -> str:
        return served_name(self.family)

    def _command(self, instance: VllmInstance, model: Path) -> tuple[list[str], dict[str, str]]:
        producer = instance.role == "prefill"
        config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                **(self.p_extra if producer else self.d_extra),
            },
        }
        if producer:
            config["kv_load_failure_policy"] = "fail"  # "recompute" hangs on a bad handle
        python = None
        if self.lmcache is not None:
            config = multi_connector(config, self.lmcache)
            python = ensure_lmcache_env()
        args = [
            *vllm_module(_API_SERVER, python=python),
            *_serve_args(model, instance.port, self.served_name),
            # usage.prompt_tokens_details.cached_tokens in answers: what P did not compute.
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(config),
            *(self.p_args if producer else self.d_args),
            *(["--tokens-only"] if self.tokens_only else []),
        ]
        if self.kv_events:
            # A "*" endpoint binds (vLLM connects to any other); the replay socket always binds.
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{instance.events_port}",
                "replay_endpoint": f"tcp://*:{instance.replay_port}",
            }
            args += ["--kv-events-config", json.dumps(events)]
        env = offline_env(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(instance.core),
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(instance.side_port),
            VLLM_LOGGING_LEVEL="INFO",
            PYTHONPATH=str(ENGINE_SITE),
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return args, env

    def start(self, timeout: float = 420.0, attempts: int = 2) -> None:
        """Start both and wait for their /health. A start that hangs (seen in the kernel on
        this 2-core machine, see ``stop``) is stopped and tried again, on the same ports."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                return
            except StartTimedOut:
                self.stop()
                if attempt == attempts:
                    raise

    def _start_once(self, timeout: float) -> None:
        model = ensure_model(self.family)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%H%M%S")
        # A restart keeps the ports: to the router it is the same instance, come back.
        if self.prefill is None or self.decode is None:
            self.prefill = VllmInstance(
                "prefill", free_port(), free_port(), self.log_dir / "prefill.log"
            )
            self.decode = VllmInstance(
                "decode", free_port(), free_port(), self.log_dir / "decode.log"
            )
        self.prefill.log = self.log_dir / f"prefill-{stamp}.log"
        self.decode.log = self.log_dir / f"decode-{stamp}.log"
        if self.lmcache is not None and self.lmcache.popen is None:
            self.lmcache.log = self.log_dir / f"lmcache-{stamp}.log"
            self.lmcache.start()
        for instance in (self.prefill, self.decode):
            args, env = self._command(instance, model)
            instance.popen = spawn(args, instance.log, env)
        deadline = time.monotonic() + timeout
        for instance in (self.prefill, self.decode):
            assert instance.popen is not None
            try:
                wait_healthy(
                    instance.popen,
                    instance.url,
                    instance.log,
                    deadline=deadline,
                    what=f"vLLM {instance.role}",
                )
            except StartTimedOut:
                raise
            except RuntimeError:
                self.stop()
                raise
        for instance in (self.prefill, self.decode):
            assert instance.popen is not None
            bind_workers(instance.popen, instance.core)

    def warm_up(self, timeout: float = 900.0) -> None:
        """A full bidirectional cycle (P->D, then D->P and P->D again) and a first sampled
        request on each instance, before anything is timed or expires.

        The first NIXL transfer each way registers every block (about 30 s each way here; a
        first forward pass took 41 s on two loaded cores). A cycle that fails (a handshake
        outlasting a handle's lifetime, say) is run again from its start: the handshakes it
        began persist, so every attempt gets further. When ``timeout`` passes, this raises with
        every failure seen and the tail of both engines' logs; the caller stops the pair."""
        assert self.prefill is not None and self.decode is not None
        p, d = self.prefill.url, self.decode.url
        deadline = time.monotonic() + timeout
        failures: list[str] = []

        def post(
            url: str, prompt: list[int], max_tokens: int, kv: dict[str, Any] | None
        ) -> dict[str, Any]:
            sampling = {"max_tokens": max_tokens, "ignore_eos": True, "logprobs": 1}
            body: dict[str, Any]
            if self.tokens_only:
                body = {"model": self.served_name, "token_ids": prompt, "sampling_params": sampling}
            else:
                body = {"model": self.served_name, "prompt": prompt, **sampling}
            body["return_token_ids"] = True
            if kv is not None:
                body["kv_transfer_params"] = kv
            left = max(1.0, deadline - time.monotonic())
            path = "/inference/v1/generate" if self.tokens_only else "/v1/completions"
            response = httpx.post(url + path, json=body, timeout=left)
            response.raise_for_status()
            answer: dict[str, Any] = response.json()
            return answer

        def cycle() -> None:
            prompt = list(range(1000, 1300))
            p1 = post(p, prompt, 1, {"do_remote_decode": True})
            d1 = post(d, prompt, 8, p1["kv_transfer_params"])  # D pulls from P
            prompt2 = prompt + d1["choices"][0]["token_ids"] + list(range(2000, 2100))
            # With a warm tier, P's engine dies on a failed pull (docs/warm-tier.md): P never
            # pulls from D in this pair, and the warm-up does not either.
            back = None if self.lmcache is not None else d1["kv_transfer_params"]
            p2 = post(p, prompt2, 1, back or {"do_remote_decode": True})  # P pulls from D
            post(d, prompt2, 4, p2["kv_transfer_params"])
            # Sampling with logprobs has a slow first use of its own on each instance.
            for url in (p, d):
                post(url, prompt, 4, None)

        while True:
            try:
                cycle()
                return
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            for instance in (self.prefill, self.decode):
                if instance.popen is not None and instance.popen.poll() is not None:
                    tail = instance.log.read_text(errors="replace")[-3000:]
                    raise EngineDied(f"vLLM {instance.role} exited during the warm-up:\n{tail}")
            if time.monotonic() >= deadline:
                tails = "\n".join(
                    f"--- {i.role} ({i.log}):\n{i.log.read_text(errors='replace')[-3000:]}"
                    for i in (self.prefill, self.decode)
                )
                raise RuntimeError(
                    f"vLLM P/D warm-up did not complete a bidirectional cycle within "
                    f"{timeout:g} s; attempts failed with:\n" + "\n".join(failures) + "\n" + tails
                )
            time.sleep(1)  # a failed attempt returned at once: do not spin on it

    def stop(self) -> None:
        """Both instances' process groups, gone (``stop_group``)."""
        running = [i for i in (self.prefill, self.decode) if i is not None and i.popen]
        stop_group(*(i.popen for i in running if i.popen is not None))
        for instance in running:
            instance.popen = None
        if self.lmcache is not None:
            self.lmcache.stop()

    def restart(self, timeout: float = 420.0) -> None:
        self.stop()
        self.start(timeout)
