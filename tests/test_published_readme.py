"""README.md's published results against the files they cite (``python -m fp8kv.published readme
--check``), and the generator's parts on small constructed inputs: markers filled and refused, ranges
rounded once, a missing file named, a mutated number found, an errored peer left out of a lead."""

from __future__ import annotations

import json
import re
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


def test_the_h200_formats_paragraph_names_the_4bit_goal_against_bf16_as_unmet(values):
    """The issue's goal of a 4-bit decode at 2.5x BF16 is a generated value beside the ratio it is not met by."""
    from fp8kv.published.formats import INT4_GOAL_X_BF16

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    said = re.search(r"formats_h200\.int4_x_bf16-->[^<]*<!--/v-->× as fast as BF16 \(the goal is "
                     r"<!--v formats_h200\.goal_bf16-->([^<]*)<!--/v-->×, not met\)", readme)
    assert said and said.group(1) == values["formats_h200.goal_bf16"] == f"{INT4_GOAL_X_BF16:.1f}"
    assert float(values["formats_h200.int4_x_bf16"].split("–")[-1]) < INT4_GOAL_X_BF16


def test_the_results_section_cites_only_files_that_exist():
    src = Sources(REPO)
    compute(src)
    assert src.cited and all((REPO / rel).is_file() for rel in src.cited)
    results = (REPO / "README.md").read_text(encoding="utf-8").split("## Results", 1)[1]
    for rel in src.cited:  # named in full, or as …<time>Z[-tag] after its day (a CSV's .json: by the CSV's stem)
        tail = Path(rel).stem.split("T", 1)[-1]
        assert tail in results, f"{rel} is read but the README never names it"


def test_every_cited_file_is_in_the_repository():
    """A cited file that git ignores exists in this checkout but not in a fresh clone, where the README's check
    would then fail: each one must be tracked (or at least not ignored, before its first commit)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing decides what a clone holds")
    src = Sources(REPO)
    compute(src)
    cited = sorted({*src.cited, *(str(Path(rel).with_suffix(".json")) for rel in src.cited if rel.endswith(".csv"))})
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", "--no-index", *cited], cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout == "", f"git ignores files the README cites:\n{ignored.stdout}"


@pytest.mark.parametrize("name", ["decode.b64_16k_fp8_us", "layouts.err_vllm", "cc.16_16_256", "earlier.ahead",
                                  "multi.sv_rows_x_own", "step.batch_8b", "residency.d64"])
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
    (root / "fp8kv/data").mkdir(parents=True)
    for table in (REPO / "fp8kv/data").glob("launch_*.json"):  # the measured launch table the README quotes
        shutil.copy(table, root / "fp8kv/data" / table.name)
    return root


@pytest.mark.parametrize("rel", ["results/bench/nvidia-h200/20261202T161742Z.csv",
                                 "results/bench/nvidia-h200/20261204T201542Z-page-layout.json",
                                 "reports/nvidia-h200/04_decode_latency.json",
                                 "results/bench/nvidia-h200/20261204T163000Z-decode-profile.txt",
                                 "results/bench/nvidia-h200/20261203T181041Z-console.txt",
                                 "fp8kv/data/launch_nvidia-h200.json"])
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


@pytest.mark.parametrize("layout, programs, message", [
    ("32/32/80", 3, "MHA from D = 80 runs 128-token tiles, all at one residency"),
    ("8/1/256", 3, "128-token tiles hold as many programs at MHA as at D = 256")])
def test_a_residency_the_text_no_longer_bears_out_is_named(tmp_path, layout, programs, message):
    """The programs an SM that the split rule's and the Gluon launch's paragraphs quote come from the sm90 builds;
    a build whose residency parts from the sentence's grouping fails by that sentence, not silently."""
    from fp8kv.published.issue import ISSUE, residency
    shutil.copytree(REPO / "results/sass", tmp_path / "results/sass")
    rows = pd.read_csv(tmp_path / ISSUE)
    assert residency(Sources(tmp_path))["residency.d256"] == "2"
    rows.loc[rows["layout"] == layout, "programs_per_sm"] = programs
    rows.to_csv(tmp_path / ISSUE, index=False)
    with pytest.raises(ValueError, match=message):
        residency(Sources(tmp_path))


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
    (TEXT, {"x": "1", "t": "|a|", **{f"y{i:02}": "3" for i in range(20)}}, "does not place: y00, .*, y11 and 8 more;"),
    ("# another file\n", {"x": "1", "t": "|a|"}, r"places none of the 2 computed values .* is it fp8kv's README\?"),
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



