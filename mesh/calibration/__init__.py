"""Calibration runs: measure a profile of a model on this machine's engine (LLM-Mesh 5.2).

- `mesh.calibration.runner`: the measuring loop, grids, held-out checks, resumable state.
- `mesh.calibration.targets`: which engine a run measures (`make_target`).
- `mesh.calibration.openvino_calibration`, `mesh.calibration.vllm_calibration`: the engines' targets.

The profile format, the performance models and the reference profiles they write and read
live below the engines, in `mesh.perf`.
"""
