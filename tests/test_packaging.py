"""Set-up files agree with each other and with the README."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _conda_pip() -> list[str]:
    lines, inside = [], False
    for line in (REPO / "environment.yml").read_text().splitlines():
        if line.strip() == "- pip:":
            inside = True
            continue
        if inside and line.strip().startswith("- "):
            lines.append(line.strip()[2:])
    return [l for l in lines if not l.startswith("-e")]


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    proj = _pyproject()
    wanted = proj["dependencies"] + proj["optional-dependencies"]["test"]
    conda = _conda_pip()
    assert {_name(r) for r in conda} == {_name(r) for r in wanted}
    # same version constraints, except torch, which conda pins to the CPU build
    spec = {_name(r): r.replace(" ", "") for r in wanted}
    for r in conda:
        if _name(r) != "torch":
            assert r.replace(" ", "") == spec[_name(r)], r
    assert "torch==2.13.0" in conda


def test_readme_gives_two_setup_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme.split("## Fresh machine")[1], re.S)
    cmds = [b.strip() for b in blocks[:2]]
    assert len(cmds) == 2
    assert "torch==2.13.0" in cmds[0] and "panel serve apps/dashboard.py" in cmds[0]
    assert "--address 127.0.0.1" in cmds[0]
    assert "torch==2.13.0" in cmds[1] and "pytest" in cmds[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert cmds[1] in ci, "the CI script must run the README's test command verbatim"


def test_the_suite_keeps_its_scratch_in_a_directory_of_its_own(tmp_path):
    """conftest's ``pytest_sessionstart``: this process's scratch (``tempfile``, and every
    subprocess and notebook kernel through ``TMPDIR``) lives in a ``wb-suite-*`` directory
    removed when the session ends; pytest's own base folder (``tmp_path``) is outside it,
    under pytest's retention, and a passing test's ``tmp_path`` goes as it ends (a CI run
    once died of a full disk)."""
    import os
    import subprocess
    import sys
    import tempfile

    here = Path(tempfile.gettempdir())
    assert here.name.startswith("wb-suite-") and here.is_dir()
    assert os.environ["TMPDIR"] == str(here)
    assert not tmp_path.resolve().is_relative_to(here.resolve())
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.strip() == str(here)
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["tmp_path_retention_policy"] == "failed"
