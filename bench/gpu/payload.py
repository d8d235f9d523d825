"""The wheels the lent GPU machine lacks, made small enough to travel: downloaded once (pip,
hash-checked against ``wheels.txt``), the parts of vLLM, NIXL and vLLM Router an H100 serving a
dense model never loads left out, compressed, and cut into parts of at most ``PART_LIMIT``
bytes, one part to a device call (``plan.py``). ``device.py install`` puts them together again.

A part is a folder: ``manifest.json`` and the chunks it names. A blob (one wheel, one tree of
files, one compressed file) may span parts; the device applies it once every byte is there."""

from __future__ import annotations

import enum
import hashlib
import io
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MIB",
    "PART_LIMIT",
    "Blob",
    "BlobKind",
    "Requirement",
    "blobs",
    "build",
    "download",
    "pack",
    "requirements",
]

MIB = 1 << 20
#: A device call carries at most 64 MiB with the working tree (about 9.5 MiB); a part leaves
#: room for the tree to grow.
PART_LIMIT = 50 * MIB
WHEELS = Path(__file__).with_name("wheels.txt")
#: Every manylinux tag pip must accept for the device's glibc 2.39 (pip matches each exactly).
_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]

#: In vLLM's wheel, what serving a dense model on an H100 never loads: FlashAttention 2 (sm 9.0
#: runs FA3), the MoE kernels, the Rust frontend, DeepGEMM for other Pythons (291 + 120 MiB).
_VLLM_DROPPED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
)
#: vLLM's two kernel libraries, each its own compressed file (one of them is a part alone).
_VLLM_KERNELS = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so")
#: In NIXL's wheel: the expert-parallel builds for other torch versions, its C headers and
#: scripts, UCX's performance tests.
_NIXL_DROPPED_PREFIXES = (
    "nixl_ep_cu13/",
    "nixl_cu13.scripts/",
    "nixl_cu13-1.5.1.data/",
    "nixl_cu13.libs/ucx/libucx_perftest",
)
#: Distributions unpacked and slimmed here rather than installed as wheels there.
_UNPACKED = ("vllm", "nixl-cu13", "nixl", "vllm-router")


class BlobKind(enum.StrEnum):
    """What the device does with a blob once every byte of it is there."""

    WHEEL = "wheel"  # pip install --no-deps --target SITE
    TREE = "tree"  # an xz tar, extracted into SITE
    FILE = "file"  # an xz file, decompressed to SITE/target


@dataclass(frozen=True)
class Requirement:
    name: str
    version: str
    sha256: str
    section: str


@dataclass(frozen=True)
class Blob:
    name: str
    kind: BlobKind
    path: Path
    target: str = ""  # FILE: its path under the site folder


def requirements(text: str | None = None) -> list[Requirement]:
    """``wheels.txt``: ``name==version --hash=sha256:HEX`` lines under ``# [section]`` heads."""
    found: list[Requirement] = []
    section = ""
    for line in (WHEELS.read_text() if text is None else text).splitlines():
        line = line.strip()
        if line.startswith("# ["):
            section = line[3 : line.index("]")]
            continue
        if not line or line.startswith("#"):
            continue
        spec, _, digest = line.partition(" --hash=sha256:")
        name, _, version = spec.partition("==")
        if not (name and version and len(digest) == 64 and section):
            raise ValueError(f"wheels.txt: {line!r} is not name==version --hash=sha256:HEX")
        found.append(Requirement(_normal(name), version, digest, section))
    return found


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def download(folder: Path, wanted: Sequence[Requirement] | None = None) -> dict[str, Path]:
    """Each requirement's wheel in ``folder`` (pip checks the hashes; files already there are
    not fetched again); by normalized name."""
    wanted = list(wanted or requirements())
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{r.name}=={r.version} --hash=sha256:{r.sha256}" for r in wanted]
    spec = folder / "requirements.txt"
    spec.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    command += ["--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", "--dest", str(folder), "-r", str(spec)]
    for platform in _PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)
    found: dict[str, Path] = {}
    for wheel in folder.glob("*.whl"):
        found[_normal(wheel.name.split("-")[0])] = wheel
    missing = [r.name for r in wanted if r.name not in found]
    if missing:
        raise RuntimeError(f"pip left out {', '.join(missing)}")
    return found


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=9)


