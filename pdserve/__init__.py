"""pdserve: disaggregated prefill/decode LLM serving.

This package holds what every process shares: the command line,
the local launcher, model fetching, and the Redis worker registry.
"""

__version__ = "0.1.0"
