"""The floors of the package (issue 45): every import points down the layers of ``pyproject.toml``'s import-linter
contract, function-local imports included; the contract fails when an upward import is added; docs/architecture.md
lists the same floors; and an independent count (``scripts/house_check.py --floors``) finds no arrow up.
"""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _contract() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["id"] == "floors")


def _lint(cwd: Path, src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``src`` with the contract of ``cwd/pyproject.toml``."""
    if not LINT.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(src), "PATH": str(LINT.parent)})


def test_the_floors_contract_is_kept():
    r = _lint(ROOT, ROOT / "src")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("where", ["module", "function"])
def test_an_upward_import_breaks_the_contract(tmp_path, where):
    """A copy of the package with one import from ``core`` up to ``cli`` — at module level, or hidden inside a
    function — fails the same contract, naming the arrow."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "moe_offload", src / "moe_offload",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    body = ("from ..cli.args import positive_int  # noqa\n" if where == "module" else
            "def f():\n    from ..cli.args import positive_int  # noqa\n    return positive_int\n")
    (src / "moe_offload" / "core" / "upward.py").write_text(body)
    r = _lint(tmp_path, src)
    assert r.returncode != 0 and "BROKEN" in r.stdout
    assert "moe_offload.core is not allowed to import moe_offload.cli" in r.stdout
    assert "moe_offload.core.upward -> moe_offload.cli.args" in r.stdout


def test_architecture_doc_lists_the_contract_floors():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- floors:", 1)[1].split("<!-- /floors -->", 1)[0]
    listed = re.findall(r"^\d+\. `([^`]+)`", block, flags=re.M)
    assert listed == _contract()["layers"]


def _house():
    spec = importlib.util.spec_from_file_location("house_check", ROOT / "scripts" / "house_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_independent_count_finds_no_upward_import():
    house = _house()
    layers = _contract()["layers"]
    assert house.upward_imports(layers) == []


def test_the_count_sees_function_local_imports(tmp_path):
    """The counter on a small package: a module-level and a function-local import up a floor are both counted, and
    one between the independent packages of a floor written ``a | b``; one down is not."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "high", "left", "right"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from ..high import b\n\ndef f():\n    from ..high.b import g\n")
    (pkg / "high" / "b.py").write_text("from ..low import a\n\ndef g():\n    pass\n")
    (pkg / "left" / "c.py").write_text("from ..right import d\n")
    (pkg / "right" / "d.py").write_text("")
    found = _house().upward_imports(["left | right", "high", "low"], pkg)
    assert found == [("pkg.left.c", "pkg.right.d", 1), ("pkg.low.a", "pkg.high.b", 1), ("pkg.low.a", "pkg.high.b", 4)]
