"""``reports/index.html``: one page across the GPUs that have reports, their headline numbers and
overlaid figures."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from ..results import load_results, write_atomic
from .pages import INDEX, MANIFEST, default_notebook_dir, drop_network_loads, notebook_hash, read_manifest

# --------------------------------------------------------------------------- one page across GPUs


def _candidate_folders(root: Path) -> list[Path]:
    """The visible sub-folders of a reports root that hold a manifest.json, sorted by name."""
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (p / MANIFEST).is_file())


def report_folders(root: Path, skipped: list[str] | None = None) -> list[Path]:
    """The ``<gpu-slug>/`` folders of a reports root, sorted by name: those whose manifest.json reads as
    the runner writes it (:func:`read_manifest`). A folder with some other JSON is not a report; one
    whose manifest is truncated or foreign, or names another GPU than the folder, is left out too, and why is
    appended to ``skipped``."""
    found = []
    for folder in _candidate_folders(root):
        try:
            slug = read_manifest(folder).get("gpu_slug")
        except ValueError as exc:
            if skipped is not None:
                skipped.append(f"{folder.name}/ left out: {str(exc).replace(str(folder.parent) + os.sep, '')}")
            continue
        if slug is not None and slug != folder.name:  # a folder copied or renamed: its GPU is not its name's
            if skipped is not None:
                skipped.append(f"{folder.name}/ left out: its manifest.json is the report of {slug!r}, not of "
                               f"{folder.name!r} (a copied or renamed folder; each GPU's report is reports/<its slug>/)")
            continue
        found.append(folder)
    return found


def _read(folder: Path, name: str, notes: list[str] | None = None) -> dict | None:
    """A notebook's results in ``folder``; None when there are none, or (said in ``notes``) when its
    file is unreadable: a corrupt file reads as missing numbers, never as a crash of the index."""
    if not (folder / f"{name}.json").is_file():
        return None
    try:
        return load_results(folder, name)["results"]
    except (OSError, ValueError) as exc:
        if notes is not None:
            notes.append(f"{folder.name}/{name}.json read as missing: "
                         f"{str(exc).replace(str(folder.parent) + os.sep, '')}")
        return None


def fmt_value(value, spec=".3g", unit="") -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return f"{value:{spec}}{unit}" if ok else "–"


def as_dicts(value) -> list[dict]:
    """The objects of a results list (a missing or foreign value holds none)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def as_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def as_text(value) -> str:
    """A field shown as text: missing reads "–"."""
    return "–" if value is None or value == "" else str(value)


def smoke_notebooks(manifest: dict, folder: Path | None = None) -> set[str]:
    """The notebooks of a report whose last run was a smoke run: its manifest entry's ``mode`` (the runner's
    record), else the run's own (the manifest's), else what the results say (``grid.smoke``,
    ``settings.smoke``, ``shape.smoke``, ``timings_meaningful_for_gpu`` false). A smoke run checks the code
    path at toy sizes, often on a CPU: its numbers are no result, for this GPU or any. A results file the
    manifest has no entry for takes the manifest's mode."""
    out = set()
    listed = {e.get("name") for e in as_dicts(manifest.get("notebooks"))}
    if manifest.get("mode") == "smoke" and folder is not None:  # results the manifest lists no entry for: its run's
        out |= {p.stem for p in Path(folder).glob("*.json") if p.name != MANIFEST and p.stem not in listed}
    for entry in as_dicts(manifest.get("notebooks")):
        name = entry.get("name")
        mode = entry.get("mode") or manifest.get("mode")
        if mode == "smoke":
            out.add(name)
        elif mode is None and folder is not None:
            res = _read(folder, name) or {}
            flags = [as_dict(res.get(k)).get("smoke") for k in ("grid", "settings", "shape")]
            if any(f is True for f in flags) or res.get("timings_meaningful_for_gpu") is False:
                out.add(name)
    return out


def shapes_text(rows: list[dict]) -> str:
    """The grid a median was taken over: ``12 shapes, B 1-256 x 1k-64k tokens``."""
    shapes = {(r.get("batch"), r.get("context")) for r in rows}
    batches = sorted(b for b, _ in shapes if isinstance(b, (int, float)))
    contexts = sorted(c for _, c in shapes if isinstance(c, (int, float)) and math.isfinite(c))
    if not batches or not contexts:
        return f"{len(shapes)} shapes"
    from ..viz.style import tokens_label

    return (f"{len(shapes)} shape{'s' * (len(shapes) != 1)}, B {batches[0]}–{batches[-1]} × "
            f"{tokens_label(contexts[0])}–{tokens_label(contexts[-1])} tokens")


