"""Every command of the README's ```bash blocks is known to a test, and every ``plan`` flag has a
README example; the ``plan`` examples run to the end (the commands that start processes:
``tests/dist/test_readme.py``)."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.helpers import ROOT, run_cli

README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """Each command of the README's ```bash blocks: continuation lines joined, comments dropped."""
    commands: list[str] = []
    in_block, pending = False, ""
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_block = line.strip() == "```bash"
            continue
        if not in_block:
            continue
        code = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        code = " ".join((pending + code).split())
        pending = ""
        if code:
            commands.append(code)
    return commands


def cli_commands(name: str) -> list[list[str]]:
    """The README's ``zero-functional NAME ...`` lines, as argument lists after the program."""
    out = []
    for command in readme_commands():
        argv = shlex.split(command)
        if argv[0] == "zero-functional" and argv[1] == name:
            out.append(argv[1:])
    return out


KNOWN = (
    "make demo",  # test_make_demo_runs_to_the_end
    "make test",  # the run this test is part of (.ci/run calls it)
    "zero-functional ",  # the test per command below
    "torchrun ",  # test_the_two_node_torchrun_example_runs_on_one_machine
    "PYTHONPATH=src python3 benchmarks/gpu_check.py",  # tests/dist/test_gpu_check.py, make bench
)


def test_every_readme_command_is_run_by_a_test() -> None:
    commands = readme_commands()
    assert commands, "no ```bash block found in README.md"
    unknown = [c for c in commands if not c.startswith(KNOWN)]
    assert not unknown, f"README commands no test runs: {unknown}"
    assert cli_commands("demo") and cli_commands("train") and cli_commands("plan")


def test_every_plan_flag_has_a_readme_example() -> None:
    from zero_functional.app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    plan = sub.choices["plan"]  # type: ignore[attr-defined]
    flags = {o for a in plan._actions for o in a.option_strings if o.startswith("--")}
    flags -= {"--help"}
    shown = {a for argv in cli_commands("plan") for a in argv if a.startswith("--")}
    assert flags <= shown, f"plan flags with no README example: {sorted(flags - shown)}"
    assert any(":" in argv[1] for argv in cli_commands("plan")), "no module:function example"


@pytest.mark.parametrize("argv", cli_commands("plan"), ids=" ".join)
def test_readme_plan_example_runs_to_the_end(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err[-3000:]
    model = argv[1]
    assert out.startswith(f"{model}: "), out[:200]
    if "--dtype" in argv:
        assert "main copy" in out
    if "--shard-size" in argv:
        assert "within" in out and "across" in out
    if "--simulate" in argv:
        assert re.search(r"^\s+1024\s+1023\s", out, re.MULTILINE)
