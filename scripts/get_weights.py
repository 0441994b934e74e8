"""Fetches the pretrained weights a benchmark config names, checks them as a run reads them, and
writes them where the config expects them. On a machine with network, from the repository root:

    .venv/bin/python scripts/get_weights.py vit_b16              # the paper's backbone
    .venv/bin/python scripts/get_weights.py vit_s16 swin_t       # several
    .venv/bin/python scripts/get_weights.py all

Each preset of configs/benchmark.py (`BACKBONES`: vit_b16, vit_s16, vit_l16, vit_h14, swin_t) is
timm's upload of that model on the Hugging Face Hub (`timm/<name>`, its `model.safetensors`),
downloaded over HTTPS with no other package (`--endpoint` or $HF_ENDPOINT for a mirror; $HF_TOKEN
is sent if set). The download goes to a hidden file beside the destination
(`.<name>.part`) and is checked as a run reads it before it takes the config's path:
`olora_jax.pretrained.load_pretrained` with the preset's architecture (timm's layout, every
tensor's shape, every weight finite). A download cut short (a dropped connection, Ctrl-C, a
killed job) leaves its `.part` file and the server's validator of the file it was getting (its
strong ETag, else its Last-Modified date, in `.<name>.part.source`), and the next call resumes
it where it stopped: an HTTP range request that holds only while the server's file is still that
one (If-Range); a changed file, or a `.part` without a validator, is downloaded from the start.
A server that ignores If-Range and sends the rest of a changed file anyway is caught too: the
range it sends (206) must carry the recorded validator, start where the `.part` ends and, where
it says, have the recorded file size; otherwise the download says so in one line and starts
again from zero rather than join two files.
One call at a time fetches a destination (a lock on `.<name>.lock`, removed at the end). The
path is the config's
`pretrained.path` (`checkpoints/<timm name>.safetensors`, below the current directory) or
`--dest DIR/<the same name>`. A file already there is checked and kept (`--force` fetches it
again). Prints each file's size and SHA-256.

Exit codes (those of launch/run.py, docs/reference/exit-codes.md), each failure with one `error:`
line last on stderr:
  0  every preset's file is in place and checks out
  2  bad input: an unknown preset, a file in place or downloaded that is not the preset's
     weights (the downloaded one is removed)
  4  the environment failed: no connection, an HTTP error, a connection dropped half way (the
     `.part` file is kept: run the same command to resume), a disk that cannot take the file
     (its `.part` file is removed), another call fetching the same destination
  128 + signal (130 for Ctrl-C, 143 for SIGTERM): stopped; the `.part` file is kept, and the
     same command resumes it
A folder this script made for a download that failed is removed again.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import pathlib
import signal
import sys
import urllib.error
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import benchmark  # noqa: E402
from olora_jax import errors  # noqa: E402

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


EXIT_BAD_INPUT = 2  # olora_jax/errors.py
EXIT_ENVIRONMENT = 4


class Failure(SystemExit):
  """One failure: its `error:` line (the message) and its exit code."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def partial_file(target: pathlib.Path) -> pathlib.Path:
  """Where the download of `target` goes until it is complete and checked."""
  return target.parent / f".{target.name}.part"


def source_file(part: pathlib.Path) -> pathlib.Path:
  """Where `part`'s source is recorded: its URL and the server's validator of that file."""
  return part.with_name(part.name + ".source")


def lock_file(target: pathlib.Path) -> pathlib.Path:
  return target.parent / f".{target.name}.lock"


