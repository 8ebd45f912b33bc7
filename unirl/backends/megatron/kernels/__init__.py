"""Megatron's GPU kernels and fusions without Transformer Engine: Triton RoPE, RMSNorm and SwiGLU,
the bias in the matmul epilogue, the weight-gradient fusion, multi-tensor norms, causal varlen
attention over packed sequences (context parallel included), and the probe that installs a
fusion only after checking it on the GPU. On the CPU nothing here changes a model."""
