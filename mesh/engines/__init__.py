"""Engines behind one small protocol: simulated (profiles), OpenVINO (CPU), vLLM (GPU)."""
