"""Plotly figure builders for the notebooks: each function takes data and returns a Figure.

Nothing here shows a figure or computes a measurement; notebooks display what these return
(``fig`` as a cell's last expression, or ``fig.show()``). Call :func:`setup_plotly` once per
notebook, before the first figure, so figures survive the HTML export of headless runs.

Data arguments are tidy pandas DataFrames (one measurement per row, conditions as columns) or
plain fp8kv objects, so results of several GPUs can be concatenated and drawn by the same function."""

from __future__ import annotations

from .analysis_figures import (
    grouped_bars,
    per_layer,
    quant_error_heatmap,
)
from .bench_figures import (
    MATRIX_STATUS_COLORS,
    backend_check_matrix,
    bandwidth_roofline,
    bench_lines,
    bench_metric,
    error_vs_tolerance,
    layout_speedups,
    speedup_heatmap,
)
from .deciding_figures import (
    advice_bars,
    breakeven_lines,
    breakeven_residuals,
    long_context_errors,
    needle_margins,
    scale_health_map,
)
from .format_figures import (
    capability_matrix,
    cast_comparison,
    fp8_code_values,
    relative_error_vs_magnitude,
)
from .format_pareto import (
    error_digits,
    format_answer,
    format_bytes,
    format_layer_errors,
    format_pick,
    join_step_ceilings,
    pareto_figure,
    pareto_front,
)
from .style import (
    AXIS_TITLES,
    DEFAULT_RENDERER,
    FORMAT_COLORS,
    MIN_COLOUR_DISTANCE,
    MIN_CONTRAST,
    MODE_DASH,
    MODE_SYMBOL,
    PALETTE,
    TOKEN_COLUMNS,
    add_ceiling,
    axis_title,
    color_map,
    line,
    measured_ticks,
    mode_dash,
    mode_symbol,
    series_color,
    setup_plotly,
    tokens_label,
    written_log_ticks,
)

__all__ = [
    "DEFAULT_RENDERER",
    "setup_plotly",
    "line",
    "add_ceiling",
    "fp8_code_values",
    "relative_error_vs_magnitude",
    "cast_comparison",
    "capability_matrix",
    "bench_lines",
    "bench_metric",
    "speedup_heatmap",
    "bandwidth_roofline",
    "backend_check_matrix",
    "error_vs_tolerance",
    "quant_error_heatmap",
    "grouped_bars",
    "PALETTE",
    "AXIS_TITLES",
    "axis_title",
    "series_color",
    "color_map",
    "mode_dash",
    "mode_symbol",
    "per_layer",
    "layout_speedups",
    "tokens_label",
    "written_log_ticks",
    "measured_ticks",
    "MIN_CONTRAST",
    "MIN_COLOUR_DISTANCE",
    "FORMAT_COLORS",
    "MODE_DASH",
    "MODE_SYMBOL",
    "TOKEN_COLUMNS",
    "MATRIX_STATUS_COLORS",
    "breakeven_lines",
    "breakeven_residuals",
    "scale_health_map",
    "advice_bars",
    "long_context_errors",
    "needle_margins",
    "pareto_front",
    "pareto_figure",
    "format_bytes",
    "format_layer_errors",
    "format_pick",
    "format_answer",
    "join_step_ceilings",
    "error_digits",
]
