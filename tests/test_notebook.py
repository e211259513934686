"""notebooks/quickstart.ipynb runs top to bottom (CPU, embedded pair, short generations)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import PROGRAM_CACHE_ENV, XLA_FLAGS_OUTSIDE, BackgroundRun

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"
RUN = """
import sys
import nbclient, nbformat
nb = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[3])
"""
# Started when the session has collected the test (conftest.BackgroundRun): the kernel runs beside the tests
# before it. It decodes real weights: XLA's default options, as users get them (not the test processes'
# XLA_FLAGS). 16 new tokens (the smallest shape bucket) per prompt and call: the notebook's four decoding calls
# were most of its time (tests/test_real_pair.py checks longer decodes of the same pair).
EXECUTION = BackgroundRun("test_notebook.py::test_quickstart_notebook_executes",
                          [sys.executable, "-c", RUN, str(NOTEBOOK), "{tmp}", "{tmp}/out.ipynb"],
                          env={**os.environ, "XLA_FLAGS": XLA_FLAGS_OUTSIDE, "DFLASH_MAX_NEW": "16",
                               "JAX_PLATFORMS": "cpu", "DFLASH_JAX_AUTO_COMPACT_RATIO": "inf", **PROGRAM_CACHE_ENV})


def test_quickstart_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    rc, log = EXECUTION.result(timeout=900)
    assert rc == 0, log[-6000:]
    nb = nbformat.read(EXECUTION.tmp / "out.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "falling back to the embedded SmolLM2 pair" in text
    assert "4/4 outputs identical to autoregressive decoding" in text
    assert "12/12 identical to the calls above" in text  # continuous batching
    assert "2/2 identical to its autoregressive decoding" in text  # the int8 target
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1
