"""The site's own Sphinx extension: reference pages generated from the code, and the checks that
make a missing docstring or an undocumented public name fail the build.

Directives (each renders what the code says at build time, so the pages cannot drift):
  program-help PATH   the `--help` of a launcher (`--helpshort` for the absl ones: their own
                      flags, not absl's), run with the building Python from the repository root
  config-keys         every key of `configs.common.get_config()`, one table per block: its
                      default and its meaning, as declared beside the default
                      (`olora_jax.config_keys`)
  metric-notes        every metric's definition as results.json's `metric_notes` records it
  forgetting-example  its content an accuracy matrix (one row a line, fractions): the matrix
                      and, per earlier task, Forgetting as results.json computes it
                      (`olora_jax.metrics`) beside Mammoth's convention, computed at build
                      time (docs/_ext/forgetting_example.py)
  key-sources NAME    the method's keys, our defaults against their sources (the authors' code,
                      the Online-LoRA paper, ours), as declared beside the defaults; then the
                      numeric constants its module declares (`CONSTANTS`), each value against
                      its source
  method-card NAME    the card a method's page opens with (`olora_jax.methods.cards`): its
                      content is the one sentence of what the method does; options :row: (its
                      label in the demo table, when not its report name), :readings: and
                      :unvalidated: (what the page's reasoning establishes); the check, the demo
                      row and the defaults that differ from their sources come from the code and
                      the demo table

Docstrings are prose written for `help()`; a paragraph laid out by indentation (an aligned
table of names) is set as a literal block, so it reads the same on the site.

Checks (logged as warnings; `sphinx -W` turns them into a failed build):
  - a config key declared without a meaning (one line: the key and the file to declare it in);
  - an object autodoc documents (module, class, function, method) whose docstring is empty, or
    is the signature a dataclass writes for itself;
  - a name of `olora_jax.__all__` that no page documents.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
LOGGER = logging.getLogger(__name__)
CHECKED_KINDS = ("module", "class", "exception", "function", "method", "decorator")


def table(header: list[str], rows: list[list[str]], literal_columns: tuple[int, ...],
          widths: tuple[int, ...] | None = None) -> nodes.table:
  """A docutils table of plain-text cells; the `literal_columns` are set as inline code, the
  columns' relative `widths` kept when given."""
  group = nodes.tgroup(cols=len(header))
  group += [nodes.colspec(colwidth=w) for w in (widths or [1] * len(header))]

  def row(cells: list[str], header_row: bool) -> nodes.row:
    out = nodes.row()
    for i, text in enumerate(cells):
      inline = nodes.literal(text, text) if i in literal_columns and not header_row else (
          nodes.Text(text))
      out += nodes.entry("", nodes.paragraph("", "", inline))
    return out

  head, body = nodes.thead(), nodes.tbody()
  head += row(header, True)
  body += [row(cells, False) for cells in rows]
  group += [head, body]
  return nodes.table("", group, classes=["colwidths-given"] if widths else [])


