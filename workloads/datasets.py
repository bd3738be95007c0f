"""The real Azure traces shipped with Mesh (copies of ../shared/data; Microsoft's Azure Public
Dataset, CC-BY 4.0, https://github.com/Azure/AzurePublicDataset; see workloads/data/README.md).
They make `mesh replay` and the benchmarks run on their defaults on any machine."""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
FUNCTIONS_FILE = "azure-functions-2019/invocations_per_function_md.anon.sample500.min480-719.csv"
CONVERSATION_FILE = "azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
FUNCTIONS_TRACE = DATA_DIR / FUNCTIONS_FILE  # Azure Functions 2019, per-minute invocations
CONVERSATION_TRACE = DATA_DIR / CONVERSATION_FILE  # Azure LLM inference 2023, conversation
