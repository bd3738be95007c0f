"""Trace replays (LLM-Mesh 8): a cluster under a policy, in virtual time, and its metrics.

- `mesh.replay.driver`: run one workload under one policy on the virtual-time loop.
- `mesh.replay.simulator`: the simulated nodes a replay runs on (the runtime builds none).
- `mesh.replay.metrics`: the comparison metrics (SLO-compliant requests, nodes in use,
  decode throughput per node, TTFT/TPOT percentiles) and the table.
- `mesh.replay.plots`: TTFT CDFs and node usage over time (Figures 12 and 13).

The live load client (`mesh replay --live`) is mesh.bench.live.
"""
