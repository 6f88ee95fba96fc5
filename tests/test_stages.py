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


# -- no mechanism recognised by its name outside its registry and stage ------------------------

WORKBENCH = RUNTIME.parent
#: knobs whose value names a mechanism (a registry entry or a setting of one) → the modules
#: that may compare it with a name: the mechanism's own registry, knob group and stage
MECHANISM_KNOBS = {
    "eviction": {"policies/eviction.py"},
    "prefetch": {"policies/prefetch.py", "predictor/policy.py"},
    "transfer_order": {"sim/lane.py"},
    "placement": {"sim/placement.py"},
    "dispatch": {"sim/dispatch.py", "sim/macs.py", "runtime/stages/dispatch.py"},
    "balance": {"sim/realb.py", "runtime/stages/balance.py"},
    "compression": {"compression/policies.py", "compression/placement.py",
                    "runtime/stages/compression.py"},
    "predictor": {"predictor/knobs.py", "predictor/policy.py", "predictor/live.py"},
    "low_precision": {"precision.py"},
    "macs_selection": {"sim/macs.py"},
    "prism_router": {"prism/execute.py", "prism/finetune.py", "prism/knobs.py"},
}
#: comparisons left in modules other work owns (issue 38): their number may only fall (none
#: left now: the dashboard's views and the replay engine ask declarations too)
KNOWN_LEFT: dict[str, int] = {}


def _knob_named(node: ast.AST) -> str | None:
    """The mechanism knob an expression reads (``k.dispatch``, ``dispatch``, ``k["dispatch"]``,
    ``k.get("dispatch")``, ``getattr(k, "dispatch", …)``), or None."""
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = node.slice.value
    elif isinstance(node, ast.Call) and node.args:
        func = node.func
        getter = ((isinstance(func, ast.Attribute) and func.attr == "get")
                  or (isinstance(func, ast.Name) and func.id == "getattr"))
        arg = node.args[1 if isinstance(func, ast.Name) else 0] if getter and (
            isinstance(func, ast.Attribute) or len(node.args) > 1) else None
        name = arg.value if isinstance(arg, ast.Constant) else None
    else:
        return None
    return name if name in MECHANISM_KNOBS else None


