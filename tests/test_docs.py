"""Every Python block of the README and docs/ runs, or is checked against the file it shows.

A block whose first line is `# path/to/file.py` (a file of the repository) is an excerpt of it:
its lines must stand in that file, in order (indentation aside), so the documentation cannot
drift from the code. Any other block is a program: it runs from the repository root.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # subfolders: the site


def python_blocks() -> list[tuple[str, str]]:
  """(where, code) of every ```python block of the documents."""
  found = []
  for path in DOCUMENTS:
    text = path.read_text()
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
      line = text[: match.start()].count("\n") + 1
      found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
  return found


BLOCKS = python_blocks()


def excerpt_of(code: str) -> Path | None:
  first = code.splitlines()[0].strip()
  if first.startswith("# ") and first.endswith(".py") and (ROOT / first[2:]).is_file():
    return ROOT / first[2:]
  return None


def missing_lines(excerpt: list[str], source: list[str]) -> list[str]:
  """The excerpt's lines that do not stand in `source` in order (stripped; blanks skipped)."""
  wanted = [line.strip() for line in excerpt if line.strip()]
  have = iter(line.strip() for line in source)
  return [line for line in wanted if not any(line == h for h in have)]


def test_the_documents_have_python_blocks():
  assert len(BLOCKS) >= 5
  assert sum(excerpt_of(code) is None for _, code in BLOCKS) >= 1  # some run


def test_missing_lines_finds_a_drifted_excerpt():
  source = ["def f(x):", "  y = x + 1", "  return y"]
  assert missing_lines(["def f(x):", "", "  return y"], source) == []
  assert missing_lines(["  return y", "def f(x):"], source) == ["def f(x):"]  # order counts
  assert missing_lines(["  y = x + 2"], source) == ["y = x + 2"]


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_python_block(where, code):
  source = excerpt_of(code)
  if source is not None:
    lines = code.splitlines()[1:]
    missing = missing_lines(lines, source.read_text().splitlines())
    assert not missing, f"{where}: not in {source.relative_to(ROOT)} (in this order): {missing}"
    return
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, f"{where} fails:\n{done.stderr[-3000:]}"


# One page per method (docs/methods/<method>.md), and the numbers the pages share.

CARDS = ROOT / "docs" / "methods"
TUTORIAL = ROOT / "docs" / "tutorials" / "first-comparison.md"
PERFORMANCE = ROOT / "docs" / "performance.md"


def section(text: str, heading: str) -> str:
  """The text under the first heading that starts with `heading`, to the next heading of any
  level ('' if none)."""
  match = re.search(rf"^#+ {re.escape(heading)}.*?\n(.*?)(?=^#|\Z)", text, re.S | re.M)
  return match.group(1) if match else ""


def table_rows(text: str) -> list[list[str]]:
  """The cells of every row of the Markdown tables in `text`, header and separator left out."""
  rows = [line for line in text.splitlines() if line.startswith("|")]
  cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in rows]
  return [c for c in cells if c and not set(c[0]) <= {"-"}][1:] if cells else []


def demo_table_rows() -> list[str]:
  """The rows of the tutorial's table of every method on the demos, as written."""
  text = section(TUTORIAL.read_text(), "Every baseline on the same streams")
  return [line for line in text.splitlines() if line.startswith("| ") and "±" in line]


def parse_default(text: str):
  import ast
  text = text.strip("`")
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def test_every_method_has_a_page_in_the_index_and_the_toctree():
  from olora_jax import methods
  index = (ROOT / "docs" / "methods.md").read_text()
  for spec in methods.specs():
    assert (CARDS / f"{spec.name}.md").is_file(), f"no docs/methods/{spec.name}.md"
    assert f"](methods/{spec.name}.md)" in index, f"docs/methods.md does not link {spec.name}"
    assert f"\nmethods/{spec.name}\n" in index, f"{spec.name} is not in docs/methods.md's toctree"


def test_each_method_page_renders_every_key_of_its_block_with_its_default_and_source():
  """The Keys section of a method's page is the `key-sources` directive, whose rows (key, default,
  meaning, source) come from the block's declarations, so they cannot drift from the code."""
  from olora_jax import config_keys, methods
  for spec in methods.specs():
    if spec.config is None:  # Online-LoRA: the `learner` block, in the config reference
      continue
    page = (CARDS / f"{spec.name}.md").read_text()
    assert "```{key-sources} " + spec.name in section(page, f"Keys (`config.{spec.name}`)")
    rows = config_keys.source_rows(spec.config())
    block = spec.config().to_dict()
    assert sorted(row[0] for row in rows) == sorted(block), spec.name
    for key, default, meaning, source in rows:
      assert default == config_keys.shown(block[key]) and meaning and source != "none declared", (
          spec.name, key)


