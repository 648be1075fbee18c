"""Kernels, each beside a pure-torch reference that its tests compare it against.

Triton (GPU; on CPU tensors under TRITON_INTERPRET=1, as tests/test_triton_kernels.py runs them):
  triton_attention  - paged attention of a ragged batch (prompt chunks, decodes, verification) in
                      one launch per layer, host-planned tiles, optional split-KV with a merge;
  triton_kv_store   - the step's new K/V into their cache slots, fused with rotary on k and q;
  triton_norm       - RMSNorm, optionally fused with the residual add;
  triton_activation - SiLU-and-mul of a fused gate/up projection.
C++ (CPU): cpu_linear (csrc/cpu_linear.cpp).

Named pdkernels, not kernels: transformers imports the PyPI package of that name, which a
top-level `kernels` of ours would shadow (tests/test_layout.py checks every package name).
"""
