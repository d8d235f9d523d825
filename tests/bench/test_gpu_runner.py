"""The GPU runner's parts that need no GPU: the wheel list, the payload's parts put back
together as the device does, the plan within the device tool's limits, and the turn-N run
against simulated P and D on loopback (the same code the device runs against real vLLM)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import random
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from carryover.bench.gpu import payload, plan
from carryover.bench.gpu.turns import Engines, Size, run
from carryover.bench.procs import topology
from carryover.router.render.chat_template import bundled_qwen3_dir


def _device(state: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/gpu/device.py as the device runs it (a file, its state under ``state``)."""
    monkeypatch.setenv("CARRYOVER_GPU_STATE", str(state))
    path = Path(payload.__file__).with_name("device.py")
    spec = importlib.util.spec_from_file_location("gpu_device", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_list_pins_one_hashed_version_of_each_distribution_for_each_user() -> None:
    found = payload.requirements()
    names = [r.name for r in found]
    assert len(names) == len(set(names))
    assert {r.section for r in found} == {"engine", "router", "peer"}
    pinned = {r.name: r.version for r in found}
    assert pinned["vllm"] == "0.26.0" and pinned["vllm-router"] == "0.1.17"
    assert all(len(r.sha256) == 64 for r in found)
    with pytest.raises(ValueError, match="not name==version"):
        payload.requirements("# [engine] x\nvllm==0.26.0\n")


def _tree(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return lzma.compress(buffer.getvalue())


def test_blobs_cut_across_parts_are_applied_once_every_byte_has_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = random.Random(0).randbytes(100_000)  # incompressible: three parts of 40 kB
    tree = _tree({"pkg/__init__.py": b"VALUE = 7\n", "pkg/data.bin": b"\x00\x01" * 5000})
    (tmp_path / "pkg.tar.xz").write_bytes(tree)
    (tmp_path / "kernel.so.xz").write_bytes(lzma.compress(kernel, preset=0))
    made = [
        payload.Blob("pkg.tar.xz", payload.BlobKind.TREE, tmp_path / "pkg.tar.xz"),
        payload.Blob(
            "kernel.so.xz", payload.BlobKind.FILE, tmp_path / "kernel.so.xz", "pkg/kernel.so"
        ),
    ]
    parts = payload.pack(made, tmp_path / "parts", limit=40_000)
    sizes = [sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json") for p in parts]
    assert all(size <= 40_000 for size in sizes)
    assert sum(sizes) == sum(b.path.stat().st_size for b in made)

    device = _device(tmp_path / "state", monkeypatch)
    # Later parts first: nothing is applied before all of a blob is there.
    last = device.install([parts[-1]])
    assert last["applied"] == [] and set(last["missing"]) == {"kernel.so.xz"}
    rest = device.install(parts[:-1])
    assert sorted(rest["applied"]) == ["kernel.so.xz", "pkg.tar.xz"]
    site = tmp_path / "state" / "site"
    assert (site / "pkg" / "kernel.so").read_bytes() == kernel
    assert (site / "pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert device.install(parts) == {"applied": [], "missing": []}  # once only


def test_a_blob_whose_bytes_differ_from_its_digest_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pkg.tar.xz").write_bytes(_tree({"pkg/a.py": b"A = 1\n"}))
    blob = payload.Blob("pkg.tar.xz", payload.BlobKind.TREE, tmp_path / "pkg.tar.xz")
    (part,) = payload.pack([blob], tmp_path / "parts")
    chunk = next(p for p in part.iterdir() if p.name != "manifest.json")
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"\x00")
    device = _device(tmp_path / "state", monkeypatch)
    with pytest.raises(SystemExit, match="does not match its digest"):
        device.install([part])
    manifest = json.loads((part / "manifest.json").read_text())
    assert manifest[0]["sha256"] == hashlib.sha256(blob.path.read_bytes()).hexdigest()


def test_the_plan_fits_the_device_tools_limits_and_carries_each_part_once(
    tmp_path: Path,
) -> None:
    parts = [tmp_path / ".gpu" / "parts" / f"part-{i}" for i in (1, 2, 3)]
    calls = plan.plan(parts, root=tmp_path)
    carried = [path for call in calls for path in call.carry]
    assert carried == [".gpu/parts/part-1", ".gpu/parts/part-2", ".gpu/parts/part-3"]
    assert all(len(call.command) <= plan.COMMAND_LIMIT for call in calls)
    assert "probe" in calls[0].command and "model" in calls[0].command
    assert "--no-bidirectional" in calls[-1].command and "vllm-router" in calls[-1].command
    for line in plan.render(calls).splitlines():
        assert set(json.loads(line)) == {"why", "carry", "command", "timeout_s"}


def test_the_turn_n_run_on_simulated_engines_reuses_and_answers_as_the_proxy_does(
    tmp_path: Path,
) -> None:
    with topology(log_dir=tmp_path / "engines") as topo:
        prefill = topo.sim("prefill", "kv_producer", speed=0.05)
        decode = topo.sim("decode", "kv_consumer", speed=0.05)
        topo.wait()
        engines = Engines(prefill.url, decode.url, served="sim-qwen3", block_size=16)
        reports = run(
            [Size(tokens=1200, conversations=2, turns=3, answer=16)],
            ["carryover-no-reuse", "carryover"],
            tokenizer=bundled_qwen3_dir(),
            out=tmp_path / "out",
            engines=engines,
        )
    report = reports["1200"]
    arms = report["arms"]
    assert arms["carryover"]["failed"] == 0 and arms["carryover-no-reuse"]["failed"] == 0
    assert arms["carryover"]["answers_differing_from_baseline"] == 0
    assert arms["carryover"]["paths"] == {"cold-miss": 2, "reuse": 4}
    assert "reuse" not in arms["carryover-no-reuse"]["paths"]
    # The engines' own counters, read around each arm: D computed none of the prompts.
    for arm in ("carryover", "carryover-no-reuse"):
        counted = report["engines"][arm]
        assert counted["prefill"]["vllm:prompt_tokens_by_source_total{local_compute}"] > 0
        assert "vllm:prompt_tokens_by_source_total{local_compute}" not in counted["decode"]
    assert (tmp_path / "out" / "turns-1200.md").exists()


def test_the_engines_are_started_with_bidirectional_transfer_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = _device(tmp_path / "state", monkeypatch)

    def config(role: str, **flags: object) -> dict[str, object]:
        args = device.engine_args(
            role,
            model=Path("/m"),
            port=1,
            kv_bytes=2 << 30,
            buffer="cpu",
            max_model_len=40960,
            served_name="s",
            **flags,
        )
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
        assert args[args.index("--block-size") + 1] == "16"
        found: dict[str, object] = json.loads(args[args.index("--kv-transfer-config") + 1])
        return found

    prefill, decode = config("prefill"), config("decode")
    assert (prefill["kv_role"], decode["kv_role"]) == ("kv_producer", "kv_consumer")
    assert prefill["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}
    assert prefill["kv_load_failure_policy"] == "fail" and prefill["kv_buffer_device"] == "cpu"
    plain = config("decode", bidirectional=False)
    assert plain["kv_connector_extra_config"] == {"bidirectional_kv_xfer": False}
    env = device.environment()
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
