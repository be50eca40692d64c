"""A steered comparison, drawn by a real browser, reads from the back row.

The bundled toy-world model steers a sad opening with its documented
recipe (notebook 02's), and ``Comparison.figure()`` is written out as
plotly's own HTML (plotly.js inline: no network) and opened in Debian's
Chromium, 1600 x 1000, through Playwright: a plain page, not JupyterLab,
since what is checked is what plotly.js draws from the figure, and a
page of its own draws it the same way in a fraction of the time. From
the SVG the page drew, each token's text and the fill of the cell under
it are read back: every token's text is there whole (whitespace drawn
visible), in reading order, at 13 px or more, and its colour against its
cell's reaches the WCAG contrast ratio of 4.5. The figure fills the
page's width and its title names the first divergence.

Needs ``scripts/setup_browser.sh`` (apt's chromium, pip's playwright);
skipped, visibly, without them.
"""

from __future__ import annotations


import pytest
from _helpers import wcag_contrast
from test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _browser_ready

from vlens.tokens import visible

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("ui")]

# every token cell (a layout shape) and every token text the page drew,
# with their boxes, computed colours and font sizes
_READ = """() => {
  const box = el => { const r = el.getBoundingClientRect();
                      return {x: r.left, y: r.top, w: r.width, h: r.height}; };
  const cells = Array.from(document.querySelectorAll('.shapelayer path'),
      el => ({...box(el), fill: getComputedStyle(el).fill,
              opacity: getComputedStyle(el).fillOpacity}));
  const texts = Array.from(document.querySelectorAll('.textpoint text'),
      el => ({...box(el), text: el.textContent, fill: getComputedStyle(el).fill,
              size: parseFloat(getComputedStyle(el).fontSize)}));
  const svg = document.querySelector('.main-svg');
  return {cells, texts, width: svg.getBoundingClientRect().width,
          title: document.querySelector('.gtitle').textContent};
}"""


def _under(text: dict, cells: list[dict]) -> dict:
    """The one cell whose box holds the centre of ``text``'s box."""
    cx, cy = text["x"] + text["w"] / 2, text["y"] + text["h"] / 2
    found = [c for c in cells if c["x"] <= cx <= c["x"] + c["w"] and c["y"] <= cy <= c["y"] + c["h"]]
    assert len(found) == 1, (text, found)
    return found[0]


def test_a_steered_comparison_reads_in_a_real_browser(toy_session):
    _browser_ready()
    from playwright.sync_api import sync_playwright

    from vlens.models.recipes import toyworld_recipe

    recipe = toyworld_recipe()
    cmp = toy_session.compare([recipe.example], steer=recipe.steer(toy_session),
                              max_new_tokens=recipe.max_new_tokens)
    base, steered = cmp.baseline[0].output_tokens, cmp.steered[0].output_tokens
    assert cmp.first_divergence[0] is not None  # the recipe changes the story
    expected = []  # reading order: a line's baseline row, then its steered row
    fig = cmp.figure()
    starts = [int(a.text.split()[-1]) - len(cmp.baseline[0].prompt_token_ids)
              for a in fig.layout.annotations if a.name == "line start"]
    n = max(len(base), len(steered))
    assert len(starts) >= 2  # 56 tokens do not fit one line: the run wraps
    for a, b in zip(starts, starts[1:] + [n]):
        expected += [visible(t) for t in base[a:b]] + [visible(t) for t in steered[a:b]]

    ARTIFACTS.mkdir(exist_ok=True)
    html = fig.to_html(include_plotlyjs=True, full_html=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_content(html)
            page.locator(".textpoint text").first.wait_for(timeout=30_000)
            drawn = page.evaluate(_READ)
            page.screenshot(path=str(ARTIFACTS / "legible-comparison.png"), full_page=True)
        finally:
            browser.close()

    # the token cells: the filled shapes (the divergence outline's fill is transparent)
    cells = [c for c in drawn["cells"] if c["w"] > 0 and c["fill"] not in ("none", "")
             and float(c["opacity"]) > 0]
    texts = sorted(drawn["texts"], key=lambda t: (round(t["y"]), t["x"]))
    assert len(texts) == len(expected) == len(cells)
    # whole and in order (a token's own spaces would be drawn as "·")
    assert [t["text"] for t in texts] == expected
    for t in texts:
        cell = _under(t, cells)
        assert float(cell["opacity"]) == 1.0
        assert wcag_contrast(t["fill"], cell["fill"]) >= 4.5, (t, cell)
        assert t["size"] >= 13, t
    assert drawn["width"] >= 1500  # the page's width, not a narrow fixed one
    at = cmp.figure().layout.title.text.split()[-1]
    assert drawn["title"].endswith(f"first divergence at position {at}"), drawn["title"]
