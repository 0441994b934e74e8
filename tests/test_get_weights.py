"""scripts/get_weights.py against a local stand-in of the Hugging Face Hub (an HTTP server on
localhost that answers the Hub's download address): a preset's file is downloaded, checked as a
run reads it and written where the config expects it; a wrong or missing file is refused in one
line and leaves nothing behind; a connection dropped half way says so (exit 4), keeps its
`.part` file, and the next call resumes it."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import get_weights  # noqa: E402

from configs import benchmark  # noqa: E402
from olora_jax import models, pretrained  # noqa: E402


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """A stand-in Hub serving a random ViT-S/16 in timm's layout at vit_s16's address, and the same
  file at vit_b16's (a wrong upload): yields (endpoint, the served ViT-S/16 file)."""
  root = tmp_path_factory.mktemp("hub")
  config = benchmark.benchmark_config("vit_s16", dataset="cifar100", scenario="disjoint",
                                      n_tasks=10, mean_threshold=0.0, var_threshold=0.0)
  shapes = pretrained.param_shapes(models.spec_from_config(config.model), 1000)
  rng = np.random.default_rng(0)
  served = root / "vit_s16.safetensors"
  pretrained.save_timm_safetensors(_random(shapes, rng), str(served))
  for preset in ("vit_s16", "vit_b16"):
    where = root / get_weights.repository(preset) / "resolve" / "main"
    where.mkdir(parents=True)
    (where / get_weights.FILENAME).write_bytes(served.read_bytes())
  handler = functools.partial(_Ranged, directory=str(root))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}", served
  server.shutdown()


class _Ranged(http.server.SimpleHTTPRequestHandler):
  """Serves files whole or from a `Range: bytes=N-` offset (206), as the Hub's CDN does, each
  with a strong ETag (its content's SHA-256): a range whose If-Range names another ETag gets the
  whole file (200), as HTTP says. While `DROP_AFTER[0]` is set, the connection is closed after
  that many bytes of the body."""

  DROP_AFTER: list[int | None] = [None]
  STALL_AFTER: list[int | None] = [None]  # after that many bytes, wait for STALLED
  STALLED = threading.Event()
  RANGES: list[str | None] = []  # the Range header of each request
  IGNORE_IF_RANGE: list[bool] = [False]  # a server that honours Range but not If-Range

  def do_GET(self):
    path = Path(self.translate_path(self.path))
    if not path.is_file():
      self.send_error(404)
      return
    data = path.read_bytes()
    etag = f'"{hashlib.sha256(data).hexdigest()}"'
    asked = self.headers.get("Range")
    self.RANGES.append(asked)
    if asked and self.headers.get("If-Range") not in (None, etag) and not self.IGNORE_IF_RANGE[0]:
      asked = None  # the file changed since the part was fetched: all of it
    start = int(asked.removeprefix("bytes=").rstrip("-")) if asked else 0
    self.send_response(206 if asked else 200)
    self.send_header("ETag", etag)
    self.send_header("Content-Length", str(len(data) - start))
    if asked:
      self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
    self.end_headers()
    body = data[start:]
    if self.DROP_AFTER[0] is not None:
      body = body[:self.DROP_AFTER[0]]
      self.close_connection = True
    if self.STALL_AFTER[0] is not None:  # a slow server: the client is stopped meanwhile
      self.wfile.write(body[:self.STALL_AFTER[0]])
      self.wfile.flush()
      self.STALLED.wait(60)
      self.close_connection = True
      return
    self.wfile.write(body)

  def log_message(self, *args):
    pass


def _random(tree, rng):
  if isinstance(tree, dict):
    return {k: _random(v, rng) for k, v in tree.items()}
  return (0.02 * rng.standard_normal(tree)).astype(np.float32)


def test_a_preset_is_downloaded_checked_and_written_where_the_config_expects_it(hub, tmp_path,
                                                                              capsys):
  endpoint, served = hub
  (path,) = get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  assert path == tmp_path / Path(benchmark.BACKBONES["vit_s16"][1]).name
  assert path.read_bytes() == served.read_bytes()
  assert get_weights.sha256(served) in capsys.readouterr().out
  assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial file left
  # A second run keeps the good file without downloading (the stand-in is not asked).
  get_weights.main(["vit_s16", f"--dest={tmp_path}", "--endpoint=http://127.0.0.1:9"])
  assert "already there and checks out" in capsys.readouterr().out


