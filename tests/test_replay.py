"""`mesh replay` end to end on tiny synthetic Azure-format traces, and its bad-input errors."""
import json
from pathlib import Path

import pytest

from mesh.cli import main
from mesh.commands import replay as replay_cmd
from mesh.replay.metrics import node_seconds, usage_per_second

REQUIRED = ("requests", "slo_compliant", "slo_rate", "rejected", "failed", "cpu_nodes_avg", "gpu_nodes_avg",
            "ttft_p99_s", "tpot_p99_s", "wall_s")


@pytest.fixture
def traces(tmp_path: Path) -> tuple[Path, Path]:
    """5 functions x 3 minutes (Azure Functions 2019 format) and 40 length rows (Azure LLM 2023)."""
    trace = tmp_path / "functions.csv"
    rows = ["HashOwner,HashApp,HashFunction,Trigger,1,2,3"]
    counts = [(20, 30, 10), (4, 0, 6), (0, 2, 0), (9, 9, 9), (1, 1, 1)]
    rows += [f"o{i},a{i},f{i},http,{a},{b},{c}" for i, (a, b, c) in enumerate(counts)]
    trace.write_text("\n".join(rows) + "\n")
    lengths = tmp_path / "lengths.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{k:02d}.000000,{100 + 37 * k},{5 + (k * 7) % 60}" for k in range(40)]
    lengths.write_text("\n".join(lines) + "\n")
    return trace, lengths


def replay(traces, *extra: str) -> int:
    trace, lengths = traces
    return main(["replay", "--trace", str(trace), "--lengths", str(lengths), "--no-progress", *extra])


def test_end_to_end_json_table_and_figures(traces, tmp_path, capsys):
    out = tmp_path / "r.json"
    figs = tmp_path / "figs"
    assert replay(traces, "--functions", "4", "--minutes", "2", "--json", str(out), "--plot", str(figs),
                  "--rate-scale", "0.5") == 0
    printed = capsys.readouterr().out
    assert "policy" in printed and "sllm+cpu" in printed and "TTFT p50" in printed
    data = json.loads(out.read_text())
    assert list(data) == ["mesh", "sllm", "sllm+cpu"]
    for name, m in data.items():
        for key in REQUIRED:
            assert key in m, (name, key)
        assert m["requests"] == m["slo_compliant"] + m["slo_violating"] + m["rejected"] + m["failed"]
        assert m["requests"] == data["mesh"]["requests"] > 0
        assert 0 <= m["slo_rate"] <= 1 and m["replay"]["functions"] == 4
    assert data["sllm"]["cpu_nodes_avg"] == 0  # GPU nodes only
    assert (figs / "ttft_cdf.png").stat().st_size > 1000 and (figs / "node_usage.png").stat().st_size > 1000


def test_mix_ablations_and_small_cluster(traces, tmp_path):
    out = tmp_path / "r.json"
    assert replay(traces, "--functions", "5", "--minutes", "1", "--mix", "4:1:1", "--cpu-nodes", "2",
                  "--gpu-nodes", "1", "--policies", "mesh-no-share,mesh-no-cpu,mesh-no-defrag",
                  "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["mesh-no-cpu"]["cpu_nodes_avg"] == 0
    assert data["mesh-no-share"]["replay"]["models"] == {"llama-3.2-3b": 4.0, "llama-2-7b": 1.0, "llama-2-13b": 1.0}
    for m in data.values():
        assert m["requests"] == m["slo_compliant"] + m["slo_violating"] + m["rejected"] + m["failed"]
        assert m["cpu_nodes_max"] <= 2 and m["gpu_nodes_max"] <= 1


def error_of(capsys) -> str:
    return capsys.readouterr().err


def test_malformed_trace_names_file_and_line(traces, capsys):
    trace, lengths = traces
    trace.write_text(trace.read_text().replace("o3,a3,f3,http,9,9,9", "o3,a3,f3,http,9,x,9"))
    assert replay(traces, "--functions", "2", "--minutes", "1") == 2
    err = error_of(capsys)
    assert str(trace) in err and "line 5" in err and "integer" in err


def test_malformed_lengths_names_file_and_line(traces, capsys):
    trace, lengths = traces
    lengths.write_text(lengths.read_text().replace(",137,", ",-137,"))
    assert replay(traces, "--functions", "2", "--minutes", "1") == 2
    err = error_of(capsys)
    assert str(lengths) in err and "line 3" in err


def test_malformed_profile_names_file_and_line(traces, tmp_path, capsys):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "llama-2-7b__xeon-6462c.json").write_text('{"format": "mesh-profile/1",\n  "model": }\n')
    assert replay(traces, "--profiles", str(profiles)) == 2
    err = error_of(capsys)
    assert "llama-2-7b__xeon-6462c.json" in err and "line 2" in err


def test_unknown_policy_and_model_list_the_valid_ones(traces, capsys):
    assert replay(traces, "--policies", "mesh,vllm") == 2
    assert "unknown policy 'vllm'" in (err := error_of(capsys)) and "sllm+cpu" in err and "mesh-no-defrag" in err
    assert replay(traces, "--model", "gpt-2") == 2
    assert "unknown model 'gpt-2'" in (err := error_of(capsys)) and "llama-2-13b" in err and "llama-3.2-3b" in err
    assert replay(traces, "--mix", "4:1") == 2
    assert "3B:7B:13B" in error_of(capsys)


