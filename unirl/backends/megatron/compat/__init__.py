"""megatron-core where it was not written to run: its CUDA-only lines patched by name on a CPU-only
process (gloo), its JIT fuser off there, and the names it reads that only Transformer Engine
binds, bound wherever TE is absent; sequence parallel on torch's norms (which TE's would do
otherwise). Nothing here changes what a GPU run with TE computes."""