def test_ok_rows_keep_a_pass_written_as_a_float():
    """A 0 / 1 column read back as floats: 1.0 passed (it was dropped), 0.0 did not."""
    df = pd.DataFrame({"status": ["ok", "ok"], "check_passed": [1.0, 0.0], "time_us": [1.0, 0.5]})
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


# ------------------------------------------------------------- no typed measurement anywhere in the README
# A number with a unit of time, rate or share, a ratio (1.27×, 1.27x, 1.85 times, 2.06-fold), a relative error
# (1.6e-3), a range of decimals (0.16–0.86), a metric's value (KL 0.00825, error 0.0066), a count of points
# (12 of the 13), a crossover context (beyond 7,933 tokens), a measured batch (batch 49: the sweeps' batches are
# powers of two, a ceiling or best batch is not) or a residency (3 an SM), outside code fences and the generated
# markers, is a measurement typed by hand: it has no file behind it and goes stale silently. A product of sizes
# (64 × 16k, 2 × 71) is not one.
_NUM = r"\d+(?:[.,]\d+)*(?:e-?\d+)?"
_POW2 = "|".join(str(2 ** i) for i in range(13))
TYPED = re.compile(
    rf"(?<![\w.]){_NUM}(?:\s*[–-]\s*{_NUM})?"
    r"(?:\s*(?:µs|us|ms|GB/s|TB/s|GiB|MiB|KiB|%|tokens/s|TFLOP/s)(?!\w)|\s*×(?!\s*[\d(])|x\b|\s+times\b|-fold\b"
    r"|\s+(?:programs\s+|warps\s+|CTAs\s+)?an\s+SM\b)"
    r"|(?<![\w.])\d+\.\d+e-\d+"
    r"|(?<![\w.])\d+\.\d+\s*–\s*\d+\.\d+"
    r"|(?<![\w.])\d+\s+of\s+(?:the\s+|all\s+)?\d+(?![\w.])"
    rf"|\b(?:beyond|below|above|from|after)\s+{_NUM}\s+tokens\b"
    r"|\b(?:KL|error|perplexity|PPL|ppl|err)\s+(?:of\s+)?\d*\.\d+"
    rf"|\bbatch(?:es)?\s+(?!(?:{_POW2})(?!\d|[.,]\d))\d+")
# Numbers of the README that are not measurements, each with why; every entry must still appear in the README
# outside code fences (a stale entry fails), and it is matched as written, context included.
NOT_MEASURED = {
    "(2.11–2.13)": "the torch releases fp8kv supports",
    "exceed 100 %": "a threshold (the copy rate counts read + write)",
    "at ≤ 600 µs": "the project's latency target",
    "≥ 1.3× FlashInfer FP8": "the project's speed-up target",
    "the 10 µs goal": "the project's latency goal",
    "(128 MiB by default)": "FlashInfer's default workspace",
    "(up to 4 GiB)": "fp8kv's cap on that workspace",
    "≥ 3 % faster": "fp8kv.bench.tune's threshold",
    "1.5 and 2 times the split count": "the split counts the wide probe tried",
    "99 KiB": "those GPUs' shared memory per block",
    "Below 90 % of BF16's rate": "a threshold the bullet names",
    "short of the 1.5×": "the ratio of bytes, FP8 against BF16 with its scales",
    "KL < 2e-3": "a test's tolerance",
    "FP8 ≥ 1.7× its own BF16, ≥ 1.3× the best peer, at most 1.3× the decode's time": "the multi-token goals",
}


