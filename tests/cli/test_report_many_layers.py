"""The HTML report of a model with many nodes (issue 42.12): one matplotlib bar per node took 34 s
for 1,000 nodes and never finished 200,000. Past ``BAR_LIMIT`` nodes each bar stands for a group
of consecutive nodes at its lowest SQNR, and the page says so; the table of every node is cut at
``TABLE_LIMIT`` rows (report.json holds them all)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _quantplug.report import render_html
from _quantplug.report.html import TABLE_LIMIT
from _quantplug.report.plot import BAR_LIMIT, _bars, group_size, plotted_rows
from tests.cli.test_report_render import _data


def _rows(sqnrs: list[float | None]) -> list[dict[str, Any]]:
    return [
        {
            "node": f"n{i}",
            "op": "aten.linear.default",
            "quantized": i % 3 != 0,
            "sqnr_db": v,
            "identical": v is None,
        }
        for i, v in enumerate(sqnrs)
    ]


@given(st.lists(st.none() | st.floats(-50, 120), min_size=1, max_size=2000))
def test_every_node_is_in_one_bar_at_its_groups_lowest_sqnr(sqnrs: list[float | None]) -> None:
    rows = _rows(sqnrs)
    size = group_size(len(rows))
    bars = _bars(rows, size, top=200.0)
    assert len(bars) <= BAR_LIMIT and [b.first for b in bars] == list(range(0, len(rows), size))
    for b, bar in enumerate(bars):
        group = sqnrs[b * size : (b + 1) * size]
        finite = [v for v in group if v is not None]
        assert bar.value == (min(finite) if finite else 200.0) and bar.identical == (not finite)
        assert bar.quantized == any(i % 3 != 0 for i in range(b * size, b * size + len(group)))
    assert (size == 1) == (len(rows) <= BAR_LIMIT)


def test_a_report_of_many_nodes_says_what_its_plot_shows() -> None:
    pytest.importorskip("matplotlib")
    count = 20_000
    layers = _rows([None if i % 7 == 6 else 20.0 + (i * 7919 % 300) / 10 for i in range(count)])
    page = render_html(_data(layers=layers))
    size = group_size(len(plotted_rows(layers)))
    groups = -(-count // size)
    (alt,) = re.findall(r'<img id="sqnr-plot" alt="([^"]*)"', page)
    assert alt == (
        f"Per-layer SQNR of {count:,} nodes in {groups:,} groups of {size:,} consecutive nodes, each bar a "
        "group&#x27;s lowest SQNR, the 5 worst highlighted"
    )
    assert f"each bar stands for {size:,} consecutive nodes and shows the lowest SQNR among them" in page
    assert (
        f"All compared nodes ({count:,}, graph order; the first {TABLE_LIMIT:,} here, all in report.json)"
        in page
    )
    table = page.split('id="all-nodes"', 1)[1].split("</table>", 1)[0]
    assert table.count('<tr class="node-row">') == TABLE_LIMIT


def test_a_small_report_draws_a_bar_per_node() -> None:
    pytest.importorskip("matplotlib")
    data = _data()
    page = render_html(data)
    assert "groups of" not in page and "the first" not in page
    count = len(plotted_rows(data["layers"]))
    assert f'alt="Per-layer SQNR of {count} nodes, the 5 worst highlighted"' in page
