"""The one-page report, read by a real browser, and the charts and memory figures it shows.

The browser test loads the page in headless Chromium (Debian's `chromium`, which `.ci/run`
installs), reads the DOM it rendered and a screenshot, and checks the content is there and the
page is not blank. It is skipped, saying so, only where no Chromium is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import fxpar
from fxpar.pictures.charts import memory_chart, memory_figure, schedule_chart, schedule_figure
from fxpar.pictures.rank_memory import TERMS, predicted_memory
from fxpar.schedule.simulation import simulate
from fxpar.tools.report import write_report

sys.path.insert(0, str(Path(__file__).parent))
from small_gpt import small_capture  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def captured():
    return small_capture()


@pytest.fixture(scope="module")
def program(captured):
    return fxpar.compile(captured, "dp=2 tp=2 pp=2 mb=2 schedule=zb-h1")


@pytest.fixture(scope="module")
def page(program, captured, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "plan.html"
    measured = [[(str(a), 1.3 * s + 5.0, 1.3 * e + 5.0) for a, s, e in row]
                for row in program.estimate("h100").pipeline.timeline]
    write_report(program, path, rank=3, compare=fxpar.compile(captured, "dp=4"), timeline=measured)
    return path


def test_the_page_is_self_contained(page):
    text = page.read_text()
    for forbidden in ("<script", "<link", "@import", "url(http", "src=", "<img", "@font-face"):
        assert forbidden not in text, forbidden
    # The only URLs are SVG's namespace names, which nothing fetches.
    assert set(re.findall(r'[a-z:]*="?(https?://[^" ]*)', text)) <= {
        "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert text.count("<svg") == 3  # graph, schedule, memory


def test_the_page_holds_plan_stages_estimate_and_collectives(program, page):
    text = page.read_text()
    assert "fxpar plan &#x27;dp=2 pp=2 tp=2 schedule=zb-h1 mb=2&#x27;" in text
    assert "h.1.ln_1 .. lm_head" in text  # the stage table
    estimate = program.estimate("h100")
    assert str(estimate.formulas["memory.total"]) in text  # a formula, whole
    for call in program.collectives(3):
        assert f"<td>{call.tag}</td>" in text
    assert "Compared with plan &#x27;dp=4&#x27;" in text and "gradient bucket # + loss" in text


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (scripts/setup.sh installs Debian's chromium)")
def test_chromium_renders_the_page(page, tmp_path):
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*command, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    headings = re.findall(r"<h2>(.*?)</h2>", dom)
    assert headings[:4] == ["The plan", "Stages", "The partitioned graph", "The pipeline schedule"]
    assert dom.count("<svg") == 3 and "stage 1 (pipeline rank 1)" in dom
    shot = tmp_path / "shot.png"
    subprocess.run([*command, f"--screenshot={shot}", "--window-size=1200,2000", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    pixels = Image.open(shot).convert("L")
    inked = sum(count for level, count in enumerate(pixels.histogram()) if level < 200)
    assert inked > 0.02 * pixels.width * pixels.height, "the screenshot is (nearly) blank"


def test_the_worst_ranks_memory_is_the_estimates(captured):
    for plan in ("dp=2", "tp=2 pp=2 mb=2", "dp=2 pp=2 mb=4 zero=1 precision=bf16-mixed"):
        program = fxpar.compile(captured, plan)
        estimate = program.estimate("h100")
        predicted = predicted_memory(program)
        assert set(predicted) == {program.mesh.rank_of(pp=i) for i in range(program.mesh.pp)}
        assert predicted[estimate.rank] == estimate.memory, plan


def test_schedule_chart_puts_simulated_and_measured_side_by_side(program, tmp_path):
    simulated = program.estimate("h100").pipeline
    measured = [[(str(a), s, e) for a, s, e in row] for row in simulated.timeline]
    figure = schedule_figure(simulated, measured=measured)
    left, right = figure.axes
    assert left.get_title().startswith("simulated: zb-h1") and right.get_title().startswith("measured")
    actions = sum(len(row) for row in simulated.timeline)
    assert len(left.patches) == len(right.patches) == actions  # one bar per F, B and W
    assert ET.parse(schedule_chart(tmp_path / "s.svg", simulated)).getroot().tag.endswith("svg")
    unit_costs = schedule_figure(simulate(program.schedule, 1, 2))  # the simulator's own units
    assert unit_costs.axes[0].get_xlabel().startswith("time (units")
    assert schedule_chart(tmp_path / "s.png", simulated, measured=measured).read_bytes()[:4] == b"\x89PNG"


def test_memory_bars_stack_each_term_and_measured_beside(program, tmp_path):
    predicted = predicted_memory(program)
    measured = {0: {**{t: 1.1 * predicted[0][t] for t in TERMS}, "peak": 1.2 * predicted[0]["total"]},
                2: {"params": 1000, "grads": 1000, "optimizer": 2000, "peak": None}}  # memory_stats() on a CPU
    figure = memory_figure(predicted, measured=measured)
    bars = [p for p in figure.axes[0].patches if p.get_height() > 0]
    stacked = sum(1 for terms in [*predicted.values(), *measured.values()] for t in TERMS if terms.get(t))
    assert len(bars) == stacked
    labels = [t.get_text() for t in figure.axes[0].texts]
    assert "4.0 kB held" in labels and len(labels) == 4  # a label per bar
    assert memory_chart(tmp_path / "m.png", predicted).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=".svg, .png or .pdf"):
        memory_chart(tmp_path / "m.jpg", predicted)


def test_a_missing_matplotlib_names_the_extra(program, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'fxpar\[viz\]'"):
        memory_figure(predicted_memory(program))
