"""Engines behind one small protocol: simulated (profiles), emulated (emulated; emulation: the
devices emulated nodes run as, which the service and the agent both read), OpenVINO (CPU),
vLLM (GPU), and PyTorch layer ranges for live scaling (torch_layers, torch_engine)."""
