"""Looks at the built documentation site in headless Chromium, as a reader would.

    .venv/bin/python scripts/docs_screenshots.py build/docs [--out build/docs-screenshots]

For the quickstart, a how-to guide and an API page: a screenshot (a PNG of the window's size that
is not one flat colour), the rendered DOM (`--dump-dom`: the page's title and first heading are
there, and every link of the navigation sidebar resolves to a built page), and the search: the
index (`searchindex.js`) lists every page, and the search page, run with its JavaScript, finds a
page by a word of its title. Exits 1 naming each failure; without Chromium (Debian's `chromium`
package) it says so in one line and exits 0, so a machine without a browser can still build.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urldefrag

from PIL import Image

WINDOW = (1280, 900)
# (page, words its <title> and first heading must hold)
PAGES = (
    ("tutorials/quickstart.html", "Install and run the demo"),
    ("how-to/gpu.html", "Run a paper setting on a GPU"),
    ("reference/api/methods.html", "Methods"),
)
SEARCH = ("reservoir", "reference/api/methods")  # a query, and a page it must find
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")


def browser() -> str | None:
  """The path of a Chromium binary on PATH, or None."""
  for name in ("chromium", "chromium-browser"):
    if found := shutil.which(name):
      return found
  return None


def chromium(binary: str, *args: str) -> str:
  """Runs headless Chromium with a fresh profile; returns what it printed on stdout."""
  with tempfile.TemporaryDirectory() as profile:
    done = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)
  if done.returncode != 0:
    raise RuntimeError(f"chromium {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
  return done.stdout


def check_png(path: Path) -> list[str]:
  """Failures of a screenshot: missing, not the window's size, or one flat colour."""
  if not path.is_file():
    return [f"{path.name}: no screenshot written"]
  with Image.open(path) as image:
    size, colours = image.size, image.convert("RGB").getcolors(maxcolors=1 << 16)
  failures = []
  if size != WINDOW:
    failures.append(f"{path.name}: {size[0]}x{size[1]}, expected {WINDOW[0]}x{WINDOW[1]}")
  if colours is not None and len(colours) < 16:
    failures.append(f"{path.name}: {len(colours)} colours, the page looks blank")
  return failures


def nav_links(dom: str) -> list[str]:
  """The hrefs of the navigation sidebar (Furo's `sidebar-tree`) of a dumped DOM."""
  match = re.search(r'<div class="sidebar-tree">(.*?)</div>', dom, re.S)
  return re.findall(r'href="([^"]+)"', match.group(1)) if match else []


def check_page(binary: str, site: Path, page: str, title: str, out: Path) -> list[str]:
  """Screenshot, title, heading and navigation of one built page."""
  url = (site / page).resolve().as_uri()
  png = out / (page.replace("/", "_").removesuffix(".html") + ".png")
  chromium(binary, f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={png}", url)
  failures = check_png(png)
  dom = chromium(binary, "--dump-dom", url)
  page_title = re.search(r"<title>(.*?)</title>", dom, re.S)
  heading = re.search(r"<h1>(.*?)</h1>", dom, re.S)
  if not page_title or title not in page_title.group(1):
    failures.append(f"{page}: <title> lacks {title!r}")
  if not heading or title not in re.sub(r"<[^>]+>", "", heading.group(1)):
    failures.append(f"{page}: the first heading lacks {title!r}")
  for raw in (".. py:", ".. auto", "{eval-rst}", "{toctree}"):
    if raw in dom:
      failures.append(f"{page}: shows the unrendered directive text {raw!r}")
  if page.startswith("reference/api/") and 'class="sig ' not in dom:
    failures.append(f"{page}: no rendered signature (autodoc's `sig` element)")
  links = nav_links(dom)
  if len(links) < 10:
    failures.append(f"{page}: {len(links)} navigation links, expected the whole site's")
  for href in links:
    target = urldefrag(unquote(href))[0]
    if target.startswith(("http:", "https:")):
      continue
    if not (site / page).parent.joinpath(target or Path(page).name).resolve().is_file():
      failures.append(f"{page}: navigation link {href} leads nowhere")
  print(f"{page}: {png} ({len(links)} navigation links)")
  return failures


def check_search(binary: str, site: Path) -> list[str]:
  """The search index lists every built page, and the search page finds one."""
  index = site / "searchindex.js"
  if not index.is_file():
    return ["searchindex.js: missing"]
  data = json.loads(re.search(r"Search\.setIndex\((.*)\)", index.read_text(), re.S).group(1))
  built = {str(p.relative_to(site).with_suffix("")) for p in site.rglob("*.html")
           if p.parts[len(site.parts)] not in ("_static", "_sources")
           and p.stem not in ("search", "genindex", "py-modindex")}
  failures = [f"searchindex.js: {name} is not indexed" for name in sorted(built - set(
      data["docnames"]))]
  query, expected = SEARCH
  url = (site / "search.html").resolve().as_uri() + f"?q={query}"
  dom = chromium(binary, "--virtual-time-budget=10000", "--dump-dom", url)
  results = re.search(r'<div id="search-results">(.*?)</div>', dom, re.S)  # filled by the JS
  if not results or f'href="{expected}.html' not in results.group(1):
    failures.append(f"search.html?q={query}: no search result links to {expected}.html")
  print(f"search: {len(data['docnames'])} pages indexed; '{query}' finds {expected}.html: "
        f"{not failures}")
  return failures


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("site", type=Path, help="the built site (sphinx -b html docs SITE)")
  parser.add_argument("--out", type=Path, default=None,
                      help="where the PNGs go (default: SITE/../docs-screenshots)")
  args = parser.parse_args()
  binary = browser()
  if binary is None:
    print("docs_screenshots: no chromium on PATH (apt-get install chromium); skipped")
    return 0
  if not (args.site / "index.html").is_file():
    print(f"docs_screenshots: {args.site} holds no built site (index.html)", file=sys.stderr)
    return 1
  out = args.out or args.site.parent / "docs-screenshots"
  out.mkdir(parents=True, exist_ok=True)
  failures = []
  for page, title in PAGES:
    failures += check_page(binary, args.site, page, title, out)
  failures += check_search(binary, args.site)
  for failure in failures:
    print(f"docs_screenshots: {failure}", file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
