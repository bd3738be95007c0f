"""The capacity search (mesh.replay.capacity) against attainment curves with a known answer,
and `mesh replay --capacity` end to end on a tiny replay."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.cli import main
from mesh.replay.capacity import find_capacity


@given(st.floats(0.05, 500), st.floats(0.05, 500), st.floats(0.01, 0.2))
def test_the_search_brackets_a_monotone_threshold(threshold, start, tol):
    calls = []

    def attainment(rps: float) -> float:
        calls.append(rps)
        return 1.0 if rps <= threshold else 0.5

    found = find_capacity(attainment, start, rel_tol=tol)
    lo, hi = found.bracket
    if threshold < start / 64:
        assert found.rps == 0.0
    elif threshold >= start * 64:
        assert found.rps == pytest.approx(start * 64) and math.isinf(hi)
    else:
        assert lo <= threshold < hi and hi / lo <= 1 + tol + 1e-9 and found.rps == lo
    assert [p[0] for p in found.points] == calls and len(calls) <= 2 * 7 + 40


def test_the_search_refuses_nonsense():
    with pytest.raises(ValueError, match="start rate"):
        find_capacity(lambda r: 1.0, 0.0)
    with pytest.raises(ValueError, match="target"):
        find_capacity(lambda r: 1.0, 1.0, target=1.5)


def test_mesh_replay_capacity_writes_capacity_per_policy(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert main(["replay", "--functions", "3", "--minutes", "1", "--seed", "2", "--policies", "mesh,sllm", "--capacity",
                 "--capacity-tol", "0.5", "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for name in ("mesh", "sllm"):
        m = data[name]
        assert m["capacity_rps"] > 0 and m["capacity_rps_slo_drop"] > 0
        passing = [r for r, a in m["capacity_points"] if a >= 0.9]
        assert max(passing) == pytest.approx(m["capacity_rps"])
    assert "mesh / sllm capacity" in capsys.readouterr().out
