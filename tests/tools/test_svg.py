"""tools/svg.py: each figure is well-formed SVG whose shapes stand where its numbers say."""

import math
import xml.etree.ElementTree as ET

from nanohlat.tools import svg

NS = "{http://www.w3.org/2000/svg}"


def parse(text):
    root = ET.fromstring(text)           # raises on malformed XML
    assert root.tag == NS + "svg"
    return root


def test_ticks_are_round_and_cover_the_range():
    assert svg.ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert [round(t, 9) for t in svg.ticks(0.13, 0.91)] == [0.2, 0.4, 0.6, 0.8]
    assert svg.ticks(5, 5) == [5]
    assert svg.ticks(math.nan, 1) == []


def test_line_chart_leaves_a_gap_at_a_non_finite_value():
    root = parse(svg.line_chart({"loss": [(1, 3.0), (2, 2.5), (3, math.nan), (4, 2.0), (5, 1.8)]},
                                "step", "loss"))
    lines = root.findall(NS + "polyline")
    assert len(lines) == 2                               # steps 1-2 and 4-5, nothing across step 3
    first = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len(first) == 2 and first[0][1] < first[1][1]  # the loss falls: drawn lower (SVG's y points down)


def test_stacked_bar_segments_add_up_and_the_limit_is_drawn_where_it_belongs():
    text = svg.stacked_bars([("tp 2", [("weights", 30.0), ("grads", 10.0)]),
                             ("tp 1", [("weights", 60.0), ("grads", 20.0)])], "bytes", limit=100,
                            limit_label="device")
    root = parse(text)
    rects = [r for r in root.findall(NS + "rect") if r.find(NS + "title") is not None]
    widths = [float(r.get("width")) for r in rects]
    assert math.isclose(widths[2] + widths[3], 2 * (widths[0] + widths[1]), rel_tol=1e-3)
    limit = [ln for ln in root.findall(NS + "line") if ln.get("stroke") == "#c00"][0]
    x0 = float(rects[0].get("x"))
    assert math.isclose(float(limit.get("x1")) - x0, (widths[2] + widths[3]) * 100 / 80, rel_tol=1e-3)


def test_gantt_boxes_span_their_times_and_text_is_escaped():
    root = parse(svg.gantt([("stage 0", [(0, 1, "F0", 0), (1, 3, "B0", 1)]),
                            ("<stage 1>", [(1, 2, "F0", 0)])], "time"))
    boxes = [r for r in root.findall(NS + "rect") if r.find(NS + "title") is not None]
    w = [float(b.get("width")) for b in boxes]
    assert math.isclose(w[1], 2 * w[0], rel_tol=1e-3) and math.isclose(w[2], w[0], rel_tol=1e-3)
    assert any(t.text == "<stage 1>" for t in root.iter(NS + "text"))


def test_grid_colours_only_the_cells_with_a_kind():
    root = parse(svg.grid([[("r0", 0), ("", None)]], ["row"], ["a", "b"]))
    fills = [r.get("fill") for r in root.findall(NS + "rect")]
    assert fills == [svg.colour(0), "#fff"]


def test_grouped_bars_are_measured_from_zero_on_one_axis():
    root = parse(svg.grouped_bars([("a", [("plan", 10.0), ("measured", 5.0)]), ("b", [("plan", 20.0)])], "bytes"))
    rects = [r for r in root.findall(NS + "rect") if r.find(NS + "title") is not None]
    assert [r.find(NS + "title").text for r in rects] == ["plan: 10 bytes", "measured: 5 bytes", "plan: 20 bytes"]
    widths = [float(r.get("width")) for r in rects]
    assert math.isclose(widths[0], 2 * widths[1], rel_tol=1e-3) and math.isclose(widths[2], 2 * widths[0], rel_tol=1e-3)
    assert len({r.get("x") for r in rects}) == 1                       # every bar starts at the axis
    assert rects[0].get("fill") == rects[2].get("fill") != rects[1].get("fill")   # a series keeps its colour


def test_panels_place_each_figure_in_its_cell():
    a = svg.grid([[("0", 0)]], ["r"], ["c"])
    b = svg.grid([[("1", 1), ("2", 2)]], ["r"], ["c", "d"])
    root = parse(svg.panels([a, b, a], columns=2, title="three"))
    inner = root.findall(NS + "svg")
    assert [(float(s.get("x")), float(s.get("y"))) for s in inner] == [
        (0, 22), (float(parse(a).get("width")) + 10, 22), (0, 22 + float(parse(b).get("height")) + 10)]
    assert float(root.get("width")) == float(parse(a).get("width")) + 10 + float(parse(b).get("width"))
    assert [t.text for t in inner[1].iter(NS + "text") if t.text in ("1", "2")] == ["1", "2"]


def test_tick_labels_never_repeat_where_the_ticks_differ():
    for lo, hi in ((6.24, 6.25), (0, 1.6e6), (0.13, 0.91), (1e-4, 3e-4), (0, 10)):
        ts = svg.ticks(lo, hi)
        labels = svg.tick_labels(ts)
        assert len(set(labels)) == len(ts) > 1, (lo, hi, labels)
    assert svg.tick_labels(svg.ticks(0, 1.6e6)) == ["0", "500k", "1.0M", "1.5M"]