# The FP8 decode the index's speed-up column summarises: fp8kv's default (its backend, KV dtype and mode).
HEADLINE_FP8 = {"backend": "triton", "kv_dtype": "fp8_e4m3", "mode": "dequant"}


def stale_pages(manifest: dict, notebook_dir: str | os.PathLike | None = None) -> set[str]:
    """The notebooks of a report whose recorded ``source_sha256`` is not the hash of the notebook of that name
    in ``notebook_dir`` (default: the repository's, :func:`~.pages.default_notebook_dir`) today, or that
    record none, or whose notebook is gone: rendered from an earlier version, so not what the notebook shows
    now. A page stays linked; the index says it is stale until the notebook is run again on that machine."""
    folder = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    stale = set()
    for e in as_dicts(manifest.get("notebooks")):
        name = e.get("name")
        if not isinstance(name, str):
            continue
        source = folder / f"{name}.ipynb"
        if not source.is_file() or e.get("source_sha256") != notebook_hash(source):
            stale.add(name)
    return stale


def recorded_code(manifest: dict) -> dict[str, str | None]:
    """Per notebook of a report, the digest of the fp8kv code its page was rendered with: the entry's own
    ``fp8kv_source`` (the runner records one per page), else, for a page rendered before it did, the run's
    (the manifest's ``device.fp8kv_source``); None where neither is recorded."""
    run = as_dict(manifest.get("device")).get("fp8kv_source")
    out = {}
    for e in as_dicts(manifest.get("notebooks")):
        if isinstance(e.get("name"), str):
            own = e.get("fp8kv_source")
            out[e["name"]] = own if isinstance(own, str) and own else run if isinstance(run, str) and run else None
    return out


def code_changed_pages(manifest: dict, current: str | None = None) -> set[str]:
    """The notebooks of a report whose page was rendered with other fp8kv code than ``current`` (default the
    code imported now, :func:`fp8kv.device.source_digest`), or with code no digest records (:func:`recorded_code`):
    their numbers stand for the code of that run, not for today's kernels and rules."""
    if current is None:
        from ..device import source_digest

        current = source_digest()
    return {name for name, digest in recorded_code(manifest).items() if digest != current}