def test_impossible_clusters_are_refused_before_the_run(traces, capsys):
    assert replay(traces, "--cpu-nodes", "0", "--gpu-nodes", "0") == 2
    assert "no nodes" in error_of(capsys)
    assert replay(traces, "--gpu-nodes", "0", "--policies", "sllm") == 2
    assert "policy sllm uses only GPU nodes" in error_of(capsys)
    assert replay(traces, "--cpu-nodes", "0", "--gpu-memory-gib", "12", "--model", "llama-2-13b") == 2
    err = error_of(capsys)
    assert "model llama-2-13b fits no node" in err and "of 12 GiB" in err


def test_missing_data_folder_says_to_pass_the_files(monkeypatch, capsys):
    monkeypatch.setattr(replay_cmd, "default_data_dir", lambda: None)
    assert main(["replay", "--no-progress"]) == 2
    err = error_of(capsys)
    assert "--trace" in err and "--lengths" in err and "workloads/data" in err


def test_node_usage_integral():
    usage = [(0.0, 0, 0), (1.0, 1, 0), (3.0, 2, 1), (4.0, 0, 0)]
    assert node_seconds(usage, 0.0, 5.0) == (1 * 2 + 2 * 1, 1.0)
    assert node_seconds(usage, 2.0, 3.5) == (1 + 1.0, 0.5)
    assert usage_per_second(usage, 4.0) == {"t": [0, 1, 2, 3, 4], "cpu": [0, 1, 1, 2, 0], "gpu": [0, 0, 0, 1, 0]}


def test_weights_option_changes_cold_starts(traces, tmp_path):
    """--weights ssd loads 7B weights at 3 GB/s (4.5 s) where the paper's cached setup copies
    them from host memory at 25 GB/s (0.54 s): the first requests of every new instance wait
    that much longer."""
    p99 = {}
    for mode in ("cached", "ssd", "multicast-live"):
        out = tmp_path / f"{mode}.json"
        assert replay(traces, "--functions", "4", "--minutes", "2", "--policies", "sllm", "--weights", mode,
                      "--json", str(out)) == 0
        m = json.loads(out.read_text())["sllm"]
        assert m["replay"]["cluster"]["weights"] == mode
        assert m["requests"] == m["slo_compliant"] + m["slo_violating"] + m["rejected"] + m["failed"]
        p99[mode] = m["ttft_p99_s"]
    assert p99["ssd"] > p99["cached"] + 2.0
    assert p99["multicast-live"] < p99["ssd"]


def test_deadline_rule_is_an_option_and_the_output_names_it(traces, tmp_path, capsys):
    """--deadlines pace: every policy's JSON and the table say so; Eq. 1 is the default."""
    out = tmp_path / "r.json"
    args = ("--functions", "4", "--minutes", "2", "--rate-scale", "0.5", "--policies", "mesh,sllm")
    assert replay(traces, *args, "--deadlines", "pace", "--json", str(out)) == 0
    assert "deadline rule: pace" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for m in data.values():
        assert m["deadlines"] == "pace" and m["replay"]["deadlines"] == "pace"
        assert m["replay"]["cluster"]["deadlines"] == "pace"
        assert m["requests"] == m["slo_compliant"] + m["slo_violating"] + m["rejected"] + m["failed"]
    assert replay(traces, *args, "--json", str(out)) == 0
    assert "deadline rule: eq1" in capsys.readouterr().out
    assert all(m["deadlines"] == "eq1" for m in json.loads(out.read_text()).values())
    with pytest.raises(SystemExit) as e:
        replay(traces, *args, "--deadlines", "strict")
    assert e.value.code == 2 and "invalid choice: 'strict'" in capsys.readouterr().err


def test_a_node_lost_during_a_replay_is_counted_by_cause(traces, tmp_path, capsys):
    """`--fail-node`: the node's requests go back with their progress (tests/test_replay_node_loss.py);
    the JSON counts them lost, resumed and failed by cause."""
    out = tmp_path / "r.json"
    assert replay(traces, "--functions", "4", "--minutes", "2", "--policies", "mesh", "--cpu-nodes", "2",
                  "--gpu-nodes", "1", "--fail-node", "cpu0@20+2", "--fail-node", "gpu0@40", "--json", str(out)) == 0
    m = json.loads(out.read_text())["mesh"]
    assert set(m["lost_by_cause"]) <= {"exited"} and m["resumed_by_cause"].get("exited", 0) <= m["lost_by_cause"].get(
        "exited", 0)
    assert m["requests"] == m["slo_compliant"] + m["slo_violating"] + m["rejected"] + m["failed"]
    assert replay(traces, "--functions", "4", "--minutes", "2", "--policies", "mesh", "--fail-node", "cpu0") != 0
    assert "--fail-node is NODE@SECONDS[+DOWN]" in capsys.readouterr().err
