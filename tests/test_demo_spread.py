"""scripts/demo_spread.py's measuring, on stand-in checkouts whose launch/run.py touches a known
amount of memory (no demo runs: a second or two)."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import demo_spread  # noqa: E402

# A stand-in launch/run.py: touches MIB mebibytes (more on the call the counter file names) and
# holds them HOLD seconds, writes results.json's step_seconds into --workdir, or fails with an
# error line.
RUN = textwrap.dedent("""
    import json, os, sys, time
    workdir = sys.argv[sys.argv.index("--workdir") + 1]
    counter = os.path.join(os.path.dirname(__file__), "calls")
    calls = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
    open(counter, "w").write(str(calls))
    if os.environ.get("FAIL"):
      print("error: the stand-in was told to fail", file=sys.stderr)
      sys.exit(2)
    mib = int(os.environ.get("MIB", "8")) * (int(os.environ.get("SPIKE_TIMES", "1"))
                                             if calls == int(os.environ.get("SPIKE_CALL", "0"))
                                             else 1)
    block = bytearray(mib << 20)
    block[::4096] = b"x" * len(block[::4096])  # every page touched
    time.sleep(float(os.environ.get("HOLD", "0")))  # long enough to be sampled from /proc
    os.makedirs(workdir)
    json.dump({"compute": {"step_seconds": 0.5 + calls}},
              open(os.path.join(workdir, "results.json"), "w"))
""")


def _checkout(root: Path) -> str:
  (root / "launch").mkdir(parents=True)
  (root / "configs").mkdir()
  (root / "launch" / "run.py").write_text(RUN)
  return str(root)


def test_one_run_counts_its_faults_and_reads_its_step_seconds(tmp_path):
  checkout = _checkout(tmp_path / "a")
  small = demo_spread.run_once(checkout, sys.executable, "reference", str(tmp_path / "w1"),
                               {**os.environ, "MIB": "4"})
  large = demo_spread.run_once(checkout, sys.executable, "reference", str(tmp_path / "w2"),
                               {**os.environ, "MIB": "64", "HOLD": "1"}, threads=True)
  assert small["exit"] == large["exit"] == 0
  assert (small["step_seconds"], large["step_seconds"]) == (1.5, 2.5)
  # 60 MiB more touched: at least 15,360 more pages faulted in, in the process's main thread.
  assert large["minflt"] - small["minflt"] >= (60 << 20) // 4096
  assert large["user"] >= 0 and large["sys"] >= 0 and large["wall"] > 0
  name, count, faults, _ = large["threads"][0]
  assert count >= 1 and faults >= (64 << 20) // 4096, large["threads"]


def test_a_failed_run_keeps_its_last_line(tmp_path):
  row = demo_spread.run_once(_checkout(tmp_path / "a"), sys.executable, "reference",
                             str(tmp_path / "w"), {**os.environ, "FAIL": "1"})
  assert row["exit"] == 2 and row["step_seconds"] is None
  assert row["last_line"] == "error: the stand-in was told to fail"


def test_the_storm_run_is_counted_a_spike(tmp_path, monkeypatch, capsys):
  a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
  monkeypatch.setattr(demo_spread, "REPO", a)
  # Each checkout's third call (its second counted run) touches 20 times the memory.
  monkeypatch.setenv("SPIKE_CALL", "3")
  demo_spread.main(["--runs", "3", "--warmup", "1", "--vs", b, "--env", "SPIKE_TIMES=20",
                    "--json", str(tmp_path / "spread.json")])
  out = capsys.readouterr().out
  assert "A: 3 runs, 1 spike(s), 0 failed" in out and "B: 3 runs, 1 spike(s), 0 failed" in out
  assert "A / B, medians:" in out
  record = json.loads((tmp_path / "spread.json").read_text())
  assert record["env"] == {"SPIKE_TIMES": "20"}
  assert [row["step_seconds"] for row in record["runs"]["A"]] == [2.5, 3.5, 4.5]


@pytest.mark.parametrize("argv", [["--env", "NOVALUE"], ["--runs", "0"], ["--vs", "/"]])
def test_bad_arguments_stop_before_any_run(argv, capsys):
  with pytest.raises(SystemExit) as stop:
    demo_spread.main(argv)
  assert stop.value.code == 2 and "error:" in capsys.readouterr().err
