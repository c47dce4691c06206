"""`program.visualize`: the partitioned graph rendered by the real `dot`, read back from its SVG.

Every check reads what graphviz drew (the SVG's clusters, nodes and text), not only the
picture's data: one cluster per stage, every collective of `program.collectives(r)` with its
tag and payload, a module whose name holds quotes, angle brackets and braces drawn verbatim,
and the 48-layer GPT at module detail in under 300 nodes and 10 seconds.
"""

from __future__ import annotations

import html
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import fxpar
from fxpar.ir import meta
from fxpar.pictures.picture import build_picture
from fxpar.pictures.visualize import dot_source

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import factory  # noqa: E402
from small_gpt import small_capture  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"
# Quotes, angle brackets, braces, a record separator, a backslash, an ampersand and a closing
# tag: each means something to DOT or to SVG.
ODD = 'say "hi" <b>{x}|y\\n & </text>'


@pytest.fixture(scope="module")
def captured():
    return small_capture()


@pytest.fixture(scope="module")
def pipelined(captured):
    return fxpar.compile(captured, "dp=2 tp=2 pp=2 mb=2")


def svg_of(program, tmp_path, **options) -> ET.Element:
    path = program.visualize(tmp_path / "picture.svg", **options)
    return ET.parse(path).getroot()  # valid XML, or this raises


def clusters(svg: ET.Element) -> list[str]:
    return [g.find(f"{SVG}title").text for g in svg.iter(f"{SVG}g") if g.get("class") == "cluster"]


def texts(svg: ET.Element) -> list[str]:
    return [t.text or "" for t in svg.iter(f"{SVG}text")]


def test_one_cluster_per_stage_and_a_rank_draws_only_its_own(pipelined, tmp_path):
    assert sorted(clusters(svg_of(pipelined, tmp_path))) == ["cluster_stage_0", "cluster_stage_1"]
    assert clusters(svg_of(pipelined, tmp_path, rank=3)) == ["cluster_stage_1"]
    picture = build_picture(pipelined, rank=0)
    assert {b.stage for b in picture.boxes} <= {0, None}
    (transfer,) = picture.find("transfer")
    assert transfer.lines[0].startswith("rank 0 -> rank 2: (batch, seq, 32)")


@pytest.mark.parametrize("rank", [0, 3])
def test_every_collective_of_the_rank_is_drawn_with_its_tag_kind_and_bytes(pipelined, tmp_path, rank):
    calls = pipelined.collectives(rank)
    words = " ".join(texts(svg_of(pipelined, tmp_path, rank=rank)))
    drawn = {(c.tag, c.payload_bytes) for box in build_picture(pipelined, rank=rank).boxes for c in box.calls}
    for call in calls:
        assert call.tag in words, f"{call} is not in the picture"
        assert (call.tag, call.payload_bytes) in drawn, f"{call}: drawn with other bytes"
        if call.kind not in ("send", "recv"):
            assert call.kind in words
    # The payload formula, then its bytes at the example's size (one microbatch of 2 x 16):
    assert "8*batch*seq x f32 = 4.1 kB" in words


def test_the_global_view_holds_every_ranks_collectives(pipelined):
    tags = {t for box in build_picture(pipelined).boxes for t in box.tags}
    for rank in range(pipelined.world_size):
        assert {c.tag for c in pipelined.collectives(rank)} <= tags


@pytest.mark.parametrize("plan", ["dp=2 zero=3", "dp=2 zero=3 precision=bf16-mixed"])
def test_zero3_gathers_are_the_graphs_own_collectives(captured, plan):
    """ZeRO-3's per-layer gathers (and their reduce-scatters backward) are ops of the graph,
    drawn where each layer starts, with the step program's payloads: under bf16-mixed the
    gathers move bf16 and the reduce-scatters fp32 (the picture once priced both at the fp32
    pieces' bytes)."""
    program = fxpar.compile(captured, plan)
    gathers = [b for b in build_picture(program).boxes if b.title == "gather_parameters · dp"]
    assert len(gathers) == len(meta.graph_parameter_units(program.graph_module)) > 1
    assert {c.kind for b in gathers for c in b.calls} == {"all_gather", "reduce_scatter"}
    predicted = {(c.kind, c.payload_bytes) for c in program.collectives(0) if "gather_parameters" in c.tag}
    assert {(c.kind, c.payload_bytes) for b in gathers for c in b.calls} == predicted


def test_names_with_quotes_brackets_and_braces_are_drawn_verbatim(captured, tmp_path):
    program = fxpar.compile(captured, "tp=2")
    for node in program.graph_module.graph.nodes:  # export refuses such names; the meta may not
        if meta.module_path(node).startswith("h.0"):
            node.meta[meta.MODULE_PATH] = ODD
    source = dot_source(program)
    assert ODD not in source and html.escape(ODD) in source  # escaped once, in an HTML label
    assert ODD in texts(svg_of(program, tmp_path))
    assert ODD in texts(svg_of(program, tmp_path, expand=[ODD]))  # its cluster's label


def test_node_detail_draws_aten_nodes_and_parameters(pipelined):
    picture = build_picture(pipelined, detail="node")
    names = {b.title for b in picture.boxes}
    assert {"scaled_dot_product_attention", "h.0.attn.q.weight", "linear"} <= names
    assert len(picture.boxes) > 3 * len(build_picture(pipelined).boxes)
    expanded = build_picture(pipelined, expand=["h.1"])
    assert {b.expanded for b in expanded.boxes} == {None, "h.1"}
    assert "h.0" in {b.title for b in expanded.boxes} and "h.1" not in {b.title for b in expanded.boxes}


def test_png_and_pdf_by_suffix_and_errors_that_say_the_fix(pipelined, tmp_path):
    assert pipelined.visualize(tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")
    assert pipelined.visualize(tmp_path / "g.pdf").read_bytes().startswith(b"%PDF")
    with pytest.raises(ValueError, match=r"\.svg, \.png, \.pdf"):
        pipelined.visualize(tmp_path / "g.jpg")
    with pytest.raises(ValueError, match="names no module.*h.0"):
        pipelined.visualize(tmp_path / "g.svg", expand=["h.9"])
    with pytest.raises(ValueError, match="choose 'module'"):
        pipelined.visualize(tmp_path / "g.svg", detail="modules")
    with pytest.raises(ValueError, match="rank 8"):
        pipelined.visualize(tmp_path / "g.svg", rank=8)


def test_a_48_layer_gpt_at_module_detail_stays_under_300_nodes_and_10_seconds(tmp_path):
    model, inputs = factory(n_layer=48, n_head=4, n_embd=32, vocab_size=64, seq=16, batch=8, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = fxpar.compile(model, "tp=2 pp=2 mb=2", example_inputs=inputs)
    start = time.perf_counter()
    svg = svg_of(program, tmp_path)
    seconds = time.perf_counter() - start
    nodes = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "node"]
    assert len(nodes) < 300, len(nodes)
    assert seconds < 10, f"{seconds:.1f} s"
    assert {f"h.{i}" for i in range(48)} <= set(texts(svg))