class Stopped(Exception):
  """SIGINT (Ctrl-C) or SIGTERM: the download stops where it is (its `.part` kept)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _stop(signum, frame) -> None:
  raise Stopped(signum)


@contextlib.contextmanager
def locked(target: pathlib.Path):
  """Holds the lock of `target`'s destination (an OS lock on `.<name>.lock`, released if the
  process dies; the file is removed at the end). Another call on it: `Failure`, exit 4."""
  path = lock_file(target)
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise Failure(f"{target} is being fetched by {holder}; wait for it to end (or stop it),"
                      " then run the same command", EXIT_ENVIRONMENT) from None
      raise
    try:  # the file locked is still the one at `path` (not one a finishing call removed)
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"get_weights.py (pid {os.getpid()})\n".encode(), 0)
  try:
    yield
  finally:
    path.unlink(missing_ok=True)
    os.close(fd)


def _make_folder(folder: pathlib.Path) -> list[pathlib.Path]:
  """Makes `folder` and its missing parents; returns those it made, deepest first."""
  missing = []
  for parent in (folder, *folder.parents):
    if parent.exists():
      break
    missing.append(parent)
  folder.mkdir(parents=True, exist_ok=True)
  return missing


def _remove_empty(folders: list[pathlib.Path]) -> None:
  for folder in folders:  # deepest first
    with contextlib.suppress(OSError):
      folder.rmdir()


def _remove_stale_parts(target: pathlib.Path) -> None:
  """Removes the partial files `.<name>.<random>.part` that earlier versions of this script left
  when a download was killed (they cannot be resumed: they carry no record of their source)."""
  for stale in target.parent.glob(f".{target.name}.*.part"):
    stale.unlink(missing_ok=True)


def _size(n: int) -> str:
  return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _validator(headers) -> str | None:
  """The server's validator of the file it sends, for If-Range: a strong ETag, else its
  Last-Modified date; None when it gives neither (a weak ETag cannot validate a range)."""
  etag = headers.get("ETag")
  if etag and not etag.startswith("W/"):
    return etag
  return headers.get("Last-Modified")


def _recorded(part: pathlib.Path, url: str) -> dict:
  """What was recorded with `part` when it came from `url` (its "validator" and the file's
  "size"), else {}."""
  try:
    record = json.loads(source_file(part).read_text())
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) and record.get("url") == url else {}


def _total(headers) -> int | None:
  """The whole file's size a response states: Content-Range's total of a 206, else the
  Content-Length of a 200; None when it does not say."""
  content_range = headers.get("Content-Range") or ""
  total = content_range.rpartition("/")[2]
  if content_range and total.isdigit():
    return int(total)
  length = headers.get("Content-Length")
  return int(length) if length and length.isdigit() and not content_range else None


def _range_changed(headers, have: int, recorded: dict) -> str | None:
  """Why a 206 answer to a range request from byte `have` is not the rest of the file `part`'s
  bytes came from (a server that ignores If-Range sends the rest of whatever it has now), else
  None: its validator (ETag or Last-Modified) is not the recorded one, its Content-Range does not
  start at `have`, or its total is not the recorded size."""
  validator = _validator(headers)
  if validator != recorded.get("validator"):
    return (f"its validator is {validator}, not the {recorded.get('validator')} of the file"
            " the partial download came from")
  content_range = headers.get("Content-Range") or ""
  start = content_range.removeprefix("bytes ").partition("-")[0]
  if content_range and start != str(have):
    return f"it sent {content_range!r}, not the bytes from {have}"
  total, size = _total(headers), recorded.get("size")
  if total is not None and size is not None and total != size:
    return f"its file is {_size(total)}, not the {_size(size)} of the partial download's"
  return None


def download(url: str, part: pathlib.Path) -> None:
  """`url` into `part`, streamed, resuming from `part`'s bytes when it holds some, its source
  (`source_file`) records the server's validator of the file they came from, and the server
  takes a range request while its file is still that one (If-Range; else it sends the whole file
  and the download starts again). OSError (`ConnectionError` for a body cut short) on failure;
  `part` keeps what arrived."""
  have = part.stat().st_size if part.exists() else 0
  recorded = _recorded(part, url) if have else {}
  validator = recorded.get("validator")
  if have and validator is None:  # of unknown origin: bytes of another file cannot be told
    print(f"  {part} does not record which file it holds: downloading from the start",
          flush=True)
    have = 0
  request = urllib.request.Request(url)
  if os.environ.get("HF_TOKEN"):
    request.add_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
  if have:
    request.add_header("Range", f"bytes={have}-")
    request.add_header("If-Range", validator)
  try:
    response = urllib.request.urlopen(request, timeout=60)
  except urllib.error.HTTPError as e:
    if e.code != 416 or not have:  # 416: the range is past the end: start again
      raise
    part.unlink()
    return download(url, part)
  if have and response.status == 206:
    changed = _range_changed(response.headers, have, recorded)
    if changed:  # the server ignored If-Range: its bytes would splice two files
      response.close()
      print(f"  the server's file changed since {part} was fetched ({changed}):"
            " downloading it from the start", flush=True)
      _discard(part)
      return download(url, part)
  with response:
    resumed = have and response.status == 206
    length = response.headers.get("Content-Length")
    expected = None if length is None else int(length) + (have if resumed else 0)
    if have and not resumed:
      print("  the server's file changed, or it sent the whole file: downloading it from the"
            " start", flush=True)
    elif resumed:
      print(f"  resuming after {_size(have)}", flush=True)
    if not resumed:  # the source of the bytes to come, before the first of them
      source_file(part).write_text(json.dumps({"url": url,
                                               "validator": _validator(response.headers),
                                               "size": _total(response.headers)}))
    with open(part, "ab" if resumed else "wb") as f:
      try:  # each piece as it arrives: a stop keeps every byte received
        for piece in iter(lambda: response.read1(1 << 20), b""):
          f.write(piece)
      except (http.client.IncompleteRead, ConnectionError, TimeoutError) as e:
        raise ConnectionError(f"the connection dropped ({type(e).__name__})") from e
      got = f.tell()
  if expected is not None and got < expected:  # the server closed the connection early
    raise ConnectionError(f"the connection dropped after {_size(got)} of {_size(expected)}")


def _discard(part: pathlib.Path) -> None:
  """Removes `part` and the record of its source."""
  part.unlink(missing_ok=True)
  source_file(part).unlink(missing_ok=True)


def fetch(preset: str, endpoint: str, dest: str = "", force: bool = False) -> pathlib.Path:
  """`preset`'s weights at their destination, downloaded unless a good file is there already."""
  target = destination(preset, dest)
  if target.exists() and not force:
    found = problem(target, preset)
    if found:
      raise Failure(f"{preset}: {target} is there but is not {preset}'s weights in timm's layout"
                    f" ({found}); pass --force to download it again", EXIT_BAD_INPUT)
    print(f"{preset}: {target} is already there and checks out")
    return target
  try:
    made = _make_folder(target.parent)
  except OSError as e:
    raise Failure(f"{preset}: cannot make {target.parent} ({e.strerror or e}); make it writable"
                  " or pass --dest DIR", EXIT_ENVIRONMENT) from None
  part = partial_file(target)
  try:
    with locked(target):
      return _fetch_locked(preset, endpoint, target, part)
  finally:  # a failure that kept nothing leaves nothing: no record, no folder made for it
    if not part.exists():
      source_file(part).unlink(missing_ok=True)
      _remove_empty(made)