def gpu_summary(folder: str | os.PathLike, notebook_dir: str | os.PathLike | None = None,
                code: str | None = None) -> dict:
    """One GPU's row of the index, from the results JSON in its report folder (missing ones give "–").

    Keys: ``slug``, ``name``, ``arch``, ``versions``, ``mode``, ``capability`` (supported / total
    backend × KV dtype × mode rows here), ``copy_gbps``, ``speedup`` (fp8kv's default FP8 decode, e4m3
    in dequant mode, over the best 16-bit decode of the same shape, per head layout: median and best over
    the shapes measured; FlashInfer's FP8 rows and fp8 mode are on page 04), ``kv_capacity`` (per planner model:
    FP8 e4m3 / bf16 tokens on this GPU, or the ratio where the machine has no GPU memory), ``kl``
    (per model, mean KL of e4m3 amax-scaled KV against bf16), ``timings_meaningful``, ``pages``,
    ``smoke`` (the notebooks whose last run was a smoke run: :func:`smoke_notebooks`; their numbers are left
    out, as no result), ``stale`` (:func:`stale_pages`: pages rendered from another version of their notebook
    than ``notebook_dir``'s, flagged on the page), ``code_changed`` (:func:`code_changed_pages`: pages rendered
    with other fp8kv code than ``code``, default today's), ``rendered_with`` (:func:`recorded_code`) and
    ``speedup_grid`` (the shapes the speed-up's median is over).
    """
    import statistics

    folder = Path(folder)
    notes: list[str] = []
    manifest = read_manifest(folder) if (folder / MANIFEST).is_file() else {}
    smoke = smoke_notebooks(manifest, folder)
    # a smoke run's numbers are no result: read as missing (its pages stay linked)
    env, cap, lat, acc = (None if n in smoke and n != "00_environment" else _read(folder, n, notes)
                          for n in ("00_environment", "03_kv_capacity", "04_decode_latency", "06_model_accuracy"))
    # The manifest describes the newest run into the folder (its versions), notebook 00 its own run.
    device = as_dict(manifest.get("device")) or as_dict((env or {}).get("device"))
    row = {"slug": folder.name, "name": str(device.get("name") or folder.name), "arch": as_text(device.get("arch")),
           "versions": ", ".join(f"{k} {device[k]}" for k in ("torch", "triton", "flashinfer", "vllm") if device.get(k)),
           "mode": as_text(manifest.get("mode")), "capability": "–", "copy_gbps": None, "speedup": {},
           "kv_capacity": {}, "kl": {}, "timings_meaningful": None, "notes": notes, "smoke": smoke,
           "speedup_grid": "", "stale": stale_pages(manifest, notebook_dir),
           "code_changed": code_changed_pages(manifest, code), "rendered_with": recorded_code(manifest),
           "pages": [(e["name"], f"{folder.name}/{e['html']}") for e in manifest.get("notebooks", []) if e.get("html")]}
    if env:
        here = as_dicts(env.get("capability_here"))
        row["capability"] = f"{sum(bool(r.get('supported')) for r in here)} of {len(here)} run here"
        if "00_environment" not in smoke:  # what runs here is a fact in any run; a bandwidth only in a full one
            row["copy_gbps"] = as_dict(env.get("copy_bandwidth")).get("gbps")
    if lat:
        row["timings_meaningful"] = lat.get("timings_meaningful_for_gpu")
        by_heads: dict[str, list[float]] = {}
        used = []
        for r in as_dicts(lat.get("speedup")):
            v = r.get("speedup_vs_bf16")
            default = all(r.get(k) == want for k, want in HEADLINE_FP8.items()) and not r.get("variant")
            if default and isinstance(v, (int, float)) and math.isfinite(v):
                # a row without its head counts still counts, under "–" (missing reads as missing)
                by_heads.setdefault(f"{as_text(r.get('num_q_heads'))}:{as_text(r.get('num_kv_heads'))}", []).append(v)
                used.append(r)
        row["speedup_grid"] = shapes_text(used) if used else ""
        row["speedup"] = {h: (statistics.median(v), max(v)) for h, v in sorted(by_heads.items())}
    if cap:
        for r in as_dicts(cap.get("rows")):
            if r.get("gpu") == "this device" and r.get("fits") and r.get("granularity") in (None, "tensor"):
                row["kv_capacity"].setdefault(as_text(r.get("model")), {})[as_text(r.get("kv_dtype"))] = r.get("tokens")
        if not row["kv_capacity"]:
            row["kv_capacity"] = {m: {"ratio": v} for m, v in as_dict(cap.get("fp8_over_bf16_tokens_ratio")).items()}
    if acc:
        for r in as_dicts(acc.get("summary")):
            if r.get("config") == "e4m3 tensor amax":
                row["kl"][as_text(r.get("model"))] = r.get("kl_mean")
    return row


def _code_changed_text(row: dict) -> str:
    """The pages whose fp8kv code has changed, grouped by the code each was rendered with (never today's digest,
    which every commit changes: the page stays the same until a page's flag does)."""
    import html

    by_code: dict[str, list[str]] = {}
    for name in sorted(row["code_changed"]):
        digest = row["rendered_with"].get(name)
        by_code.setdefault(f"fp8kv {digest}" if digest else "no recorded fp8kv digest", []).append(name)
    groups = "; ".join(f"{', '.join(names)} ({what})" for what, names in by_code.items())
    return html.escape(groups + ": their numbers stand for that code, not today's; run them again to refresh them")


def _millions(tokens) -> str:
    return fmt_value(tokens / 1e6, ".2f") if fmt_value(tokens) != "–" else "–"


def _capacity_text(kv: dict) -> str:
    import html

    parts = []
    for model, v in kv.items():
        if "ratio" in v:
            parts.append(f"{html.escape(model)}: FP8/bf16 {fmt_value(v['ratio'], '.3f', '×')}")
        elif "fp8_e4m3" in v:
            parts.append(f"{html.escape(model)}: {_millions(v['fp8_e4m3'])} M FP8 / {_millions(v.get('bf16'))} M bf16")
    return "<br>".join(parts) or "–"


