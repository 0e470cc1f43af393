"""The folders that show the layers: the house rules hold on the tree, and they catch what they
promise to catch."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from tests.helpers import ROOT

RULES = ROOT / ".ci" / "rules.py"


def load_rules():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("house_rules", RULES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_top_level_holds_only_the_faces_and_the_folders() -> None:
    top = sorted(p.name for p in (ROOT / "src" / "zero_functional").iterdir())
    modules = [n for n in top if n.endswith(".py")]
    # the faces, and the EMA: a client of the optimizer beside checkpoint/ (layer 5)
    assert modules == ["__init__.py", "__main__.py", "ema.py", "hooks.py", "optimizer.py"]
    for folder in ("app", "checkpoint", "comm", "core", "functional", "integrations", "shell"):
        assert (ROOT / "src" / "zero_functional" / folder / "__init__.py").exists(), folder


def test_the_house_rules_hold_on_the_tree() -> None:
    assert load_rules().check() == []


def write_module(root: Path, dotted: str, text: str) -> Path:
    path = root / (dotted.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_layer_rule_catches_an_upward_import_a_shell_import_from_app_and_a_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rules = load_rules()
    src = tmp_path / "src" / "zero_functional"
    monkeypatch.setattr(rules, "ROOT", tmp_path)
    monkeypatch.setattr(rules, "SRC", src)
    files = [
        write_module(tmp_path / "src", "zero_functional.__init__", ""),
        write_module(
            tmp_path / "src", "zero_functional.core.a", "from zero_functional.comm import x\n"
        ),
        write_module(tmp_path / "src", "zero_functional.comm.__init__", "x = 1\n"),
        write_module(tmp_path / "src", "zero_functional.shell.s", "import torch\n"),
        write_module(
            tmp_path / "src", "zero_functional.app.b", "from zero_functional.shell import s\n"
        ),
        write_module(
            tmp_path / "src", "zero_functional.app.c", "from zero_functional.app import d\n"
        ),
        write_module(
            tmp_path / "src", "zero_functional.app.d", "from zero_functional.app import c\n"
        ),
        write_module(
            tmp_path / "src",
            "zero_functional.core.e",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zero_functional.app import b\n",
        ),
    ]
    problems = rules.check_layers(files)
    text = "\n".join(problems)
    assert "core imports zero_functional.comm, a layer above it" in text
    assert "app/ imports zero_functional.shell.s" in text
    assert "import cycle: zero_functional.app.c <-> zero_functional.app.d" in text
    assert "core/e.py" not in text  # an annotation is not an arrow
    assert len(problems) == 3, problems


def test_the_facade_rule_catches_a_shell_module_that_names_the_optimizer_in_code_only() -> None:
    import ast

    rules = load_rules()
    named = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zero_functional.optimizer import ZeroRedundancyOptimizer\ndef f(z: 'ZeroRedundancyOptimizer') -> None: ...\n"
    prose = '"""Serves a ZeroRedundancyOptimizer."""\nMESSAGE = "build a ZeroRedundancyOptimizer"\n'
    assert rules.facade_lines(ast.parse(named)) == [3, 4]
    assert rules.facade_lines(ast.parse(prose)) == []
