"""Engines behind one small protocol: simulated (profiles), OpenVINO (CPU), vLLM (GPU), and
PyTorch layer ranges for live scaling (torch_layers, torch_engine)."""