def _overlay_figures(folders: list[Path]):
    """Latency vs context (each GPU's largest batch) and % of copy bandwidth vs batch (largest context), of
    full GPU runs only: a smoke run's timings (toy sizes, often Triton's interpreter on a CPU) are never
    drawn beside a GPU's."""
    import pandas as pd

    from .. import viz

    frames = []
    for folder in folders:
        if "04_decode_latency" in smoke_notebooks(read_manifest(folder), folder):
            continue
        results = _read(folder, "04_decode_latency") or {}
        if results.get("timings_meaningful_for_gpu") is False:
            continue  # a CPU's timings mean nothing for any GPU
        rows = as_dicts(results.get("rows"))
        df = pd.DataFrame(rows)
        if not len(df) or not {"status", "label", "batch", "context", "time_us"} <= set(df.columns):
            continue  # rows without what the figures plot are missing numbers, not a KeyError
        for col in ("gbps", "pct_copy_bw"):  # hover only: absent reads as missing
            if col not in df.columns:
                df[col] = float("nan")
        # a row is plotted only with a label and real numbers where the figures put it (values kept as read)
        plotted = (df["status"] == "ok") & df["label"].map(lambda x: isinstance(x, str))
        for col in ("batch", "context", "time_us"):
            plotted &= df[col].map(lambda x: fmt_value(x) != "–")
        df = df[plotted]
        if len(df):
            frames.append(df.assign(gpu=folder.name))
    if not frames:
        return []
    data = pd.concat(frames, ignore_index=True)
    data["series"] = data["gpu"] + " · " + data["label"]
    at_batch = data[data["batch"] == data.groupby("gpu")["batch"].transform("max")]
    at_context = data[data["context"] == data.groupby("gpu")["context"].transform("max")]
    batches = ", ".join(f"{g} B = {int(b)}" for g, b in at_batch.groupby("gpu")["batch"].max().items())
    contexts = ", ".join(f"{g} {viz.tokens_label(c)} tokens" for g, c in at_context.groupby("gpu")["context"].max().items())
    latency = viz.line(at_batch.sort_values(["series", "context"]), x="context", y="time_us", color="series",
                       log_x=True, log_y=True, hover=["batch", "gbps", "pct_copy_bw"],
                       title=f"Decode latency vs context, full GPU runs, one point per measured row ({batches})",
                       labels={"series": "GPU · backend · KV dtype · mode"})
    viz.written_log_ticks(latency, "y", at_batch["time_us"])
    viz.measured_ticks(latency, "x", at_batch["context"], "context")
    share = viz.line(at_context.sort_values(["series", "batch"]), x="batch", y="pct_copy_bw", color="series",
                     log_x=True, hover=["context", "time_us", "gbps"],
                     title=f"Share of the copy bandwidth vs batch, full GPU runs, one point per measured row ({contexts})",
                     labels={"series": "GPU · backend · KV dtype · mode"})
    viz.written_log_ticks(share, "x", at_context["batch"], dtick=1)  # decades of sequences: 1, 10, 100
    return [latency, share]


