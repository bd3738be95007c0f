"""Calibration runs: measure a profile of a model on this machine's engine (LLM-Mesh 5.2).

- `calibration.runner`: the measuring loop, grids, held-out checks, resumable state.
- `calibration.targets`: which engine a run measures (`make_target`).
- `calibration.openvino_calibration`, `calibration.vllm_calibration`: the engines' targets.

The profile format, the performance models and the reference profiles they write and read
live below the engines, in `mesh.perf`.
"""
