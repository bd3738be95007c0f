"""Mesh: a serverless LLM inference service sharing CPU and GPU nodes among many models under SLO."""
__version__ = "0.1.0"
