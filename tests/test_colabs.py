"""The notebooks in colabs/ run top to bottom, headless and offline.

Each notebook is executed by nbclient in a fresh kernel with SPECRL_FAST=1 (the
notebooks read it to pick tiny settings), from a scratch working directory, after a
first cell that makes any network connection from Python fail. A notebook passes when
every cell runs without error and it draws its figures. Each committed .ipynb is also
checked against its jupytext percent source (colabs/NAME.py), so an edit to one side
without regenerating the other (`jupytext --sync colabs/*.ipynb`) fails here.
"""

import os
import pathlib

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

COLABS = pathlib.Path(__file__).resolve().parent.parent / "colabs"
NOTEBOOKS = sorted(COLABS.glob("*.ipynb"))
# The least number of figures each notebook draws (inline PNG outputs).
MIN_FIGURES = {"drafter_playground": 3, "rejection_sampling": 5, "grpo_speculative": 1}

# Runs first in the kernel: the notebooks must work without a network, so any
# connection to a non-loopback address raises instead of hanging or downloading.
OFFLINE_GUARD = """
import socket as _socket

_LOOPBACK = ("127.", "::1", "localhost")


def _offline(address):
  host = address[0] if isinstance(address, tuple) else str(address)
  if not str(host).startswith(_LOOPBACK):
    raise OSError(f"network access attempted from a notebook: {address!r}")


_connect = _socket.socket.connect
_connect_ex = _socket.socket.connect_ex


def _guarded_connect(self, address):
  _offline(address)
  return _connect(self, address)


def _guarded_connect_ex(self, address):
  _offline(address)
  return _connect_ex(self, address)


_socket.socket.connect = _guarded_connect
_socket.socket.connect_ex = _guarded_connect_ex
"""


def _kernel_env(tmp_path) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
      SPECRL_FAST="1",
      JAX_PLATFORMS="cpu",
      # One device, as on a Colab CPU runtime (the test process simulates eight).
      JAX_NUM_CPU_DEVICES="1",
      # The notebooks' tiny programs run in milliseconds; what costs is compiling them.
      XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip(),
      MPLCONFIGDIR=str(tmp_path / "matplotlib"),
      HF_HUB_OFFLINE="1",
  )
  return env


def test_there_are_the_three_notebooks():
  assert {p.stem for p in NOTEBOOKS} == set(MIN_FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_percent_source(path):
  source = COLABS / f"{path.stem}.py"
  assert source.exists(), f"{path.name} has no jupytext source {source.name}"
  from_source = jupytext.read(source)
  committed = nbformat.read(path, as_version=4)
  cells = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]
  assert cells(committed) == cells(from_source), (
      f"{path.name} and {source.name} differ: run `jupytext --sync {path}`")
  assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code"), (
      f"{path.name} is committed with outputs; clear them")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_offline_with_fast_settings(path, tmp_path, monkeypatch):
  notebook = nbformat.read(path, as_version=4)
  notebook.cells.insert(0, nbformat.v4.new_code_cell(OFFLINE_GUARD))
  for name, value in _kernel_env(tmp_path).items():
    monkeypatch.setenv(name, value)
  client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError with the failing cell's traceback

  figures = sum("image/png" in output.get("data", {})
                for cell in notebook.cells if cell.cell_type == "code"
                for output in cell.outputs)
  assert figures >= MIN_FIGURES[path.stem], (
      f"{path.name} drew {figures} figures; expected at least {MIN_FIGURES[path.stem]}")
