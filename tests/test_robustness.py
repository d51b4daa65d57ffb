"""Every unusual or bad input of benchmarks/robustness.py gets a correct result or a one-line typed
error: never a traceback, never a silently wrong result (issue 9)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "robustness", Path(__file__).resolve().parents[1] / "benchmarks" / "robustness.py")
robustness = importlib.util.module_from_spec(_SPEC)
sys.modules["robustness"] = robustness
_SPEC.loader.exec_module(robustness)


def test_every_input_is_handled_or_refused_in_one_line(tmp_path):
    cases = robustness.cases(tmp_path)
    assert len(cases) >= 90
    rows = [robustness.run(c) for c in cases]
    bad = [r for r in rows if r.outcome not in ("ok", "refused")]
    assert not bad, "\n".join(f"{r.area} | {r.case} | {r.outcome} | {r.detail}" for r in bad)
    assert sum(r.outcome == "ok" for r in rows) >= 12  # the valid inputs really ran and matched


def test_a_silently_wrong_result_is_reported_as_such(tmp_path):
    """The table's classification is not vacuous: a case whose result differs from eager is WRONG,
    a bad input that is accepted is WRONG, and an untyped exception is a CRASH."""
    def differs():
        raise robustness._Wrong("differs from eager PyTorch")

    assert robustness.run(("valid", "x", differs)).outcome == "WRONG"
    assert robustness.run(("place", "bad input accepted", lambda: None)).outcome == "WRONG"
    assert robustness.run(("place", "internal error", lambda: {}["x"])).outcome == "CRASH"
