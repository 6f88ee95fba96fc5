"""The layer stages (workbench.runtime.stages) and the runtime's shape: every stage is off
unless its feature is on, the interception point and the executor name no mechanism, and the
runtime's modules and functions stay small (issue 38)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from workbench.models.adapter import find_moe_blocks
from workbench.models.tiny import tiny_model
from workbench.policies.prefetch import PREFETCH
from workbench.runtime.stages import STAGES, StageSetup, build
from workbench.sim.costs import Prices
from workbench.sim.dispatch import DISPATCH
from workbench.sim.profiles import get_profile

RUNTIME = Path(__file__).resolve().parents[1] / "workbench" / "runtime"


def _setup(**kw) -> StageSetup:
    layout = find_moe_blocks(tiny_model("mixtral"))
    return StageSetup(layout, 1, Prices(get_profile("a100-40gb"), None), torch.device("cpu"),
                      **kw)


def test_every_stage_is_off_by_default_and_each_turns_on_alone():
    assert build(_setup()) == []
    on = {"dispatch": DISPATCH.create("capacity-drop"), "lookahead_depth": 1,
          "dynamic_topk": True, "hybrid": True}
    for knob, value in on.items():
        stages = build(_setup(**{knob: value}))
        assert len(stages) == 1, knob
    assert build(_setup(dispatch=DISPATCH.create("topk"))) == []  # topk: the router's choice
    assert [type(s) for s in build(_setup(**on))] == [
        c for c in STAGES if c.__name__ in {"DynamicTopK", "DispatchStage", "Lookahead",
                                            "HostRuns"}]


def test_the_interception_point_and_the_executor_name_no_mechanism():
    names = set(DISPATCH.available()) | set(PREFETCH.available())
    names -= {"none", "topk"}
    for module in ("offload.py", "executor.py"):
        tree = ast.parse((RUNTIME / module).read_text())
        literals = {n.value for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not literals & names, (module, literals & names)


def test_runtime_modules_and_functions_stay_small():
    for path in sorted(RUNTIME.rglob("*.py")):
        text = path.read_text()
        assert text.count("\n") <= 500, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, (path, node.name)
