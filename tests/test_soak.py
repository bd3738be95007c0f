"""`mesh bench soak` for 3 minutes (issue 32 item 7): a real service (`mesh serve --demo
--cpu-nodes 2`, real agents and the OpenVINO engine) under churn: streaming tenants, models
registered and deleted in loops (several churn tenants; some deleted at once, some once
described, some after serving), clients hanging up, an agent other than the spare one killed
each minute. No request may be lost and no model state left behind, after any cycle or at the
end (admin API, cluster, agents' stats)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_a_three_minute_soak_loses_nothing_and_leaves_nothing_behind(tmp_path, demo_gguf):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "mesh", "bench", "soak", "--minutes", "3", "--kill-every", "60",
           "--sample-every", "5", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    print(proc.stdout[-3000:])
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    figures, left = result["figures"], result["left_behind"]
    assert figures["lost"] == 0, result["lost"]
    assert left["clean"], left
    assert figures["cycles_left_behind"] == 0, [c for c in result["cycles"] if c["clean_s"] is None]
    assert figures["outcome_ok"] > 0 and figures["register_delete_cycles"] > 0
    assert all(figures["cycles_by_kind"].values()), figures["cycles_by_kind"]  # each kind of cycle ran
    assert len({c["tenant"] for c in result["cycles"]}) > 1  # several churn loops
    assert figures["churn_models_served"] > 0  # some churn models did start an instance
    assert figures["agent_kills"] >= 2 and not any(k.startswith("cpu-0 ") for k in result["kills"])
    assert isinstance(figures["agent cpu-0 rss growth %"], float)  # the spare agent lived the whole run
    assert len([p for p in result["processes"] if p["role"] == "agent cpu-1"]) >= 3  # each incarnation
    assert figures["requests"] == sum(v for k, v in figures.items() if k.startswith("outcome_"))
    assert {s["role"] for s in result["samples"]} >= {"service", "agent cpu-0", "agent cpu-1"}
    assert proc.returncode == 0, proc.stderr[-3000:]
