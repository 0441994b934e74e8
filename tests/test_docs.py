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
