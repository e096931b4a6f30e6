"""The package keeps its shape (issue 38): few top-level modules, no import circle, few long functions.

Counted from the source by ``scripts/house_check.py`` (``ast``; nothing imported). When a test here fails, its
message lists what broke the target: put a new module in the package of its role (``bench/``, ``generation/``,
``common/``, a subsystem), move the shared piece of a circle down, or split the long function.
"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _house_check():
    spec = importlib.util.spec_from_file_location("house_check", ROOT / "scripts" / "house_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


house = _house_check()
TOP, CIRCLES, LONG = house.counts()


def test_top_level_modules():
    assert len(TOP) <= house.MAX_TOP_LEVEL, f"{len(TOP)} top-level modules: {', '.join(TOP)}"


def test_no_import_circle():
    assert CIRCLES == [], "import circles: " + "; ".join(" <-> ".join(c) for c in CIRCLES)


def test_few_long_functions():
    assert len(LONG) <= house.MAX_LONG, f"{len(LONG)} functions over {house.LONG} lines: " + ", ".join(
        f"{q} ({n})" for q, n in LONG)


def test_counts_what_it_says(tmp_path):
    """The counter itself, on a small package: a circle through a function-local and a TYPE_CHECKING import, a
    package importing its own submodule (no circle), a long method, a top-level module."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    body = "".join(f"        x = {i}\n" for i in range(house.LONG))
    (pkg / "sub" / "c.py").write_text(f"class C:\n    def m(self):\n{body}")
    top, found, long = house.counts(pkg)
    assert top == ["top"]
    assert found == [["pkg.sub.a", "pkg.sub.b"]]
    assert long == [("pkg.sub.c:C.m", house.LONG + 1)]