def _fetch_locked(preset: str, endpoint: str, target: pathlib.Path,
                  part: pathlib.Path) -> pathlib.Path:
  """`fetch` once the destination is held: the download into `part`, checked, then moved."""
  _remove_stale_parts(target)
  url = f"{endpoint.rstrip('/')}/{repository(preset)}/resolve/main/{FILENAME}"
  print(f"{preset}: downloading {url}", flush=True)
  try:
    download(url, part)
  except (urllib.error.URLError, OSError) as e:
    reason = getattr(e, "reason", None) or e
    if part.exists() and not part.stat().st_size:  # nothing arrived: nothing to resume
      _discard(part)
    if isinstance(e, ConnectionError) and part.exists():
      raise Failure(f"{preset}: downloading {url} stopped: {reason}; {part} keeps the"
                    f" {_size(part.stat().st_size)} received: run the same command to resume",
                    EXIT_ENVIRONMENT) from None
    cause = None if isinstance(e, urllib.error.URLError) else errors.storage_cause(e)
    if cause is not None:  # the disk: what was written takes the space a retry needs
      _discard(part)
      advice = errors.storage_advice(cause, "pass --dest DIR")
      raise Failure(f"{preset}: cannot write {part} ({cause}); {advice}, then run the same"
                    " command", EXIT_ENVIRONMENT) from None
    if isinstance(e, urllib.error.HTTPError):
      advice = (f"the server answered HTTP {e.code}; check --endpoint (or $HF_ENDPOINT), or set"
                " $HF_TOKEN if the repository needs it, and run the same command")
    else:
      advice = ("check the network (or --endpoint / $HF_ENDPOINT for a mirror) and run the"
                " same command")
    if part.exists():
      advice += f" (it resumes the {_size(part.stat().st_size)} kept in {part})"
    raise Failure(f"{preset}: cannot download {url} ({reason}); {advice}",
                  EXIT_ENVIRONMENT) from None
  found = problem(part, preset)
  if found:
    _discard(part)
    raise Failure(f"{preset}: the file downloaded from {url} is not {preset}'s weights in"
                  f" timm's layout ({found}); nothing was written", EXIT_BAD_INPUT)
  os.replace(part, target)
  source_file(part).unlink(missing_ok=True)
  return target


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
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
    raise Failure(f"unknown preset(s) {unknown}: use {', '.join(benchmark.BACKBONES)} or all",
                  EXIT_BAD_INPUT)
  written = []
  for preset in presets:
    path = fetch(preset, args.endpoint, args.dest, args.force)
    print(f"{preset}: {path} ({path.stat().st_size / 1e6:.1f} MB, sha256 {sha256(path)})")
    written.append(path)
  return written


def _stopped_line(signum: int, argv: list[str]) -> str:
  """The line of a stop by `signum`: which partial downloads a rerun resumes."""
  kept = [p for p in (partial_file(destination(preset, dest=_dest(argv)))
                      for preset in benchmark.BACKBONES) if p.exists() and p.stat().st_size]
  what = "; ".join(f"{p} keeps the {_size(p.stat().st_size)} received" for p in kept)
  return (f"stopped by signal {signum}" + (f"; {what}" if what else "")
          + ": run the same command to " + ("resume" if kept else "start again"))


def _dest(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--dest="):
      return arg.partition("=")[2]
    if arg == "--dest" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


if __name__ == "__main__":
  for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _stop)
  try:
    main()
  except Failure as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
  except Stopped as e:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the line is written whole
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"\nerror: {_stopped_line(e.signum, sys.argv[1:])}", file=sys.stderr)
    sys.exit(128 + e.signum)