def test_a_wrong_or_missing_file_is_refused_in_one_line_and_nothing_is_left(hub, tmp_path):
  endpoint, _ = hub
  # vit_b16's address serves ViT-S/16 weights: the check against ViT-B/16's shapes refuses them.
  with pytest.raises(SystemExit, match="is not vit_b16's weights in timm's layout"):
    get_weights.main(["vit_b16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  with pytest.raises(SystemExit, match="HTTP 404") as e:  # not on the stand-in
    get_weights.main(["vit_l16", f"--dest={tmp_path / 'new' / 'folder'}", f"--endpoint={endpoint}"])
  assert e.value.exit_code == 4  # the environment (docs/reference/exit-codes.md)
  assert not (tmp_path / "new").exists()  # the folders it made for the download are gone
  with pytest.raises(SystemExit, match="unknown preset") as e:
    get_weights.main(["vit_z", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  assert e.value.exit_code == 2
  assert list(tmp_path.iterdir()) == []
  # A bad file already in place is refused, not trusted.
  bad = get_weights.destination("vit_s16", str(tmp_path))
  bad.write_bytes(b"not a checkpoint")
  with pytest.raises(SystemExit, match="pass --force"):
    get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}", "--force"])
  assert get_weights.problem(bad, "vit_s16") is None


def test_every_preset_has_a_hub_repository_and_the_configs_path():
  for preset, (_, path, _) in benchmark.BACKBONES.items():
    assert get_weights.repository(preset).startswith("timm/")
    assert get_weights.destination(preset) == Path(path)


def test_a_dropped_connection_is_named_and_the_next_call_resumes_the_partial_file(hub, tmp_path):
  endpoint, served = hub
  target = get_weights.destination("vit_s16", str(tmp_path))
  stale = tmp_path / f".{target.name}.a1b2c3.part"  # what a killed download of old left
  stale.write_bytes(b"x" * 100)
  _Ranged.RANGES.clear()
  _Ranged.DROP_AFTER[0] = 1000
  try:
    with pytest.raises(SystemExit, match="the connection dropped after 1,000 bytes of") as e:
      get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  finally:
    _Ranged.DROP_AFTER[0] = None
  assert e.value.exit_code == 4 and "run the same command to resume" in str(e.value)
  assert "weights" not in str(e.value)  # not taken for a wrong file
  part = get_weights.partial_file(target)
  source = get_weights.source_file(part)  # the validator of the file the part holds
  assert sorted(p.name for p in tmp_path.iterdir()) == [part.name, source.name]  # no stale file
  assert part.read_bytes() == served.read_bytes()[:1000]
  get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  assert _Ranged.RANGES == [None, "bytes=1000-"]  # resumed, not downloaded again
  assert target.read_bytes() == served.read_bytes()
  assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_the_command_line_exits_with_the_documented_code_and_one_error_line(tmp_path):
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "get_weights.py"), "vit_z"],
                        capture_output=True, text=True, cwd=tmp_path)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("error: unknown preset(s) ['vit_z']")


def _serve(root: Path, preset: str, data: bytes) -> None:
  (root / get_weights.repository(preset) / "resolve" / "main" / get_weights.FILENAME).write_bytes(
      data)


def _cut_then_changed(endpoint: str, tmp_path: Path, drop_after: int, seed: int):
  """A download into tmp_path/dest cut after `drop_after` bytes of the served file A, and
  another ViT-S/16 file B (from `seed`) of the same size written beside: (B's path, dest)."""
  config = benchmark.benchmark_config("vit_s16", dataset="cifar100", scenario="disjoint",
                                      n_tasks=10, mean_threshold=0.0, var_threshold=0.0)
  other = tmp_path / "b.safetensors"
  pretrained.save_timm_safetensors(
      _random(pretrained.param_shapes(models.spec_from_config(config.model), 1000),
              np.random.default_rng(seed)), str(other))
  dest = tmp_path / "dest"
  _Ranged.RANGES.clear()
  _Ranged.DROP_AFTER[0] = drop_after
  try:
    with pytest.raises(SystemExit, match="the connection dropped after"):
      get_weights.main(["vit_s16", f"--dest={dest}", f"--endpoint={endpoint}"])
  finally:
    _Ranged.DROP_AFTER[0] = None
  return other, dest


def test_a_resume_never_splices_two_files(hub, tmp_path):
  """Killed at 1,000 bytes of file A, rerun while the server holds file B: the range request's
  If-Range named A's ETag, so B came whole. Before, the rerun appended B's tail to A's head and
  accepted the splice (exit 0). A .part that records no validator is fetched from the start."""
  endpoint, served = hub
  root = served.parent
  other, dest = _cut_then_changed(endpoint, tmp_path, 1000, seed=1)
  target = get_weights.destination("vit_s16", str(dest))
  _serve(root, "vit_s16", other.read_bytes())
  try:
    get_weights.main(["vit_s16", f"--dest={dest}", f"--endpoint={endpoint}"])
  finally:
    _serve(root, "vit_s16", served.read_bytes())
  assert _Ranged.RANGES == [None, "bytes=1000-"]  # asked for the rest of A; got all of B
  assert target.read_bytes() == other.read_bytes()
  assert sorted(p.name for p in dest.iterdir()) == [target.name]
  # A .part of unknown origin (no record of its source): not resumed.
  target.unlink()
  part = get_weights.partial_file(target)
  part.write_bytes(other.read_bytes()[:1000])
  _Ranged.RANGES.clear()
  get_weights.main(["vit_s16", f"--dest={dest}", f"--endpoint={endpoint}"])
  assert _Ranged.RANGES == [None] and target.read_bytes() == served.read_bytes()