class ProgramHelp(SphinxDirective):
  """`program-help launch/run.py`: the launcher's help text as a literal block."""

  required_arguments = 1

  def run(self) -> list[nodes.Node]:
    path = ROOT / self.arguments[0]
    uses_absl = "from absl import" in path.read_text()
    flag = "--helpshort" if uses_absl else "--help"
    done = subprocess.run([sys.executable, str(path), flag], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    ok_codes = (0, 1) if uses_absl else (0,)  # absl's help flags exit with 1 after printing
    if done.returncode not in ok_codes or not done.stdout.strip():
      LOGGER.warning("%s %s failed (exit %d): %s", self.arguments[0], flag, done.returncode,
                     done.stderr.strip()[-500:], location=self.get_location())
      return []
    text = done.stdout.rstrip().replace(str(ROOT) + "/", "")
    block = nodes.literal_block(text, text)
    block["language"] = "text"
    return [block]


def config_sections(config) -> list[tuple[str, str, list[tuple[str, object, str]]]]:
  """(block, about, [(dotted key, default, meaning)]) of every block of a config declared with
  `olora_jax.config_keys`: first the top-level keys ('' block), then each block in declared
  order, the packaged methods' blocks last (Table 1's order), each read as "method='NAME'"."""
  from olora_jax import config_keys, methods

  given = config_keys.meanings(config)
  names = {s.name: s.report_name for s in methods.specs()}
  groups: dict[str, list[tuple[str, object, str]]] = {}
  for key, default in config_keys.leaves(config):
    block = key.rpartition(".")[0].split(".")[0]
    groups.setdefault(block, []).append((key, default, given.get(key, "")))
  out = []
  for block, rows in groups.items():
    about = config_keys.about(config[block]) if block else config_keys.about(config)
    if block in names:
      about = f"read when method='{block}' ({names[block]}); docs/methods.md"
    out.append((block, about, rows))
  return sorted(out, key=lambda section: section[0] in names)  # the methods' blocks last


class ConfigKeys(SphinxDirective):
  """`config-keys`: every key of the shared defaults, one table per block: key, default, meaning.
  A key declared without a meaning is a warning (an error under `sphinx -W`) naming the key and
  the file to declare its meaning in."""

  def run(self) -> list[nodes.Node]:
    from configs import common
    from olora_jax import config_keys, methods

    # The page is rebuilt when a file that declares keys changes (an incremental build).
    for module in (common, config_keys, *(inspect.getmodule(s.config) for s in methods.specs()
                                          if s.config is not None)):
      self.env.note_dependency(inspect.getsourcefile(module))
    config = common.get_config()
    for line in common.unexplained_keys(config):
      LOGGER.warning(line, location=self.get_location(), type="olora", subtype="config")
    out = []
    for block, about, rows in config_sections(config):
      title = block or "top level"
      section = nodes.section(ids=[nodes.make_id(f"keys-{title}")])
      section += nodes.title("", "", nodes.literal(title, title) if block else nodes.Text(title))
      if about:
        section += nodes.paragraph(about, about[0].upper() + about[1:] + ".")
      section += table(["key", "default", "meaning"],
                       [[key, repr(default), meaning] for key, default, meaning in rows],
                       literal_columns=(0, 1), widths=(3, 2, 7))
      out.append(section)
    return out


class MethodCard(SphinxDirective):
  """`method-card NAME`: the card a method's page opens with (module docstring)."""

  required_arguments = 1
  has_content = True
  option_spec = {"row": directives.unchanged, "readings": directives.unchanged,
                 "unvalidated": directives.unchanged}

  def run(self) -> list[nodes.Node]:
    from olora_jax import methods
    from olora_jax.methods import cards

    spec = methods.resolve(self.arguments[0])
    self.env.note_dependency(inspect.getsourcefile(spec.build))
    self.env.note_dependency(str(ROOT / cards.DEMO_TABLE))
    rows = cards.demo_rows((ROOT / cards.DEMO_TABLE).read_text())
    label = self.options.get("row", spec.report_name)
    if label not in rows:
      LOGGER.warning(f"{spec.name}: no row {label!r} in {cards.DEMO_TABLE} (give its label as"
                     " :row:)", location=self.get_location(), type="olora", subtype="card")
    try:
      lines = cards.card(spec, "\n".join(self.content), rows.get(label),
                         self.options.get("readings", ""), self.options.get("unvalidated", ""))
    except ValueError as e:
      LOGGER.warning(str(e), location=self.get_location(), type="olora", subtype="card")
      return []
    text = "\n".join(["| At a glance | |", "|---|---|",
                      *(f"| **{name}** | {value} |" for name, value in lines)])
    return self.parse_text_to_nodes(text)


class KeySources(SphinxDirective):
  """`key-sources NAME`: method NAME's keys, ours against their source (the authors' code, the
  Online-LoRA paper's appendix, or ours), from the declarations beside the defaults, then the
  numeric constants of the method's module (its `CONSTANTS`) against theirs. A key or constant
  without a source, or one that differs from its source without a reason naming its value, is a
  warning."""

  required_arguments = 1

  def run(self) -> list[nodes.Node]:
    from olora_jax import config_keys, methods

    spec = methods.resolve(self.arguments[0])
    module = inspect.getmodule(spec.build)
    self.env.note_dependency(inspect.getsourcefile(spec.config))
    self.env.note_dependency(inspect.getsourcefile(module))
    problems = [f"{spec.name}.{line}" for line in config_keys.unsourced(spec.config())]
    for line in problems + config_keys.unsourced_constants(module):
      LOGGER.warning(line, location=self.get_location(), type="olora", subtype="config")
    out = [table(["key", "ours", "meaning", "where the default comes from"],
                 config_keys.source_rows(spec.config()), literal_columns=(0, 1),
                 widths=(3, 2, 6, 6))]
    constants = config_keys.constant_rows(module)
    if constants:
      out += [nodes.paragraph("", f"Constants of {module.__name__} (not keys: a change is an"
                                  " edit of the code):"),
              table(["constant", "value", "meaning", "where the value comes from"], constants,
                    literal_columns=(0, 1), widths=(3, 2, 6, 6))]
    return out


class MetricNotes(SphinxDirective):
  """`metric-notes`: results.json's `metric_notes`, one row per metric."""

  def run(self) -> list[nodes.Node]:
    from olora_jax import metrics

    rows = [[name, text] for name, text in metrics.DEFINITIONS.items()]
    rows.append(["forgetting_per_domain", metrics.FORGETTING_PER_DOMAIN + " (runs evaluated by"
                 " domain only)"])
    rows += [[name, text + " (runs with Task-IL only: docs/metrics.md)"]
             for name, text in metrics.DEFINITIONS_TASK_IL.items()]
    return [table(["field", "definition (olora_jax/metrics.py)"], rows, literal_columns=(0,))]


class ForgettingExample(SphinxDirective):
  """`forgetting-example`: the worked matrix of docs/metrics.md and both Forgetting conventions
  computed from it (`forgetting_example`); a malformed matrix is a warning naming its row."""

  has_content = True

  def run(self) -> list[nodes.Node]:
    import forgetting_example as example

    from olora_jax import metrics

    self.env.note_dependency(inspect.getsourcefile(metrics))
    self.env.note_dependency(inspect.getsourcefile(example))
    try:
      acc = example.parse_matrix(list(self.content))
    except ValueError as e:
      LOGGER.warning(f"forgetting-example: {e}", location=self.get_location(), type="olora",
                     subtype="metrics")
      return []
    return [table(*example.matrix_rows(acc), literal_columns=()),
            table(*example.forgetting_rows(acc), literal_columns=())]


def is_auto_docstring(obj) -> bool:
  """Whether `obj.__doc__` is the `Name(field, ...)` line a dataclass writes when it has none."""
  doc = getattr(obj, "__doc__", None) or ""
  return inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")


def key_of(obj) -> str:
  """A name for an object that survives pickling of Sphinx's environment: module.qualname."""
  if inspect.ismodule(obj):
    return obj.__name__
  return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def is_bullet_list(paragraph: list[str]) -> bool:
  """Whether a paragraph is a plain bullet list ("- item", continuations under its text)."""
  first = indent(paragraph[0])
  return all(line.lstrip().startswith("- ") and indent(line) == first or indent(line) == first + 2
             for line in paragraph)


def preformat_aligned(lines: list[str]) -> None:
  """Sets each docstring paragraph that relies on indentation (an aligned table of names and
  descriptions, a signature list with hanging lines) as a literal block, in place, so it reads
  on the site as it reads under `help()`; prose paragraphs and bullet lists stay reST."""
  out, paragraph = [], []

  def flush() -> None:
    aligned = len(paragraph) > 1 and any(indent(line) > indent(paragraph[0])
                                         for line in paragraph[1:])
    if aligned and not is_bullet_list(paragraph):
      out.extend(["::", ""] + ["  " + line for line in paragraph] + [""])
    else:
      out.extend(paragraph)
    paragraph.clear()

  for line in lines:
    if line.strip():
      paragraph.append(line)
    else:
      flush()
      out.append(line)
  flush()
  lines[:] = out


def check_docstring(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
  preformat_aligned(lines)
  documented = app.env.__dict__.setdefault("olora_documented", {})
  documented.setdefault(app.env.docname, set()).add(key_of(obj))
  if what not in CHECKED_KINDS or name.split(".")[-1].startswith("_"):
    return
  if not any(line.strip() for line in lines) or is_auto_docstring(obj):
    LOGGER.warning("%s %s has no docstring: say what it is and what it returns", what, name,
                   type="olora", subtype="docstring")


def check_public_names(app: Sphinx, env) -> None:
  import olora_jax

  documented = set().union(*getattr(env, "olora_documented", {}).values())
  for name in olora_jax.__all__:
    if key_of(getattr(olora_jax, name)) not in documented:
      LOGGER.warning("olora_jax.%s is in olora_jax.__all__ but no reference page documents it",
                     name, type="olora", subtype="undocumented")


def purge_documented(app: Sphinx, env, docname: str) -> None:
  getattr(env, "olora_documented", {}).pop(docname, None)


def merge_documented(app: Sphinx, env, docnames, other) -> None:
  env.__dict__.setdefault("olora_documented", {}).update(getattr(other, "olora_documented", {}))


def setup(app: Sphinx) -> dict:
  app.add_directive("program-help", ProgramHelp)
  app.add_directive("config-keys", ConfigKeys)
  app.add_directive("metric-notes", MetricNotes)
  app.add_directive("forgetting-example", ForgettingExample)
  app.add_directive("method-card", MethodCard)
  app.add_directive("key-sources", KeySources)
  app.connect("autodoc-process-docstring", check_docstring)
  app.connect("env-purge-doc", purge_documented)
  app.connect("env-merge-info", merge_documented)
  app.connect("env-check-consistency", check_public_names)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
