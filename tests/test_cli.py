"""The ``fp8kv`` command (fp8kv.cli): every command it names reaches its own parser."""

from __future__ import annotations

import pytest

from fp8kv import cli


@pytest.mark.parametrize("argv, prog", [
    (["bench", "--help"], "usage: fp8kv bench"),
    (["step", "--help"], "usage: fp8kv step"),
    (["notebooks", "index", "--help"], "usage: fp8kv notebooks index"),
    (["notebooks", "render", "--help"], "usage: fp8kv notebooks render"),
    (["notebooks", "run", "--help"], "usage: fp8kv notebooks run"),
    (["--help"], "usage: fp8kv"),
])
def test_each_command_reaches_its_own_parser(argv, prog, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(prog), out[:200]
    if argv == ["--help"]:
        assert all(name in out for name in ("notebooks", "bench", "step"))


@pytest.mark.parametrize("entry", ["fp8kv notebooks", "python -m fp8kv.notebooks"])
def test_notebooks_help_lists_every_action(entry, capsys):
    from fp8kv import notebooks

    with pytest.raises(SystemExit) as exc:
        cli.main(["notebooks", "--help"]) if entry == "fp8kv notebooks" else notebooks.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(f"    {action} " in out for action in ("run", "list", "index", "render")), out


def test_python_dash_m_fp8kv_is_the_fp8kv_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fp8kv", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: fp8kv"), done.stderr[-500:]


def test_notebooks_index_builds_the_cross_gpu_page(tmp_path, capsys):
    assert cli.main(["notebooks", "index", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "index.html").is_file()
    assert "index:" in capsys.readouterr().out


def test_notebooks_render_refuses_a_missing_folder(tmp_path, capsys):
    assert cli.main(["notebooks", "render", str(tmp_path / "nowhere")]) == 2
    assert "fp8kv notebooks render: error:" in capsys.readouterr().err


def test_step_refuses_bad_arguments_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["step", "--model", "Qwen3-0.6B", "--contexts", "0"])
    assert exc.value.code == 2
    assert "expected a positive int" in capsys.readouterr().err


def test_notebooks_index_is_the_same_page_for_the_same_reports(tmp_path):
    """No random plotly ids: rebuilding the index of unchanged reports changes no byte."""
    import shutil
    from pathlib import Path

    reports = Path(__file__).resolve().parents[1] / "reports"
    root = tmp_path / "reports"
    shutil.copytree(reports, root)
    assert cli.main(["notebooks", "index", "--out", str(root)]) == 0
    first = (root / "index.html").read_bytes()
    assert b"index-figure-0" in first
    assert cli.main(["notebooks", "index", "--out", str(root)]) == 0
    assert (root / "index.html").read_bytes() == first