def _plotlyjs_for_index(root: Path) -> str:
    """Relative path of the plotly.js of the installed version in ``root``, the pages' (written there if missing)."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    name = f"plotly-{get_plotlyjs_version()}.min.js"
    if not (root / name).is_file():
        write_atomic(root / name, get_plotlyjs())  # the page may be open: never a half-written library
    return name


def build_index(reports_dir: str | os.PathLike = "reports", notebook_dir: str | os.PathLike | None = None,
                code: str | None = None) -> Path:
    """Write ``<reports_dir>/index.html``: every GPU's report on one page, viewable offline.

    One row per ``<gpu-slug>/`` folder (:func:`gpu_summary`) with links to its pages, and figures that
    overlay the GPUs (latency vs context, share of the copy bandwidth vs batch). Built by every run
    and by ``python -m fp8kv.notebooks index``; a new GPU's folder adds a row, nothing else changes.
    A page rendered from another version of its notebook than ``notebook_dir``'s is flagged stale
    (:func:`stale_pages`), one rendered with other fp8kv code than ``code`` (default the code imported now)
    "code changed" (:func:`code_changed_pages`). A ``reports_dir`` that is not a folder, or a path written (index.html, the plotly.js beside it) that is
    a folder, is a ValueError naming it.
    """
    import html as _html

    root = Path(reports_dir)
    if not root.is_dir():
        raise ValueError(f"reports_dir={str(reports_dir)!r} is not a folder; pass the reports root that holds the "
                         "<gpu-slug>/ report folders")
    skipped: list[str] = []
    folders = report_folders(root, skipped)
    rows = [gpu_summary(f, notebook_dir, code) for f in folders]
    # A folder or file that cannot be read is named on the page and on stderr, never a crash of the index
    # (nor silently dropped); the page of readable reports alone is unchanged.
    notes = skipped + [n for r in rows for n in r["notes"]]
    for note in notes:
        print(f"fp8kv notebooks index: {note}", file=sys.stderr)
    esc = _html.escape

    def only_smoke(r) -> bool:
        return bool(r["pages"]) and all(name in r["smoke"] for name, _ in r["pages"])

    def cells(r) -> list[str]:
        speed = "<br>".join(f"Hq:Hkv {h}: median {fmt_value(m, '.2f', '×')}, best {fmt_value(b, '.2f', '×')}"
                            for h, (m, b) in r["speedup"].items()) or "–"
        if r["speedup"] and r["speedup_grid"]:
            speed += f"<br><i>over {esc(r['speedup_grid'])}</i>"
        if r["timings_meaningful"] is False:
            speed += "<br><i>(CPU timings: not meaningful for any GPU)</i>"
        kl = "<br>".join(f"{esc(m)}: {fmt_value(v, '.2e')} nats/token" for m, v in r["kl"].items()) or "–"
        pages = " · ".join(f'<a href="{esc(href)}">{esc(name)}</a>' + (" (stale)" if name in r["stale"] else "")
                           + (" (code changed)" if name in r["code_changed"] else "")
                           for name, href in r["pages"]) or "–"
        if r["stale"]:
            pages += (f"<br><i>stale: {esc(', '.join(sorted(r['stale'])))} rendered from earlier versions of their "
                      "notebooks (their numbers stand for the code of that run); run them again on this machine to "
                      "refresh them</i>")
        if r["code_changed"]:
            pages += f"<br><i>code changed since this page was rendered: {_code_changed_text(r)}</i>"
        smoke = sorted(r["smoke"])
        run = esc(r["mode"]) + (f"<br><i>smoke, no numbers shown: {esc(', '.join(smoke))}</i>"
                                if smoke and not only_smoke(r) else "")
        return [f"<b>{esc(r['name'])}</b><br><code>{esc(r['slug'])}</code>", esc(r["arch"]), esc(r["versions"]),
                run, esc(r["capability"]), fmt_value(r["copy_gbps"], ".4g", " GB/s"), speed,
                _capacity_text(r["kv_capacity"]), kl, pages]

    full_rows = [r for r in rows if not only_smoke(r)]
    smoke_rows = [r for r in rows if only_smoke(r)]
    body = ["<tr>" + "".join(f"<td>{c}</td>" for c in cells(r)) + "</tr>" for r in full_rows]
    smoke_body = ["<tr>" + "".join(f"<td>{c}</td>" for c in (cells(r)[:5] + [cells(r)[-1]])) + "</tr>"
                  for r in smoke_rows]
    figures = _overlay_figures(folders)
    plotly_tag = f'<script src="{_plotlyjs_for_index(root)}" charset="utf-8"></script>' if figures else ""
    # fixed div ids: the same reports give the same page, byte for byte (plotly would draw random ones)
    figure_html = "\n".join(f.to_html(full_html=False, include_plotlyjs=False, include_mathjax=False,
                                      div_id=f"index-figure-{i}") for i, f in enumerate(figures))
    header = ("GPU", "arch", "versions", "run", "capability", "copy bandwidth",
              "fp8kv FP8 (e4m3, dequant) over the best 16-bit decode", "KV tokens (planner models, this GPU)", "KL, e4m3 amax vs bf16", "pages")
    smoke_header = header[:5] + header[-1:]
    note_html = ("<p><b>Not shown:</b></p><ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>\n"
                 if notes else "")
    smoke_html = ("<h2>Smoke runs: code-path checks, not results</h2>\n<p>Toy sizes, often Triton's interpreter on a "
                  "CPU: these runs check that every notebook runs. Their numbers are no result for any GPU and are "
                  "not shown here nor drawn in the figures.</p>\n"
                  f"<table><tr>{''.join(f'<th>{h}</th>' for h in smoke_header)}</tr>\n{chr(10).join(smoke_body)}\n"
                  "</table>\n" if smoke_rows else "")
    full_html = (f"<h2>Full runs</h2>\n<table><tr>{''.join(f'<th>{h}</th>' for h in header)}</tr>\n"
                 f"{chr(10).join(body)}\n</table>\n" if body else "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fp8kv: every GPU</title>{plotly_tag}
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}}th{{background:#f4f4f4}}</style>
</head><body>
<h1>fp8kv: FP8 KV caches on every GPU that has run the notebooks</h1>
<p>One row per report folder under this page ({len(rows)}). Each links to its notebook pages.</p>
{note_html}{full_html}{figure_html}
{smoke_html}</body></html>
"""
    # a temporary file per build: two runs finishing together never rename each other's half-written page
    return write_atomic(root / INDEX, drop_network_loads(page))
