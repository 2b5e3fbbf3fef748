"""The compatibility table of docs/using-with-vllm.md is the one tests/support/compatibility.py
renders, and every row names a test that exists (parameter ids included)."""

from __future__ import annotations

import ast
import os

import compatibility


def test_readme_holds_the_rendered_table():
    text = open(os.path.join(compatibility.REPO, "docs", "using-with-vllm.md")).read()
    assert compatibility.render() in text, "run: python tests/support/compatibility.py --write"


def test_every_row_names_a_test_that_exists():
    for path, func, param in compatibility.test_ids():
        source = open(os.path.join(compatibility.REPO, path)).read()
        tree = ast.parse(source)
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in names, f"{path} has no {func}"
        for value in param.split("-") if param else ():
            assert value in source, f"{path}::{func} has no parameter {value!r}"
