"""scripts/offline_payload.py: a payload split into parts, received one at a time, joined and checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("offline_payload", Path(__file__).parents[1] / "scripts" / "offline_payload.py")
payload = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(payload)


@pytest.fixture
def wheels(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    for i, size in enumerate((70_000, 5, 130_001)):
        (d / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
    return d


def test_parts_received_one_by_one_join_into_the_same_wheels(wheels, tmp_path):
    out, staging, dest = tmp_path / "parts", tmp_path / "staging", tmp_path / "dest"
    m = payload.pack(wheels, out, part_mib=0.05)  # 52 KiB parts: several
    assert len(m["parts"]) >= 4 and all(p["bytes"] <= 0.05 * 2**20 for p in m["parts"])
    for p in m["parts"]:
        payload.receive(out / p["name"], staging)
    got = payload.assemble(staging, dest)
    assert [g.name for g in got] == sorted(w.name for w in wheels.iterdir())
    for g in got:
        assert g.read_bytes() == (wheels / g.name).read_bytes()


def test_a_missing_corrupt_or_foreign_part_is_named(wheels, tmp_path):
    out, staging = tmp_path / "parts", tmp_path / "staging"
    m = payload.pack(wheels, out, part_mib=0.05)
    first, second = (out / p["name"] for p in m["parts"][:2])
    payload.receive(first, staging)
    with pytest.raises(payload.PayloadError, match=r"parts missing .*part-001"):
        payload.assemble(staging, tmp_path / "dest")
    data = bytearray(second.read_bytes())
    data[10] ^= 1
    second.write_bytes(bytes(data))
    with pytest.raises(payload.PayloadError, match="does not match its checksum"):
        payload.receive(second, staging)
    (out / "part-999").write_bytes(b"x")
    with pytest.raises(payload.PayloadError, match="not a part of this payload"):
        payload.receive(out / "part-999", staging)
    # a staged part altered after it was received is caught when joining
    for p in m["parts"][1:]:
        (staging / p["name"]).write_bytes((out / p["name"]).read_bytes())
    with pytest.raises(payload.PayloadError, match="part-001 does not match its checksum"):
        payload.assemble(staging, tmp_path / "dest")


def test_cli_refuses_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert payload.main(["pack", str(tmp_path / "o"), "--from-dir", str(tmp_path / "empty")]) == 2
    assert "holds no .whl file" in capsys.readouterr().err
    assert payload.main(["install", str(tmp_path / "empty"), "--target", str(tmp_path / "t")]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err
    (tmp_path / "empty" / "manifest.json").write_text(json.dumps({"parts": []}) + "{")
    assert payload.main(["install", str(tmp_path / "empty"), "--target", str(tmp_path / "t")]) == 2
    assert "is not a manifest" in capsys.readouterr().err


def test_default_part_leaves_room_for_the_tracked_files(tmp_path, monkeypatch):
    """A transfer carries the checkout's tracked files beside the part: the default part is what is left."""
    import subprocess  # noqa: I001

    op = payload

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "big.bin").write_bytes(b"\0" * (40 * 2**20))
    (tmp_path / "untracked.bin").write_bytes(b"\0" * (30 * 2**20))  # not tracked: does not travel
    subprocess.run(["git", "-C", str(tmp_path), "add", "big.bin"], check=True)
    assert op.tracked_mib(tmp_path) == pytest.approx(40.0)
    assert op.default_part_mib(tmp_path) == op.TRANSFER_MIB - 40 - op.MARGIN_MIB
    (tmp_path / "more.bin").write_bytes(b"\0" * (20 * 2**20))
    subprocess.run(["git", "-C", str(tmp_path), "add", "more.bin"], check=True)
    with pytest.raises(op.PayloadError, match="no room is left"):
        op.default_part_mib(tmp_path)


def test_pack_leaves_out_what_the_gpu_machine_brings_or_a_headless_run_never_imports(tmp_path):
    names = ["torch-2.11.0-cp312-none-any.whl", "nvidia_cublas-13-py3-none-any.whl", "debugpy-1.8-py2.py3-none-any.whl",
             "jedi-0.20-py2.py3-none-any.whl", "widgetsnbextension-4.0-py3-none-any.whl", "plotly-7.1-py3-none-any.whl",
             "ipykernel-7.4-py3-none-any.whl", "transformers-5.25-py3-none-any.whl"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    gone = payload.drop_excluded(tmp_path)
    assert gone == sorted(names[:5])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[5:])
    assert set(payload.SETS) == {"models", "notebooks"} and "papermill>=2.5" in payload.SETS["notebooks"]
