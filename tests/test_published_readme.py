"""README.md's published results against the files they cite (``python -m fp8kv.published readme
--check``), and the generator's parts on small constructed inputs: markers filled and refused, ranges
rounded once, a missing file named, a mutated number found, an errored peer left out of a lead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from fp8kv.published import MissingSourceError, Sources, check
from fp8kv.published.cli import main
from fp8kv.published.earlier import lead_points
from fp8kv.published.fmt import num, sci_span, span
from fp8kv.published.readme import compute
from fp8kv.published.render import fill, names_in, unified_diff
from fp8kv.published.sources import ok_rows

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ the repository
@pytest.fixture(scope="module")
def values():
    return compute(Sources(REPO))


def test_readme_matches_its_results_files():
    diff = check(REPO / "README.md", REPO)
    assert diff == "", "README.md differs from its results files; run python -m fp8kv.published readme\n" + diff


def test_every_generated_name_in_the_readme_is_computed(values):
    placed = set(names_in((REPO / "README.md").read_text(encoding="utf-8")))
    assert placed == set(values)


def test_the_results_section_cites_only_files_that_exist():
    src = Sources(REPO)
    compute(src)
    assert src.cited and all((REPO / rel).is_file() for rel in src.cited)
    results = (REPO / "README.md").read_text(encoding="utf-8").split("## Results", 1)[1]
    for rel in src.cited:  # named in full, or as …<time>Z[-tag] after its day (a CSV's .json: by the CSV's stem)
        tail = Path(rel).stem.split("T", 1)[-1]
        assert tail in results, f"{rel} is read but the README never names it"


@pytest.mark.parametrize("name", ["decode.b64_16k_fp8_us", "layouts.err_vllm", "cc.16_16_256", "earlier.ahead"])
def test_a_hand_edited_number_is_found(tmp_path, values, name):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    marker = f"<!--v {name}-->{values[name]}<!--/v-->"
    assert marker in readme
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(marker, f"<!--v {name}-->{values[name]}9<!--/v-->", 1), encoding="utf-8")
    lines = check(edited, REPO).splitlines()
    assert any(line.startswith("-") and f"{values[name]}9<!--/v-->" in line for line in lines)
    assert any(line.startswith("+") and marker in line for line in lines)


def test_a_hand_edited_table_cell_is_found(tmp_path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    row = "| 64 | 16384 | 683.5 |"
    assert row in readme
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(row, "| 64 | 16384 | 599.0 |", 1), encoding="utf-8")
    diff = check(edited, REPO)
    assert "-| 64 | 16384 | 599.0 |" in diff and "+| 64 | 16384 | 683.5 |" in diff


def _copy_results(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for folder in ("results", "reports"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("*.gz", "*.html", "*.ipynb"))
    return root


@pytest.mark.parametrize("rel", ["results/bench/nvidia-h200/20261202T161742Z.csv",
                                 "results/bench/nvidia-h200/20261204T201542Z-page-layout.json",
                                 "reports/nvidia-h200/04_decode_latency.json"])
def test_a_missing_cited_file_is_named(tmp_path, rel, capsys):
    root = _copy_results(tmp_path)
    (root / rel).unlink()
    with pytest.raises(MissingSourceError, match=rel.replace(".", r"\.")):
        check(REPO / "README.md", root)
    assert main(["readme", "--check", "--root", str(root)]) == 2
    assert rel in capsys.readouterr().err


def test_check_exits_1_with_a_diff_and_readme_rewrites(tmp_path, capsys):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("<!--v decode.cells-->12<!--/v-->", "<!--v decode.cells-->13<!--/v-->"),
                      encoding="utf-8")
    assert main(["readme", "--check", "--readme", str(edited)]) == 1
    out = capsys.readouterr().out
    assert "-" in out and "decode.cells-->13" in out
    assert main(["readme", "--readme", str(edited)]) == 0
    assert edited.read_text(encoding="utf-8") == readme
    assert main(["readme", "--check", "--readme", str(edited)]) == 0


# ------------------------------------------------------------------------------------- the markers
TEXT = "a <!--v x-->1<!--/v--> b\n<!-- generated: t -->\n| old |\n<!-- /generated -->\nc <!--v x-->1<!--/v-->\n"


def test_fill_replaces_blocks_and_inline_values_and_nothing_else():
    out = fill(TEXT, {"x": "2.5", "t": "| new |\n| row |"})
    assert out == "a <!--v x-->2.5<!--/v--> b\n<!-- generated: t -->\n| new |\n| row |\n<!-- /generated -->\nc <!--v x-->2.5<!--/v-->\n"
    assert fill(out, {"x": "2.5", "t": "| new |\n| row |"}) == out  # idempotent
    assert names_in(TEXT) == ["t", "x", "x"]


@pytest.mark.parametrize("text, values, message", [
    (TEXT, {"x": "1"}, "block 't' is computed by no"),
    (TEXT, {"t": "|a|"}, "value 'x' is computed by no"),
    (TEXT, {"x": "1", "t": "|a|", "y": "3"}, "does not place: y"),
    (TEXT, {"x": "1\n2", "t": "|a|"}, "spans lines"),
    ("<!-- generated: t -->\n| a |\n", {"t": "|a|"}, "never closed"),
    ("| a |\n<!-- /generated -->\n", {}, "closes no block"),
    ("<!-- generated: t -->\n<!-- generated: u -->\n<!-- /generated -->\n", {"t": "", "u": ""}, "opens inside"),
    ("a <!--v x-->1 and no end\n", {"x": "1"}, "not closed"),
])
def test_fill_refuses_each_broken_marker_naming_it(text, values, message):
    with pytest.raises(ValueError, match=message):
        fill(text, values)


@pytest.mark.parametrize("bad", [1.5, None, ["1"]])
def test_fill_refuses_a_value_that_is_not_text(bad):
    with pytest.raises(TypeError, match="'x'"):
        fill("<!--v x-->1<!--/v-->", {"x": bad})


def test_unified_diff_is_empty_for_equal_texts_and_shows_a_change():
    assert unified_diff("a\n", "a\n") == ""
    assert "-684\n+683\n" in unified_diff("684\n", "683\n")


# ---------------------------------------------------------------------------------- the formatters
@pytest.mark.parametrize("values, digits, expected", [
    ([2.94e-3 * 1e3, 3.46e-3 * 1e3], 1, "2.9–3.5"),   # the ends of the rows, rounded once: not 3.0–3.6
    ([1.151, 1.464, 1.3], 2, "1.15–1.46"),
    ([683.52], 0, "684"),
    ([1.001, 1.004], 2, "1.00"),                        # both ends print alike: one number
])
def test_span_rounds_each_end_of_the_rows(values, digits, expected):
    assert span(values, digits) == expected


def test_sci_span_prints_in_one_power_of_ten():
    assert sci_span([2.94e-3, 3.46e-3], -3) == "2.9–3.5e-3"
    assert sci_span([0.03516, 0.03763], -2) == "3.5–3.8e-2"


@pytest.mark.parametrize("values", [[], [float("nan")], [1.0, float("inf")]])
def test_a_range_of_no_measured_values_is_refused(values):
    with pytest.raises(ValueError, match="span|values"):
        span(values)


def test_num_refuses_a_value_that_was_not_measured():
    with pytest.raises(ValueError, match="non-finite"):
        num(float("nan"))


# ------------------------------------------------------------------------------------- the readers
def _layout_rows(peer_status: str) -> pd.DataFrame:
    return pd.DataFrame({"peer_us": [10.0, 8.0, float("nan")], "fp8_us": [5.0, 9.0, 4.0],
                         "fp8_x_peer": [2.0, 8.0 / 9.0, float("nan")], "status_of_peer": ["ok", "ok", peer_status]})


@pytest.mark.parametrize("peer_status", ["error", "unsupported", "not run"])
def test_a_point_whose_peer_did_not_run_is_no_lead(peer_status):
    ahead, behind, no_peer = lead_points(_layout_rows(peer_status))
    assert list(ahead.index) == [0] and list(behind.index) == [1] and list(no_peer.index) == [2]


@pytest.mark.parametrize("status, passed", [("error", True), ("unsupported", True), ("ok", False), ("ok", "False")])
def test_ok_rows_drop_errored_and_failed_rows(status, passed):
    df = pd.DataFrame({"status": ["ok", status], "check_passed": [True, passed], "time_us": [1.0, 0.5]})
    assert list(ok_rows(df)["time_us"]) == [1.0]


def test_an_errored_peer_row_is_left_out_of_the_best_peer(tmp_path):
    from fp8kv.bench.report import layout_table
    rows = pd.read_csv(REPO / "results/bench/nvidia-h200/20261204T150103Z.csv")
    fastest = rows[rows["backend"] != "triton"].sort_values("time_us").index[0]
    broken = rows.copy()
    broken.loc[fastest, ["status", "time_us"]] = ["error", 0.001]  # an errored peer with a tiny time
    shape = tuple(broken.loc[fastest, ["num_q_heads", "num_kv_heads", "head_dim"]])
    t = layout_table(ok_rows(broken)).set_index(["num_q_heads", "num_kv_heads", "head_dim"])
    assert t.loc[shape, "peer_us"] > 1.0


@pytest.mark.parametrize("rel, content, message", [
    ("results/x.json", "[1, 2]", "expected an object"),
    ("results/x.json", "{not json", "cannot be read"),
    ("results/x.json", json.dumps({"rows": {"a": 1}}), "expected a list of records"),
])
def test_a_file_of_the_wrong_kind_is_named(tmp_path, rel, content, message):
    (tmp_path / "results").mkdir()
    (tmp_path / rel).write_text(content, encoding="utf-8")
    src = Sources(tmp_path)
    with pytest.raises(ValueError, match=message) as err:
        src.rows(rel)
    assert rel in str(err.value)


@pytest.mark.parametrize("rel", ["", "/etc/passwd", None])
def test_a_cited_path_must_be_relative(tmp_path, rel):
    with pytest.raises(ValueError, match="relative"):
        Sources(tmp_path).path(rel)


def test_a_csv_without_the_columns_a_table_needs_is_named(tmp_path):
    (tmp_path / "t.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.csv: lacks columns \['time_us'\]"):
        Sources(tmp_path).csv("t.csv", ["time_us"])
