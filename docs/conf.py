"""Sphinx configuration of the documentation site. Build it (warnings are errors) with

    .venv/bin/pip install -c constraints.txt -c constraints-docs.txt -e ".[docs]"
    .venv/bin/python -m sphinx -W --keep-going -b html docs build/docs

docs/about-these-docs.md says why Sphinx, and how the pages are laid out.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

project = "olora-jax"
author = "the olora-jax authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "olora_docs"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
# Headings get GitHub's anchors, so `page.md#a-heading` links work on the site and on GitHub alike.
myst_heading_anchors = 4
# Docstrings are prose with `code` in single backticks, as on the Markdown pages (no Google or
# NumPy sections, so no napoleon); docs/_ext/olora_docs.py keeps their aligned tables as written.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "furo"
html_title = "olora-jax"
html_show_sourcelink = False
# "short" writes `~typing.Any` into signatures whose annotations nest lists (`Callable[[..], ..]`),
# where the tilde is shown as is; full names read plainly.
autodoc_typehints_format = "fully-qualified"