def test_each_method_page_shows_its_rows_of_the_demo_table_and_its_cost():
  from olora_jax import methods
  demo = demo_table_rows()
  header = next(line for line in section(TUTORIAL.read_text(), "Every baseline").splitlines()
                if line.startswith("| method |"))
  costs = {row[0]: row for row in table_rows(section(PERFORMANCE.read_text(), "What fits"))}
  for spec in methods.specs():
    page = (CARDS / f"{spec.name}.md").read_text()
    shown = [line for line in section(page, "On the demos").splitlines()
             if line.startswith("| ") and "±" in line]
    assert shown, f"docs/methods/{spec.name}.md shows no demo row"
    for line in shown:
      assert line in demo, f"docs/methods/{spec.name}.md: {line!r} is not a row of {TUTORIAL.name}"
    assert header in page.splitlines(), f"docs/methods/{spec.name}.md: not the tutorial's columns"
    name = next(n for n in costs if spec.report_name in (n, f"{n} (DER++)"))
    memory, step, passes = costs[name][1], costs[name][2].rstrip(" *"), costs[name][3]
    cost = " ".join(section(page, "Cost").split())
    if memory == "not measured":  # the table's footnote says why; the page must say so too
      assert "not measured" in cost, f"docs/methods/{spec.name}.md's cost hides that"
      continue
    for said in (f"{memory} GiB", f"{step} s a step", f"{passes} passes a step"):
      assert said in cost, f"docs/methods/{spec.name}.md's cost lacks {said!r} ({PERFORMANCE.name})"


# What the pages say twice must say the same.

def bash_lines(path: Path) -> list[str]:
  text = path.read_text()
  blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
  return [line for block in blocks for line in block.splitlines()]


@pytest.mark.parametrize("page", ["README.md", "docs/tutorials/quickstart.md"])
def test_the_setup_creates_the_venv_before_a_command_uses_it(page):
  lines = bash_lines(ROOT / page)
  create = next(i for i, line in enumerate(lines) if "-m venv .venv" in line)
  use = next(i for i, line in enumerate(lines) if ".venv/bin/" in line)
  assert create <= use, f"{page}: `{lines[use]}` comes before the command that creates .venv"


def test_the_readme_runs_the_tests_as_ci_does():
  """The README's and the quickstart's test command is the one .ci/run runs (CI adds only its own
  flags after it): the time the pages state is the time of that command."""
  run = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if "-m pytest" in line)
  ci = run.split("-m pytest", 1)[1].split()
  for page in ("README.md", "docs/tutorials/quickstart.md"):
    (line,) = [x for x in bash_lines(ROOT / page) if "-m pytest" in x]
    said = line.split("-m pytest", 1)[1].split()
    assert ci[:len(said)] == said, f"{page}: `{line}` is not .ci/run's `{run.strip()}`"


def test_the_pages_state_one_test_count_and_one_test_time():
  said: dict[str, set[str]] = {"count": set(), "minutes": set(), "ci": set()}
  patterns = {"count": r"(\d[\d,]*) tests\b", "minutes": r"about (\d+) minutes on a 2-core CPU",
              "ci": r"\((\d+) s in CI"}
  for path in DOCUMENTS:
    text = " ".join(path.read_text().split())
    for what, pattern in patterns.items():
      said[what] |= set(re.findall(pattern, text))
  assert len(said["count"]) == 1 and len(said["minutes"]) == 1, said
  assert len(said["ci"]) <= 1, said


def test_the_gpu_install_is_the_one_of_performance():
  gpu = [line for line in bash_lines(ROOT / "docs" / "how-to" / "gpu.md") if "pip install" in line]
  assert gpu, "docs/how-to/gpu.md shows no install command"
  performance = bash_lines(PERFORMANCE)
  for line in gpu:
    assert line in performance, f"docs/how-to/gpu.md: {line!r} is not docs/performance.md's"


def test_the_gpu_cost_rows_are_those_of_performance():
  gpu = section((ROOT / "docs" / "how-to" / "gpu.md").read_text(), "What it costs")
  rows = [line for line in gpu.splitlines() if line.startswith("| ") and "---" not in line][1:]
  assert rows, "docs/how-to/gpu.md has no cost table"
  performance = PERFORMANCE.read_text().splitlines()
  for row in rows:
    assert row in performance, f"docs/how-to/gpu.md: {row[:60]!r}... is not a row of performance.md"
