"""pdserve: disaggregated prefill/decode LLM serving.

This package holds what the processes share: the command line, the local launcher, model
fetching, the Redis worker registry, metrics and health probes (all torch-free, so the gateway
can use them), plus the worker scaffolding (`worker.py`) and the HF baseline server
(`baseline_hf.py`), which import torch and are never imported by the gateway.
"""

__version__ = "0.1.0"