def _tree(members: Iterable[tuple[str, bytes]]) -> bytes:
    """An xz tar of ``members`` (path, bytes), in the order given, reproducibly (no times)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith((".so", "vllm-router")) or ".so." in name else 0o644
            archive.addfile(info, io.BytesIO(data))
    return _xz(buffer.getvalue())


def _members(
    wheel: Path, keep: Callable[[str], bool] = lambda name: True
) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(wheel) as archive:
        return [
            (name, archive.read(name))
            for name in archive.namelist()
            if not name.endswith("/") and keep(name)
        ]


def blobs(wheels: dict[str, Path], work: Path) -> list[Blob]:
    """What travels, in the order it should arrive: the engine's (NIXL first, so that a call
    with only the first part can probe the transport), then the router's, then the peer's.
    A blob made before (in ``work``) is not made again."""
    work.mkdir(parents=True, exist_ok=True)
    section = {r.name: r.section for r in requirements()}

    def made(name: str, kind: BlobKind, data: Callable[[], bytes], target: str = "") -> Blob:
        path = work / name
        if not path.exists():
            path.write_bytes(data())
        return Blob(name, kind, path, target)

    def wheel(name: str) -> Blob:
        return Blob(wheels[name].name, BlobKind.WHEEL, wheels[name])

    def kernel(path: str) -> Blob:
        with zipfile.ZipFile(wheels["vllm"]) as archive:
            return made(
                Path(path).name + ".xz", BlobKind.FILE, lambda: _xz(archive.read(path)), path
            )

    skipped = set(_VLLM_DROPPED) | set(_VLLM_KERNELS)
    nixl = made(
        "nixl-1.5.1-cu13-slim.tar.xz",
        BlobKind.TREE,
        lambda: _tree(
            _members(wheels["nixl-cu13"], lambda n: not n.startswith(_NIXL_DROPPED_PREFIXES))
            + _members(wheels["nixl"])
        ),
    )
    engine = [wheel(n) for n in sorted(wheels) if n not in _UNPACKED and section.get(n) == "engine"]
    vllm = made(
        "vllm-0.26.0-py.tar.xz",
        BlobKind.TREE,
        lambda: _tree(_members(wheels["vllm"], lambda n: n not in skipped)),
    )
    kernels = [kernel(path) for path in _VLLM_KERNELS]
    router = [wheel(n) for n in sorted(wheels) if section.get(n) == "router"]
    peer = [wheel(n) for n in sorted(wheels) if section.get(n) == "peer" and n not in _UNPACKED]
    peer.append(
        made(
            "vllm-router-0.1.17.tar.xz",
            BlobKind.TREE,
            lambda: _tree(_members(wheels["vllm-router"])),
        )
    )
    return [nixl, *engine, vllm, *kernels, *router, *peer]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack(made: Sequence[Blob], into: Path, limit: int = PART_LIMIT) -> list[Path]:
    """``made`` cut into parts ``into/part-1`` … of at most ``limit`` bytes each, in order; a
    blob larger than the room left goes on in the next part. Returns the part folders."""
    if into.exists():
        shutil.rmtree(into)
    parts: list[Path] = []
    manifests: list[list[dict[str, object]]] = []
    room = 0
    for blob in made:
        size = blob.path.stat().st_size
        digest = _sha256(blob.path)
        offset = 0
        with blob.path.open("rb") as source:
            while offset < size or (size == 0 and offset == 0):
                if room == 0:
                    parts.append(into / f"part-{len(parts) + 1}")
                    parts[-1].mkdir(parents=True)
                    manifests.append([])
                    room = limit
                length = min(room, size - offset)
                chunk = f"{len(manifests[-1]):03d}-{blob.name}"
                (parts[-1] / chunk).write_bytes(source.read(length))
                manifests[-1].append(
                    {
                        "blob": blob.name,
                        "kind": str(blob.kind),
                        "target": blob.target,
                        "size": size,
                        "sha256": digest,
                        "offset": offset,
                        "chunk": chunk,
                    }
                )
                offset += length
                room -= length
                if size == 0:
                    break
    for part, manifest in zip(parts, manifests, strict=True):
        (part / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return parts


def build(root: Path, limit: int = PART_LIMIT) -> list[Path]:
    """Download (``root/wheels``), slim (``root/blobs``) and pack (``root/parts``)."""
    wheels = download(root / "wheels")
    made = blobs(wheels, root / "blobs")
    return pack(made, root / "parts", limit)
