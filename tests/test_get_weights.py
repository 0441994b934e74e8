"""scripts/get_weights.py against a local stand-in of the Hugging Face Hub (an HTTP server on
localhost that answers the Hub's download address): a preset's file is downloaded, checked as a
run reads it and written where the config expects it; a wrong or missing file is refused in one
line and leaves nothing behind."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
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
  handler = functools.partial(_Quiet, directory=str(root))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}", served
  server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
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
  with pytest.raises(SystemExit, match="cannot download"):  # not on the stand-in: HTTP 404
    get_weights.main(["vit_l16", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
  with pytest.raises(SystemExit, match="unknown preset"):
    get_weights.main(["vit_z", f"--dest={tmp_path}", f"--endpoint={endpoint}"])
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