def scanned_sections(readme: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` of every stretch of the README outside its code fences (```): the whole
    README is scanned, the commands and code it quotes are not."""
    sections, lines, start, fence = [], readme.split("\n"), 0, False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            if not fence:
                sections.append((start + 1, "\n".join(lines[start:i])))
            fence, start = not fence, i + 1
    if not fence:
        sections.append((start + 1, "\n".join(lines[start:])))
    return [(first, text) for first, text in sections if text.strip()]


def typed_measurements(readme: str) -> list[str]:
    """``"line N: text"`` for each measurement-like number of the README outside code fences, generated markers
    and :data:`NOT_MEASURED`."""
    return [hit for first, text in scanned_sections(readme) for hit in _typed_in(text, first)]


def _typed_in(text: str, first_line: int) -> list[str]:
    found = []
    in_block = False
    for i, line in enumerate(text.split("\n")):
        if line.strip().startswith("<!-- generated: "):
            in_block = True
            continue
        if line.strip() == "<!-- /generated -->":
            in_block = False
            continue
        if in_block:
            continue
        line = re.sub(r"<!--v [^>]*-->.*?<!--/v-->", "<value>", line)
        for phrase in NOT_MEASURED:
            line = line.replace(phrase, "<not measured>")
        found += [f"line {first_line + i}: {m.group(0)!r} in {line.strip()[:100]!r}" for m in TYPED.finditer(line)]
    return found


def test_no_measurement_is_typed_in_the_readme():
    found = typed_measurements((REPO / "README.md").read_text(encoding="utf-8"))
    assert not found, ("measurements typed by hand in README.md (generate each from the results file it cites, or "
                       "remove it; a number that is no measurement goes into NOT_MEASURED with why):\n" + "\n".join(found))


def test_every_allowed_number_is_still_in_the_readme():
    outside = "\n".join(text for _, text in scanned_sections((REPO / "README.md").read_text(encoding="utf-8")))
    assert [p for p in NOT_MEASURED if p not in outside] == []


# A place in each part of the README: the first screen, the set-up, the package's table, the checks, the Results
PLACES = ["## At a glance\n", "## Set-up: two commands\n", "## The package\n", "## What is validated\n",
          "### Rendered reports\n"]


def _placed(text: str, place: str) -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    edited = readme.replace(place, f"{place}\nIt {text} here.\n", 1)
    assert edited != readme, place
    return edited


TYPED_FORMS = ["took 12.5 µs", "at 3.2 TB/s", "4110 GB/s", "at 93 % of", "1.27× faster", "1.27x the bytes",
               "0.93–1.24× the time", "2.9–3.5e-3", "error 1.6e-3", "a range 0.16–0.86", "3–24 % slower", "2.4 ms",
               "(0.93× / 0.95×", "pays beyond 7,933 tokens", "ahead at 12 of the 13", "serves 14,867 tokens/s",
               "has KL 0.00825", "error 0.0066", "buys 1.85 times", "is 2.06-fold", "runs 206–321 TFLOP/s",
               "reads at batch 49", "runs 3 an SM", "holds 2–5 programs an SM", "pays from 1,456 tokens on",
               "at batches 98 and 110"]


@pytest.mark.parametrize("typed", TYPED_FORMS)
def test_a_typed_measurement_is_found(typed):
    found = typed_measurements(_placed(typed, "### Rendered reports\n"))
    assert found and all("here." in f for f in found), found  # found, and only on the line that was added


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("typed", ["took 12.5 µs", "pays beyond 7,933 tokens", "ahead at 12 of the 13",
                                   "serves 14,867 tokens/s", "has KL 0.00825", "error 0.0066", "buys 1.85 times",
                                   "is 2.06-fold", "reads at batch 49", "runs 3 an SM"])
def test_a_typed_measurement_is_found_in_every_part_of_the_readme(typed, place):
    found = typed_measurements(_placed(typed, place))
    assert found and all("here." in f for f in found), found


@pytest.mark.parametrize("place", ["## The package\n", "### Rendered reports\n"])
@pytest.mark.parametrize("text", ["B = 64 × 16k", "on 2026-12-04", "FlashInfer 0.6.13", "32/8/128 and 71/1/64",
                                  "16k contexts", "2 × 71 FLOPs", "1–16 × 4k–16k", "pages of 8 to 256 tokens",
                                  "commit 86a153bd", "about 2 × (FP8 bytes/s ÷ BF16 bytes/s)",
                                  "<!--v decode.cells-->12 µs<!--/v-->", "at batch 1", "at batches 16 and 64",
                                  "batch 256", "B = 49", "512-token splits", "one of 71 heads", "1 / 17 / 5003 / 16379"])
def test_a_non_measurement_or_a_generated_value_is_not_found(text, place):
    assert typed_measurements(_placed(text, place)) == []


def test_a_typed_measurement_inside_a_generated_block_is_the_block_s():
    readme = "## Results\n<!-- generated: t -->\n| 12.5 µs |\n<!-- /generated -->\nthen 3.1 µs\n"
    assert [f.split(":")[0] for f in typed_measurements(readme)] == ["line 5"]


def test_a_code_fence_is_not_scanned_and_what_follows_it_is():
    readme = "# t\n\n```bash\npython -m fp8kv.bench --rep 30   # took 12.5 µs\n```\n\nthen 3.1 µs\n```\n1.2×\n"
    assert [f.split(":")[0] for f in typed_measurements(readme)] == ["line 7"]  # an unclosed fence hides its rest


# ---------------------------------------------------------------------------- the text-file readers
PROFILE = """Nsight Compute summary of one decode.

