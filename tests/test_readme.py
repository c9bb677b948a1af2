"""Every Python block of the README runs as pasted (each in a fresh namespace, in the
order the README shows them), so the Quickstart cannot drift from the API."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_python_blocks():
  assert len(BLOCKS) >= 2  # the Quickstart and Scale


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs_as_pasted(index):
  exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})
