"""Fetches the pretrained weights a benchmark config names, checks them as a run reads them, and
writes them where the config expects them. On a machine with network, from the repository root:

    .venv/bin/python scripts/get_weights.py vit_b16              # the paper's backbone
    .venv/bin/python scripts/get_weights.py vit_s16 swin_t       # several
    .venv/bin/python scripts/get_weights.py all

Each preset of configs/benchmark.py (`BACKBONES`: vit_b16, vit_s16, vit_l16, vit_h14, swin_t) is
timm's upload of that model on the Hugging Face Hub (`timm/<name>`, its `model.safetensors`),
downloaded over HTTPS with no other package (`--endpoint` or $HF_ENDPOINT for a mirror; $HF_TOKEN
is sent if set). The download goes to a temporary file beside the destination and is checked as a
run reads it before it takes the config's path: `olora_jax.pretrained.load_pretrained` with the
preset's architecture (timm's layout, every tensor's shape, every weight finite). The path is the
config's `pretrained.path` (`checkpoints/<timm name>.safetensors`, below the current directory) or
`--dest DIR/<the same name>`. A file already there is checked and kept (`--force` fetches it
again). Prints each file's size and SHA-256. Exits 2 with one `error:` line for an unknown preset,
a failed download or a file that does not check out (nothing is left behind).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile
import urllib.error
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import benchmark  # noqa: E402

DEFAULT_ENDPOINT = "https://huggingface.co"
FILENAME = "model.safetensors"  # timm's uploads
# The Hub's repository where it is not timm/<the checkpoint's file name>.
REPOS = {"swin_t": "timm/swin_tiny_patch4_window7_224.ms_in1k"}


def repository(preset: str) -> str:
  """The Hub repository of `preset`'s weights."""
  path = benchmark.BACKBONES[preset][1]
  return REPOS.get(preset, "timm/" + pathlib.Path(path).name.removesuffix(".safetensors"))


def destination(preset: str, dest: str = "") -> pathlib.Path:
  """Where the config expects `preset`'s file (`pretrained.path`), or the same name in `dest`."""
  path = pathlib.Path(benchmark.BACKBONES[preset][1])
  return pathlib.Path(dest) / path.name if dest else path


def problem(path: pathlib.Path, preset: str) -> str | None:
  """None if `path` reads as a run of `preset` reads its weights, else the loader's first line."""
  from olora_jax import models, pretrained

  config = benchmark.benchmark_config(preset, dataset="cifar100", scenario="disjoint",
                                      n_tasks=10, mean_threshold=0.0, var_threshold=0.0)
  try:
    pretrained.load_pretrained(str(path), models.spec_from_config(config.model), 100, fmt="timm")
  except Exception as e:  # the loader's refusals are one line each
    return (str(e).splitlines() or [type(e).__name__])[0]
  return None


def sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def download(url: str, target: pathlib.Path) -> None:
  """`url` into `target`, streamed."""
  request = urllib.request.Request(url)
  if os.environ.get("HF_TOKEN"):
    request.add_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
  with urllib.request.urlopen(request, timeout=60) as response, open(target, "wb") as f:
    shutil.copyfileobj(response, f, 1 << 20)


def fetch(preset: str, endpoint: str, dest: str = "", force: bool = False) -> pathlib.Path:
  """`preset`'s weights at their destination, downloaded unless a good file is there already."""
  target = destination(preset, dest)
  if target.exists() and not force:
    found = problem(target, preset)
    if found:
      raise SystemExit(f"error: {preset}: {target} is there but is not {preset}'s weights in"
                       f" timm's layout ({found}); pass --force to download it again")
    print(f"{preset}: {target} is already there and checks out")
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  url = f"{endpoint.rstrip('/')}/{repository(preset)}/resolve/main/{FILENAME}"
  fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
  os.close(fd)
  tmp = pathlib.Path(tmp)
  try:
    print(f"{preset}: downloading {url}", flush=True)
    try:
      download(url, tmp)
    except (urllib.error.URLError, OSError) as e:
      raise SystemExit(f"error: {preset}: cannot download {url} ({e}); check the network (or"
                       " --endpoint / $HF_ENDPOINT for a mirror) and run the same command"
                       ) from None
    found = problem(tmp, preset)
    if found:
      raise SystemExit(f"error: {preset}: the file downloaded from {url} is not {preset}'s"
                       f" weights in timm's layout ({found}); nothing was written")
    os.replace(tmp, target)
  finally:
    tmp.unlink(missing_ok=True)
  return target


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("presets", nargs="+",
                      help=f"of {', '.join(benchmark.BACKBONES)}, or all")
  parser.add_argument("--dest", default="", help="a folder instead of checkpoints/")
  parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT),
                      help="the Hub's address (default $HF_ENDPOINT, else huggingface.co)")
  parser.add_argument("--force", action="store_true", help="download even if a file is there")
  args = parser.parse_args(argv)
  presets = list(benchmark.BACKBONES) if args.presets == ["all"] else args.presets
  unknown = [p for p in presets if p not in benchmark.BACKBONES]
  if unknown:
    raise SystemExit(f"error: unknown preset(s) {unknown}: use {', '.join(benchmark.BACKBONES)}"
                     " or all")
  written = []
  for preset in presets:
    path = fetch(preset, args.endpoint, args.dest, args.force)
    print(f"{preset}: {path} ({path.stat().st_size / 1e6:.1f} MB, sha256 {sha256(path)})")
    written.append(path)
  return written


if __name__ == "__main__":
  main()
