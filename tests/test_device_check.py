"""experiments/device_check.sh's dry run on CPU: the stage that compiles and runs the
lowered programs with the kernels (interpret mode here) passes its own checks and
leaves its results where the script says."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_device_checks_lowered_programs_stage_dry_runs_on_cpu(tmp_path):
  env = dict(os.environ, DRY_RUN="1", STAGES="lowered", RESULTS=str(tmp_path),
             PYTHON=sys.executable, JAX_NUM_CPU_DEVICES="1")
  done = subprocess.run(["bash", "experiments/device_check.sh"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  stages = json.loads((tmp_path / "device_check.json").read_text())
  assert [s["stage"] for s in stages] == ["lowered", "end"]
  assert stages[0]["exit"] == 0, (tmp_path / "lowered.log").read_text()
  report = json.loads((tmp_path / "lowered.json").read_text())
  assert report["all_ok"], report
  assert set(report["programs"]) == {"plain"}
  assert all(p["greedy_tokens_identical"] and p["attention"] == "pallas"
             for p in report["programs"].values())
