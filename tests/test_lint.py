"""Undefined names, which the ruff config cannot flag: pyflakes reads a jaxtyping shape string
such as ``"batch"`` as an undefined name, so F821 is off in ``pyproject.toml``. Here F821 runs
anyway and every hit outside a string is a real undefined name (an import lost in a move)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))


def _inside_a_string(line: str, col: int) -> bool:
    # an odd number of quotes before the name: it sits in a string (a shape annotation)
    return line[: col - 1].count('"') % 2 == 1


@pytest.mark.skipif(
    not Path(RUFF).exists(), reason="ruff is not installed (pip install -e '.[dev]')"
)
def test_no_undefined_names_outside_shape_strings():
    cmd = [RUFF, "check", "--select", "F821", "--output-format", "json", "--exit-zero", "."]
    found = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout)
    real = []
    for hit in found:
        path = Path(hit["filename"])
        line = path.read_text().splitlines()[hit["location"]["row"] - 1]
        if not _inside_a_string(line, hit["location"]["column"]):
            real.append(f"{path.relative_to(ROOT)}:{hit['location']['row']}: {hit['message']}")
    assert not real, "\n".join(real)


def test_the_string_rule():
    assert _inside_a_string('x: Int[Tensor, "batch pos"]', 17)
    assert not _inside_a_string("y = resolve_device(d)", 5)
