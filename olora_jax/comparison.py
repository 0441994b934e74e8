"""The demo comparison as committed data: every registered method on the embedded demo's three
streams, one summary per run, kept in the repository (docs/data/demo_comparison/) so that the
docs' demo numbers and comparison sentences are computed from runs, not typed.

The streams (`STREAMS`) are the disjoint demo (configs/demo.py), the same stream with its classes
in reversed order (configs/demo_reversed.py: a held-out order, since every default was looked at
on the given one) and the Si-Blurry demo (configs/demo_si_blurry.py). `scripts/demo_comparison.py`
runs them as one `launch/sweep.py` grid (resumable: it may run in parts) and `collect`s the
finished runs: `results_rows` reads them, as the report does, and `summary` keeps what the docs
quote (A_final, Forgetting, A_auc, the Task-IL accuracy, passes per step, plateaus, the accuracy
matrix) with the commit of the code that made them (scripts/demo_comparison.py: this checkout's
HEAD, refused while the code a run executes has uncommitted changes). One JSON line per run,
sorted, one file per stream: small, and a rerun's diff shows which runs moved.

`stat` aggregates a method's runs on a stream as the report's tables do (`reporting.metric_stat`:
mean ± sample standard deviation over seeds, in %), and `Claim` is a comparison sentence of the
docs declared as data: two methods, the metrics, the relation and the streams it speaks of; it
holds only where it holds on every one of those streams over the committed seeds
(tests/test_comparison_claims.py computes each).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from olora_jax import reporting

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = "docs/data/demo_comparison"  # relative to the repository


@dataclasses.dataclass(frozen=True)
class Stream:
  """One stream of the comparison: its name (the sweep's setting directory, the data file's
  stem), its config file and the seeds the comparison runs on it."""

  name: str
  config: str
  seeds: tuple[int, ...]


STREAMS = (
    Stream("demo", "configs/demo.py", tuple(range(10))),
    Stream("demo_reversed", "configs/demo_reversed.py", tuple(range(5))),
    Stream("demo_si_blurry", "configs/demo_si_blurry.py", tuple(range(5))),
)
STREAM_NAMES = tuple(s.name for s in STREAMS)

# What a run's summary keeps of its results.json (a metric a run does not have is null).
METRICS = ("A_final", "forgetting", "A_auc", "A_final_task_il")
KEPT = (*METRICS, "n_plateaus", "plateau_steps", "acc_matrix")


def stream_of(workdir: str) -> str:
  """The stream of a run of the comparison's sweep: its setting directory,
  ROOT/SETTING/METHOD/seedN (launch/sweep.py's layout)."""
  name = Path(workdir).parents[1].name
  if name not in STREAM_NAMES:
    configs = ", ".join(s.config for s in STREAMS)
    raise ValueError(f"{workdir}: its setting directory {name!r} is none of the comparison's"
                     f" streams ({', '.join(STREAM_NAMES)}); collect a sweep of {configs}")
  return name


def summary(row: dict, code: str) -> dict:
  """One finished run's summary: a `reporting.results_rows` row cut to what the docs quote."""
  out = {"stream": stream_of(row["workdir"]), "method": row["method_key"],
         "label": row["method"], "seed": row["seed"]}
  out.update({k: row.get(k) for k in KEPT})
  out["passes_per_step"] = row.get("compute/passes_per_step")
  out["check"] = row.get("check/status")
  out["stream_sha256"] = row.get("stream_manifest_sha256")
  out["code"] = code
  return out


def _key(cell: dict) -> tuple:
  return (cell["stream"], cell["method"], cell["seed"])


def data_path(stream: str, data_dir: str | os.PathLike | None = None) -> Path:
  return Path(data_dir or ROOT / DATA_DIR) / f"{stream}.jsonl"


def load(data_dir: str | os.PathLike | None = None) -> list[dict]:
  """Every committed run summary (those of the streams whose file exists)."""
  cells = []
  for stream in STREAM_NAMES:
    path = data_path(stream, data_dir)
    if path.is_file():
      cells += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return cells


def write(cells: Iterable[dict], data_dir: str | os.PathLike | None = None) -> list[Path]:
  """Writes `cells` as the streams' files, one sorted JSON line per run; the paths written."""
  by_stream: dict[str, list[dict]] = {}
  for cell in cells:
    by_stream.setdefault(cell["stream"], []).append(cell)
  paths = []
  for stream, group in by_stream.items():
    path = data_path(stream, data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(c, sort_keys=True) for c in sorted(group, key=_key)]
    path.write_text("\n".join(lines) + "\n")
    paths.append(path)
  return paths


def collect(sweep_roots: Sequence[str | os.PathLike], code: str,
            data_dir: str | os.PathLike | None = None) -> list[Path]:
  """The finished runs of the comparison's sweep roots, summarised into the data: a run of the
  roots replaces the committed summary of the same (stream, method, seed), the others stay, so
  a sweep run in parts fills the data in parts."""
  rows = reporting.results_rows([os.fspath(r) for r in sweep_roots], unfinished=False)
  cells = {_key(c): c for c in load(data_dir)}
  for row in rows:
    cell = summary(row, code)
    cells[_key(cell)] = cell
  return write(cells.values(), data_dir)


def runs_of(cells: Sequence[dict], stream: str, method: str) -> list[dict]:
  """The summaries of `method` on `stream`, by seed."""
  return sorted((c for c in cells if c["stream"] == stream and c["method"] == method),
                key=lambda c: c["seed"])


def stat(cells: Sequence[dict], stream: str, method: str, metric: str,
         seeds: Sequence[int] | None = None) -> dict:
  """`method`'s `metric` on `stream` over its committed seeds (those of `seeds` only, where
  given), as the report aggregates it (`reporting.metric_stat`: in %, mean, sample std, n), with
  "seeds" the seeds it is over (a run whose metric is null is left out)."""
  runs = [c for c in runs_of(cells, stream, method) if seeds is None or c["seed"] in seeds]
  scale = 1 if metric in reporting.NOT_PERCENT else 100
  out = reporting.metric_stat([scale * c[metric] for c in runs if c.get(metric) is not None])
  out["seeds"] = [c["seed"] for c in runs if c.get(metric) is not None]
  return out


# How a claim's first method stands to its second on a metric (means and seeds' spreads, in the
# sense of the docs' tables: the spread is the sum of the two sample standard deviations).
RELATIONS = ("above", "below", "within")
MIN_SEEDS = 5  # the fewest seeds a claim is computed over on each of its streams


def relation_holds(a: dict, b: dict, relation: str) -> bool:
  """`above`/`below`: a's mean lies on that side of b's by more than the sum of the two standard
  deviations; `within`: the means differ by no more than that sum (neither ranks above)."""
  spread = a["std"] + b["std"]
  return {"above": a["mean"] - b["mean"] > spread, "below": b["mean"] - a["mean"] > spread,
          "within": abs(a["mean"] - b["mean"]) <= spread}[relation]


@dataclasses.dataclass(frozen=True)
class Claim:
  """A comparison sentence of the docs as data: `page` says `words`, which state that `method`'s
  `metrics` stand in `relation` to `other`'s on every stream of `streams`."""

  page: str
  words: str
  method: str
  other: str
  metrics: tuple[str, ...]
  relation: str
  streams: tuple[str, ...]

  def __post_init__(self):
    if self.relation not in RELATIONS:
      raise ValueError(f"claim {self.words!r}: relation {self.relation!r} is none of {RELATIONS}")
    unknown = set(self.streams) - set(STREAM_NAMES)
    if unknown:
      raise ValueError(f"claim {self.words!r}: unknown streams {sorted(unknown)}")

  def failures(self, cells: Sequence[dict]) -> list[str]:
    """Where the claim does not hold on the data: one line per (stream, metric), empty if it
    holds on every one it speaks of. Each is compared over the seeds both methods have
    committed on that stream, at least MIN_SEEDS of them (fewer fail)."""
    out = []
    for name in self.streams:
      for metric in self.metrics:
        seeds = sorted(set(stat(cells, name, self.method, metric)["seeds"])
                       & set(stat(cells, name, self.other, metric)["seeds"]))
        if len(seeds) < MIN_SEEDS:
          out.append(f"{name} {metric}: {len(seeds)} seeds committed for both {self.method} and"
                     f" {self.other}, fewer than {MIN_SEEDS}")
          continue
        a, b = (stat(cells, name, m, metric, seeds) for m in (self.method, self.other))
        if not relation_holds(a, b, self.relation):
          out.append(f"{name} {metric} over seeds {seeds}: {self.method}"
                     f" {reporting.stat_text(a)} is not {self.relation} {self.other}"
                     f" {reporting.stat_text(b)}")
    return out


TUTORIAL = "docs/tutorials/first-comparison.md"
GIVEN_ORDERS = ("demo", "demo_reversed")  # a ranking on the disjoint demo holds in both orders
ALL_STREAMS = STREAM_NAMES

# Every comparison sentence of the docs about the demo's methods (tests/test_comparison_claims.py).
CLAIMS = (
    Claim("docs/methods/scr.md", "its Forgetting is below ER's by more than the seeds' spread",
          "scr", "er", ("forgetting",), "below", GIVEN_ORDERS),
    Claim("docs/methods/scr.md", "its A_final on both demos and its Si-Blurry A_auc are within"
          " the spread of ER's", "scr", "er", ("A_final",), "within", ALL_STREAMS),
    Claim("docs/methods/scr.md", "its A_final on both demos and its Si-Blurry A_auc are within"
          " the spread of ER's", "scr", "er", ("A_auc",), "within", ("demo_si_blurry",)),
    Claim(TUTORIAL, "ends above fine-tuning's demo A_final by more than the seeds' spread",
          "lwf", "finetune", ("A_final",), "above", GIVEN_ORDERS),
    Claim("docs/methods/lwf.md", "It stays below ER's A_final by more than the seeds' spread",
          "lwf", "er", ("A_final",), "below", GIVEN_ORDERS),
    # "Online-LoRA loses on the demo ... to ER, MIR, ...; it beats fine-tuning, ...": the pairs
    # whose runs are committed (the others join as the sweep fills them).
    *(Claim(TUTORIAL, "Online-LoRA loses on the demo", "online_lora", other, ("A_final",),
            "below", GIVEN_ORDERS)
      for other in ("er", "mir", "gdumb", "pcr", "der_pp", "lode", "ema_der_pp", "ema_rar",
                    "simplecil", "dualprompt", "coda_prompt", "mvp")),
    *(Claim(TUTORIAL, "It beats fine-tuning", "online_lora", other, ("A_final",), "above",
            GIVEN_ORDERS) for other in ("finetune", "ewc_pp", "agem", "l2p", "sd_lora")),
    Claim("docs/methods/er_ace.md", "The first part holds on the demo", "er_ace", "er",
          ("forgetting",), "below", GIVEN_ORDERS),
    Claim("docs/methods/er_ace.md", "so we do not rank the two by A_final", "er_ace", "er",
          ("A_final",), "within", GIVEN_ORDERS),
    Claim("docs/methods/er_ace.md", "is within the spread of ER's 55.59", "er_ace", "er",
          ("A_final",), "within", ("demo_si_blurry",)),
    Claim(TUTORIAL, "ER-ACE forgets far less than ER at ER's memory", "er_ace", "er",
          ("forgetting",), "below", GIVEN_ORDERS),
    Claim(TUTORIAL, "its A_final is within the seeds' spread of ER's on both", "er_ace", "er",
          ("A_final",), "within", GIVEN_ORDERS),
    Claim("docs/methods/onpro.md", "its A_final is within the seeds' spread of ER's on the"
          " disjoint and the Si-Blurry demo", "onpro", "er", ("A_final",), "within",
          ("demo", "demo_si_blurry")),
    Claim("docs/methods/onpro.md", "and below ER's by more than that spread on the disjoint demo"
          " in reversed class order", "onpro", "er", ("A_final",), "below", ("demo_reversed",)),
    Claim(TUTORIAL, "ends within the seeds' spread of ER's demo A_final in the given class order",
          "onpro", "er", ("A_final",), "within", ("demo",)),
    Claim(TUTORIAL, "and below it by more than that spread in the reversed one", "onpro", "er",
          ("A_final",), "below", ("demo_reversed",)),
)


def seeds_text(seeds: Sequence[int]) -> str:
  """Seeds as the tables name them: "0-4" for a run of consecutive seeds, else comma separated."""
  seeds = sorted(seeds)
  if not seeds:
    return "-"
  if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
    return f"{seeds[0]}-{seeds[-1]}"
  return ",".join(map(str, seeds))


# The tables of the docs rendered from the data, by name: (header cells, [(stream, metric)]). A
# method is a row once each of the streams has at least MIN_SEEDS of its runs committed.
TABLES = {
    "streams": (("method", "seeds: demo / reversed / Si-Blurry", "demo A_final %",
                 "Forgetting %", "reversed A_final %", "Forgetting %", "Si-Blurry A_auc %",
                 "A_final %"),
                (("demo", "A_final"), ("demo", "forgetting"), ("demo_reversed", "A_final"),
                 ("demo_reversed", "forgetting"), ("demo_si_blurry", "A_auc"),
                 ("demo_si_blurry", "A_final"))),
}


def render_table(name: str, cells: Sequence[dict]) -> str:
  """The markdown of table `name` (`TABLES`) from the data, methods in the registry's order."""
  from olora_jax import methods  # the registry imports JAX; the rest of this module does not

  header, columns = TABLES[name]
  streams = list(dict.fromkeys(s for s, _ in columns))
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for spec in methods.specs():
    runs = {s: runs_of(cells, s, spec.name) for s in streams}
    if any(len(r) < MIN_SEEDS for r in runs.values()):
      continue
    label = runs[streams[0]][0]["label"]
    seeds = " / ".join(seeds_text([c["seed"] for c in runs[s]]) for s in streams)
    values = [reporting.stat_text(stat(cells, s, spec.name, m)) for s, m in columns]
    lines.append("| " + " | ".join([label, seeds, *values]) + " |")
  return "\n".join(lines)


BLOCK_START = "<!-- comparison-table: {name} (rendered from docs/data/demo_comparison by"
BLOCK_START += " scripts/demo_comparison.py render: do not edit) -->"
BLOCK_END = "<!-- end of comparison-table: {name} -->"


def rendered_blocks(markdown: str) -> list[tuple[str, str]]:
  """(name, the text between its markers) of every rendered table in `markdown`."""
  out = []
  for name in TABLES:
    start, end = BLOCK_START.format(name=name), BLOCK_END.format(name=name)
    if start in markdown:
      inner = markdown.split(start, 1)[1].split(end, 1)
      if len(inner) != 2:
        raise ValueError(f"comparison-table {name}: no end marker {end!r}")
      out.append((name, inner[0].strip("\n")))
  return out


def render_blocks(markdown: str, cells: Sequence[dict]) -> str:
  """`markdown` with every rendered table's block replaced by its rendering of `cells`."""
  for name, _ in rendered_blocks(markdown):
    start, end = BLOCK_START.format(name=name), BLOCK_END.format(name=name)
    before, rest = markdown.split(start, 1)
    after = rest.split(end, 1)[1]
    markdown = f"{before}{start}\n{render_table(name, cells)}\n{end}{after}"
  return markdown


def rendered_pages() -> list[Path]:
  """The repository's markdown pages (README.md, docs/) that hold a rendered table."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  return [p for p in pages if rendered_blocks(p.read_text())]