== 32/32/80 (K+V 5.37 GB)
  duration 2.02 ms, DRAM 70.4 % (3.39 TB/s: 6.85 GB read, 1.27x the K and V), L2 throughput 93.1 %,
  L2 hit rate 29.0 %, issue slots busy 37.8 %, warps an SM 7.9
  top stalls: VIMNMX (block-table clamp) 7.1 % long_sb; tile barrier 6.7 %

== 71/1/64 FP8 e4m3, triton (default)
  duration 168.3 us, DRAM 18.9 %, issue active 40.4 %, tensor pipe 22.8 %, warps an SM 7.8, registers 225.0 a thread
   18.6%  BAR.SYNC.DEFER_BLOCKING 0x0                                   long_sb 3322, wait 17
    5.0%  WARPGROUP.DEPBAR.LE gsb0, 0x0                                 barrier 858, not_selected 28
  by opcode: BAR 21.1%, MUFU 13.7%
"""


def test_profile_sections_read_the_figures_the_readme_quotes():
    from fp8kv.published.textfiles import profile_section, profile_sections
    secs = profile_sections(PROFILE, "p.txt")
    odd = profile_section(secs, "32/32/80 ", "p.txt")
    assert (odd["duration"], odd["DRAM"], odd["bytes_x"], odd["L2 throughput"]) == (2020.0, 70.4, 1.27, 93.1)
    assert odd["issue slots busy"] == 37.8 and odd["samples"] == []  # the stall line is not a sample
    t = profile_section(secs, "71/1/64 FP8 e4m3, triton", "p.txt")
    assert (t["issue active"], t["tensor pipe"], t["DRAM"], t["warps an SM"]) == (40.4, 22.8, 18.9, 7.8)
    assert "bytes_x" not in t
    assert t["samples"] == [(18.6, "BAR.SYNC.DEFER_BLOCKING 0x0"), (5.0, "WARPGROUP.DEPBAR.LE gsb0, 0x0")]


@pytest.mark.parametrize("text, message", [
    ("no sections at all\n", "no '== <kernel>' section"),
    ("== 8/1/256\n  DRAM 50 %\n", "has no 'duration'"),
    ("== a\n  duration 1 us\n== a\n  duration 2 us\n", "appears twice"),
])
def test_a_profile_that_is_not_a_summary_is_named(text, message):
    from fp8kv.published.textfiles import profile_sections
    with pytest.raises(ValueError, match=message) as err:
        profile_sections(text, "p.txt")
    assert "p.txt" in str(err.value)


@pytest.mark.parametrize("starts", ["16/16/256", ""])  # none, both
def test_a_profile_section_that_is_not_there_or_not_one_is_named(starts):
    from fp8kv.published.textfiles import profile_section, profile_sections
    with pytest.raises(ValueError, match="expected one"):
        profile_section(profile_sections(PROFILE, "p.txt"), starts, "p.txt")


CONSOLE = """# header

                          case   B   ctx  splits        us  GB/s  %copy  rel_err check
           triton bf16 dequant   1  4096      32     12.38  1357  33.02 0.002077  True
triton-gluon=True fp8 dequant   1  4096      32        10 840.1  20.45 0.001665  True
           triton bf16 dequant   1  4096       8     22.50  2000  40.00 0.002000  True
triton-gluon=True fp8 dequant   1  4096       8     17.47  1921  46.76 0.001694  True
           triton bf16 dequant  64 16384       3      1000  4000  90.00 0.002000  True
triton-gluon=True fp8 dequant  64 16384       3 1.075e+04  3196  77.78 0.001681  True
           triton bf16 dequant  64 16384       1      4000  4000  90.00 0.002000  True
