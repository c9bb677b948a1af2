"""`make results` (experiments/results.py): every figure the README shows is made by a
study of experiments/results.py, and a study leaves its JSON, PNG and manifest entry.

The full studies take hours on two cores; here the analytical simulator study runs for
real, and the rest is checked structurally (scripts exist, outputs are declared once).
`python experiments/results.py --quick` runs every study at tiny settings.
"""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
import results  # noqa: E402


def test_every_study_runs_an_existing_script_and_declares_distinct_outputs():
  names = [study.name for study in results.STUDIES]
  assert len(names) == len(set(names))
  declared = [name for study in results.STUDIES for name in study.outputs]
  assert len(declared) == len(set(declared)), "two studies claim the same output file"
  for study in results.STUDIES:
    assert (ROOT / "experiments" / study.script).exists(), study.script
    assert any(name.endswith(".json") for name in study.outputs), study.name
    assert any(name.endswith(".png") for name in study.outputs), study.name


def test_every_figure_in_the_readme_is_a_results_output():
  # The README and the measurement notes it links (docs/results.md, paths from docs/).
  text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "results.md").read_text()
  figures = {f.removeprefix("../") for f in re.findall(r"[\w./-]+\.png", text)}
  outside = sorted(f for f in figures if not f.startswith("results/"))
  assert not outside, f"README shows figures that `make results` does not make: {outside}"
  unknown = sorted(f for f in figures if f.removeprefix("results/") not in results.outputs())
  assert not unknown, f"README shows results/ files no study writes: {unknown}"


def test_last_json_skips_logs_and_returns_the_final_object():
  stdout = ('loading {"not": json\n{"first": 1}\nstep 3 done\n'
            + json.dumps({"results": [{"k": 1}], "nested": {"a": 2}}, indent=2) + "\n")
  assert results.last_json(stdout) == {"results": [{"k": 1}], "nested": {"a": 2}}
  with pytest.raises(ValueError):
    results.last_json("no json here\n")


def test_the_simulator_study_writes_its_json_png_and_manifest(tmp_path):
  assert results.main(["--only", "sim_presets", "--out", str(tmp_path)]) == 0
  study = results.BY_NAME["sim_presets"]
  for name in study.outputs:
    assert (tmp_path / name).stat().st_size > 0, name
  payload = json.loads((tmp_path / "sim_presets.json").read_text())
  zero = payload["summary"]["paper-8b-rl-zero"]
  assert zero["paper_generation_speedup"] == 1.77
  assert 1.0 < zero["generation_speedup"] < 3.0
  assert [row["k"] for row in zero["k_sweep"]] == [3, 5, 7]
  manifest = json.loads((tmp_path / "manifest.json").read_text())
  record = manifest["studies"]["sim_presets"]
  assert record["returncode"] == 0 and record["outputs"] == list(study.outputs)
  assert record["command"][:2] == ["python", "experiments/sim_presets.py"]