def _names(node: ast.AST) -> bool:
    """Whether ``node`` is a string literal, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def name_comparisons() -> dict[str, list[str]]:
    """Per module of ``workbench/`` (relative path): each comparison (``==``, ``!=``, ``in``,
    ``not in``) of a mechanism knob's value with a literal name, outside the modules that own
    that knob (:data:`MECHANISM_KNOBS`)."""
    found: dict[str, list[str]] = {}
    for path in sorted(WORKBENCH.rglob("*.py")):
        rel = path.relative_to(WORKBENCH).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for a, b in zip(sides, sides[1:]):
                knob = _knob_named(a) or _knob_named(b)
                if knob and rel not in MECHANISM_KNOBS[knob] and (_names(a) or _names(b)):
                    found.setdefault(rel, []).append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mechanism_is_recognised_by_its_name_outside_its_registry_and_stage():
    """A rule that depends on what a mechanism does asks its registry entry (a declaration:
    ``fetches``, ``dynamic``, ``per_rank``, ``live_only_knobs``, ``semantic_floor``…), never
    its name. The scan sees comparisons of a knob-named expression with literal names; a name
    held in a variable of another name escapes it."""
    found = name_comparisons()
    left = {m: len(found.pop(m, [])) for m in KNOWN_LEFT}
    assert not found, found
    assert all(left[m] <= n for m, n in KNOWN_LEFT.items()), left


def test_the_scan_sees_each_way_of_naming_a_mechanism():
    forms = ['k.dispatch == "macs"', 'dispatch != "topk"', 'k["placement"] == "eplb"',
             'k.get("prefetch") == "vismmoe"', 'getattr(k, "balance", "none") != "none"',
             'k.eviction in ("lru", "belady")']
    for form in forms:
        node = ast.parse(form).body[0].value
        sides = [node.left, *node.comparators]
        assert _knob_named(sides[0]) and _names(sides[1]), form
    assert _knob_named(ast.parse("k.top_k").body[0].value) is None


# -- token compression is a stage; policies are built from their knob groups --------------------


def test_token_compression_is_a_stage_off_without_pruning_or_visual_tokens():
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from workbench.errors import InputError
    from workbench.knobs import Knobs
    from workbench.runtime.stages import RunContext, TokenCompression

    assert STAGES[0] is TokenCompression  # the stages after it read its placement
    run = RunContext(SimpleNamespace(lm=None), None, torch.device("cpu"),
                     inputs=SimpleNamespace(modality=np.zeros(5, np.int8)))
    for comp in ("none", "random", "saliency", "affinity"):
        k = Knobs(compression=comp)
        assert TokenCompression.from_knobs(k, run) is None  # text only (or none): off
        TokenCompression.check_requests(k, 1)
        if comp == "none":
            TokenCompression.check_requests(k, 3)
        else:
            with pytest.raises(InputError, match="needs compression='none'"):
                TokenCompression.check_requests(k, 3)
    assert TokenCompression.from_setup(_setup()) is None  # the keyword path: `pruning` given
    for cls in STAGES:  # the attributes are written whatever the stages
        assert isinstance(cls.store_attrs(SimpleNamespace(
            visual_tokens=0, kept_visual_tokens=0, compression_select_s=0.0,
            compression_saliency_s=0.0)), dict)
        off = cls.store_attrs(SimpleNamespace(
            visual_tokens=0, kept_visual_tokens=0, compression_select_s=0.0,
            compression_saliency_s=0.0, prism_kernel=None))
        assert isinstance(off, dict) and "prism_kernel_run" not in off


def test_a_prism_setup_given_auto_gets_the_kernel_the_knob_would():
    """The keyword path (``Offloader(prism=PrismSetup(kernel="auto"))``) resolves ``auto`` as
    a run's knobs do: per-subexpert for wide experts with sub-experts skipped on the CPU,
    fused with ReaLB's controller or at k_active = N."""
    from workbench.prism.execute import PrismSetup
    from workbench.runtime.stages.subexperts import SubExpertStage

    def kernel(width, k_active=2, **kw):
        ps = PrismSetup(torch.zeros(1, 4, width, dtype=torch.long), torch.zeros(1, 4, 4, 1),
                        4, k_active, kernel="auto")
        return SubExpertStage.from_setup(_setup(prism=ps, **kw)).prism.kernel

    assert kernel(256) == "per-subexpert" and kernel(64) == "fused"
    assert kernel(256, k_active=4) == "fused"
    assert kernel(256, balance=object()) == "fused"


def test_policies_from_their_knob_groups_equal_the_signature_matched_ones():
    """``from_knobs`` (typed, each policy reads its group) builds what ``create(name,
    **knobs.to_dict())`` (the knobs its ``__init__`` declares) did, on non-default knobs."""
    from workbench.compression.policies import COMPRESSION
    from workbench.knobs import Knobs
    from workbench.policies.eviction import EVICTION

    k = Knobs(hotness_decay=0.7, hotness_window=5, window=3, decay=0.5, alpha=0.2, beta=0.6,
              lam=1.5, seed=7)
    for registry in (EVICTION, PREFETCH, COMPRESSION):
        for name in registry.available():
            typed = registry.get(name).from_knobs(k)
            matched = registry.create(name, **k.to_dict())
            assert type(typed) is type(matched), name
            assert vars(typed).keys() == vars(matched).keys(), name
            for attr, value in vars(matched).items():
                if isinstance(value, (int, float, str, bool, type(None))):
                    assert getattr(typed, attr) == value, (name, attr)


def test_the_declarations_that_replaced_the_names():
    from workbench.compression.policies import COMPRESSION
    from workbench.knobs import Knobs
    from workbench.sim.placement import EP_PLACEMENT

    assert [n for n in EP_PLACEMENT.available() if EP_PLACEMENT.get(n).dynamic] == ["eplb"]
    assert [n for n in PREFETCH.available() if not PREFETCH.get(n).fetches] == ["none"]
    for comp in COMPRESSION.available():
        for lam in (0.0, 2.0):  # the rule it replaced: 1 for affinity with λ > 0
            assert Knobs(compression=comp, lam=lam).semantic_floor() == int(
                comp == "affinity" and lam > 0), (comp, lam)
    ep = Knobs(dispatch="macs").group("ep")
    assert DISPATCH.get("macs").live_only_knobs(ep) == ["macs_semantic_load", "macs_reroute"]
    assert all(DISPATCH.get(n).live_only_knobs(ep) == [] for n in DISPATCH.available()
               if n != "macs")