triton-gluon=True fp8 dequant  64 16384       1      2384  3604  87.71 0.001653 False
copy bandwidth: 4109 GB/s
"""


def test_console_table_gives_each_row_its_shape():
    from fp8kv.published.textfiles import console_table
    t = console_table(CONSOLE, ["32/8/128", "32/32/128"], "c.txt")
    assert len(t) == 8 and list(t["shape"]) == ["32/8/128"] * 2 + ["32/32/128"] * 2 + ["32/8/128"] * 2 + ["32/32/128"] * 2
    g = t[t["case"] == "triton-gluon=True fp8 dequant"].set_index(["shape", "batch"])
    assert g.loc[("32/8/128", 64), "time_us"] == 10750.0 and g.loc[("32/32/128", 1), "time_us"] == 17.47
    assert not g.loc[("32/32/128", 64), "check_passed"] and g.loc[("32/32/128", 1), "check_passed"]


@pytest.mark.parametrize("text, shapes, message", [
    ("no table\n", ["a"], "no table headed"),
    (CONSOLE, ["32/8/128"], "more than 1 shapes"),
    (CONSOLE, ["a", "b", "c"], "expected 3"),
    (CONSOLE.replace("12.38", "twelve"), ["a", "b"], "does not parse"),
    (CONSOLE.replace("   1  4096      32     12.38", "   1  4096", 1), ["a", "b"], "does not parse"),
    (CONSOLE.replace("           triton bf16 dequant   1  4096      32     12.38  1357  33.02 0.002077  True",
                     "      1  4096  True", 1), ["a", "b"], "fields"),
])
def test_a_console_table_that_does_not_read_is_named(text, shapes, message):
    from fp8kv.published.textfiles import console_table
    with pytest.raises(ValueError, match=message) as err:
        console_table(text, shapes, "c.txt")
    assert "c.txt" in str(err.value)


def test_rule_ratios_average_repeated_timings_and_name_a_missing_rule():
    from fp8kv.published.probes import rule_ratios
    rows = pd.DataFrame({"shape": ["a"] * 3 + ["b"] * 2, "rule": ["before", "after", "before", "before", "after"],
                         "time_us": [10.0, 9.0, 8.0, 4.0, 5.0], "splits": [3, 2, 3, 1, 1]})
    r = rule_ratios(rows, ["shape"], "rule", "after", "before", "x.json", extra=("splits",)).set_index("shape")
    assert r.loc["a", "old_us"] == 9.0 and r.loc["a", "x"] == 1.0 and r.loc["b", "x"] == 1.25
    assert (r.loc["a", "splits_old"], r.loc["a", "splits_new"]) == (3, 2)
    with pytest.raises(ValueError, match=r"x\.json: point .*'b'.* lacks"):
        rule_ratios(rows.drop(index=4), ["shape"], "rule", "after", "before", "x.json")
    with pytest.raises(ValueError, match=r"x\.json: lacks columns \['min_waves'\]"):
        rule_ratios(rows, ["shape"], "min_waves", 4, 2, "x.json")


@pytest.mark.parametrize("value", [-533.8, 0.0, float("nan"), "fast"])
def test_a_measured_value_that_cannot_be_is_refused_not_published(value):
    """A sign-flipped time in a cited file was published as -533.8 us (and moved a speed-up from 1.09x to 1.83x)."""
    df = pd.DataFrame({"status": ["ok", "ok"], "check_passed": [True, True], "time_us": [10.0, value]})
    with pytest.raises(ValueError, match=r"t.csv: column 'time_us' holds .* expected a finite number > 0"):
        ok_rows(df, "t.csv")
    assert len(ok_rows(df.assign(status=["ok", "error"]), "t.csv")) == 1  # a row that did not run is not read


def test_a_cited_file_of_another_shape_is_an_error_not_a_stale_readme(tmp_path, monkeypatch, capsys):
    """A KeyError from a section reading a file of another version exited 1, as an out-of-date README does."""
    import fp8kv.published.cli as cli

    def broken(*args, **kwargs):
        raise KeyError("batch")

    monkeypatch.setattr(cli, "check", broken)
    assert main(["readme", "--check"]) == 2
    assert "a cited results file lacks what the README reads from it (KeyError: 'batch')" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [(["values", "--check"], "--check applies to readme only"),
                                         (["values", "--readme", "X"], "--readme applies to readme only"),
                                         (["values", "--check", "--readme", "X"], "--check and --readme apply to readme"),
                                         (["bogus"], "invalid choice: 'bogus'")])
def test_a_flag_the_subcommand_does_not_use_is_refused_in_one_line(argv, words, capsys):
    """values took --check and --readme and ignored them (exit 0); a bad subcommand printed the usage too."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and words in err


def test_a_cited_json_of_another_shape_and_an_empty_root_are_named(tmp_path, capsys):
    root = _copy_results(tmp_path)
    rel = "reports/nvidia-h200/04_decode_latency.json"
    doc = json.loads((root / rel).read_text())
    del doc["results"]["layouts"]
    (root / rel).write_text(json.dumps(doc))
    assert main(["values", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"{rel} (the last file layouts read) lacks what the README reads from it (KeyError: 'layouts')" in err
    assert main(["values", "--root", ""]) == 2
    assert "root='' is no folder path" in capsys.readouterr().err