def test_a_server_that_ignores_if_range_cannot_splice_two_files(hub, tmp_path, capsys):
  """Killed at 5 MB of file A, rerun while a server that honours Range but ignores If-Range holds
  file B: it answers 206 with B's tail. Before, that tail was appended to A's head ("resuming
  after 5.0 MB", exit 0, a file equal to neither); now the 206's ETag is compared with A's, the
  download restarts from zero in one line, and the file is B."""
  endpoint, served = hub
  root = served.parent
  # Cut past the header: the tensors' bytes differ there.
  other, dest = _cut_then_changed(endpoint, tmp_path, 5_000_000, seed=2)
  target = get_weights.destination("vit_s16", str(dest))
  _serve(root, "vit_s16", other.read_bytes())
  _Ranged.IGNORE_IF_RANGE[0] = True
  capsys.readouterr()
  try:
    get_weights.main(["vit_s16", f"--dest={dest}", f"--endpoint={endpoint}"])
  finally:
    _Ranged.IGNORE_IF_RANGE[0] = False
    _serve(root, "vit_s16", served.read_bytes())
  out = capsys.readouterr().out
  assert _Ranged.RANGES == [None, "bytes=5000000-", None]  # the 206 refused, then all of B
  assert "resuming" not in out
  assert [line for line in out.splitlines() if "changed since" in line] == [
      f"  the server's file changed since {get_weights.partial_file(target)} was fetched (its"
      f" validator is \"{hashlib.sha256(other.read_bytes()).hexdigest()}\", not the"
      f" \"{hashlib.sha256(served.read_bytes()).hexdigest()}\" of the file the partial download"
      " came from): downloading it from the start"]
  assert target.read_bytes() == other.read_bytes()
  assert sorted(p.name for p in dest.iterdir()) == [target.name]


def test_a_range_is_checked_against_the_recorded_size_and_start():
  """Without a changed validator, a 206 whose total or start is not the partial file's is no
  continuation either."""
  recorded = {"validator": '"a"', "size": 100}
  headers = {"ETag": '"a"', "Content-Range": "bytes 40-99/100"}
  assert get_weights._range_changed(headers, 40, recorded) is None
  assert "not the bytes from 40" in get_weights._range_changed(
      {**headers, "Content-Range": "bytes 0-99/100"}, 40, recorded)
  assert "not the 100 bytes" in get_weights._range_changed(
      {**headers, "Content-Range": "bytes 40-119/120"}, 40, recorded)
  assert "not the \"a\"" in get_weights._range_changed({"ETag": 'W/"a"'}, 40, recorded)


def test_two_calls_on_one_destination_do_not_share_it(hub, tmp_path):
  """The second call is refused while the first holds the destination (before, the two wrote
  one .part, and the second ended with "nothing is ever downloaded, fetch the file yourself")."""
  endpoint, served = hub
  target = get_weights.destination("vit_s16", str(tmp_path))
  with get_weights.locked(target):
    with pytest.raises(SystemExit, match=re.escape(
        f"{target} is being fetched by get_weights.py (pid {os.getpid()}); wait for it to"
        " end")) as e:
      get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
    assert e.value.exit_code == 4
  assert list(tmp_path.iterdir()) == []  # the lock file goes with the lock
  get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  assert target.read_bytes() == served.read_bytes()
  assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_stops_the_download_in_one_line_and_the_rerun_resumes(hub, tmp_path, signum):
  """Ctrl-C printed a KeyboardInterrupt traceback and SIGTERM exited 143 with no line."""
  endpoint, served = hub
  target = get_weights.destination("vit_s16", str(tmp_path))
  part = get_weights.partial_file(target)
  _Ranged.STALLED.clear()
  _Ranged.STALL_AFTER[0] = 5000
  try:
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "get_weights.py"),
                                "vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size == 5000) and time.monotonic() < deadline:
      time.sleep(0.02)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
  finally:
    _Ranged.STALL_AFTER[0] = None
    _Ranged.STALLED.set()
  assert process.returncode == 128 + signum, stderr
  assert "Traceback" not in stderr
  assert stderr.strip().splitlines()[-1] == (
      f"error: stopped by signal {signum}; {part} keeps the 5,000 bytes received: run the same"
      " command to resume")
  _Ranged.RANGES.clear()
  get_weights.main(["vit_s16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  assert _Ranged.RANGES == ["bytes=5000-"] and target.read_bytes() == served.read_bytes()


def test_help_is_whole():
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "get_weights.py"), "--help"],
                        capture_output=True, text=True)
  assert done.returncode == 0
  assert "and writes them where the config expects them" in " ".join(done.stdout.split())
  assert "128 + signal" in done.stdout
