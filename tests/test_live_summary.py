"""`python -m mesh.bench.live_summary` (issue 31 item 6): live replays over seeds and
repeats as minimum / median / maximum, live and twin, with the gaps the issue bounds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.bench.live_summary import main, read_run, summary


def _run(folder: Path, rig: str, policy: str, seed: int, repeat: int, served: int, twin_served: int,
         requests: int = 100) -> Path:
    name = f"live_rig-{rig}_{policy.replace('+', '-')}_s{seed}_r{repeat}.json"
    twin = {"slo_rate": twin_served / requests, "cpu_nodes_avg": 1.2}
    data = {"live": {"policy": policy, "requests": requests, "slo_compliant": served, "slo_rate": served / requests,
                     "cpu_nodes_avg": 1.0, "gpu_nodes_avg": 0.5},
            "simulated": {"slo_rate": 0.0}, "simulated_by_policy": {policy: twin, "other": {"slo_rate": 0.0}}}
    path = folder / name
    path.write_text(json.dumps(data))
    return path


def test_runs_are_summarised_per_rig_and_policy_with_the_twin_of_the_same_policy(tmp_path, capsys):
    paths = [_run(tmp_path, "plain", "mesh", 0, 1, 90, 92), _run(tmp_path, "plain", "mesh", 0, 2, 84, 90),
             _run(tmp_path, "plain", "mesh", 1, 1, 96, 95), _run(tmp_path, "plain", "sllm+cpu", 0, 1, 91, 88),
             _run(tmp_path, "plain", "sllm+cpu", 0, 2, 70, 88)]
    runs = [read_run(p) for p in paths]
    assert runs[0].policy == "mesh" and runs[0].twin_pct == pytest.approx(92.0)  # its own policy's twin
    table = summary(runs)
    assert "| plain | mesh | 3 | 84.0 / 90.0 / 96.0 | 90.0 / 92.0 / 95.0 | 6.0 | 6.0 | 1.50 / 1.20 |" in table
    assert "| plain | sllm+cpu | 2 | 70.0 / 80.5 / 91.0 | 88.0 / 88.0 / 88.0 | 18.0 | 21.0 | 1.50 / 1.20 |" in table
    assert "in 1 of 2 paired runs" in table  # seed 0 repeat 1: 90 < 91; repeat 2: 84 >= 70
    assert main([*map(str, paths), str(tmp_path / "live_other.json")]) == 0
    out = capsys.readouterr()
    assert "skipped" in out.err and "| plain | mesh |" in out.out
    assert main([]) == 2


def test_first_requests_of_models_registered_a_minute_ahead_are_checked_against_their_ttft_slo(tmp_path):
    """Issue 31 item 3: a model's first request that arrives at least LEAD_S after the
    replay registered it must get its first token within its TTFT SLO; earlier ones are a
    cold start nobody could hide and are not counted."""
    def req(model: str, at: float, ttft: float | None, outcome: str = "completed") -> dict:
        return {"model": model, "arrival_s": at, "ttft_s": ttft, "ttft_slo_s": 2.0, "outcome": outcome}

    path = _run(tmp_path, "plain", "mesh", 0, 1, 90, 92)
    data = json.loads(path.read_text())
    data["live"]["requests_detail"] = [
        req("a", 4.0, 15.0),            # cold, registered 4 s before: not counted
        req("b", 81.0, 0.2), req("b", 70.0, 3.5),  # b's first is the one at 70 s: late
        req("c", 90.0, None, "rejected"),  # turned away: late
        req("d", 120.0, 1.9),           # within its SLO
    ]
    path.write_text(json.dumps(data))
    run = read_run(path)
    assert run.firsts == 3
    assert run.late_firsts == ("b at 70 s: TTFT 3.50 s (SLO 2.0 s)", "c at 90 s: rejected (SLO 2.0 s)")
    table = summary([run])
    assert "registered at least 60 s before them: 1 of 3 within their TTFT SLO" in table
    assert "- late: plain mesh seed 0 repeat 1: b at 70 s: TTFT 3.50 s" in table
