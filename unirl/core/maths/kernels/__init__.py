"""GPU kernels behind core functions.

Each module here imports Triton at import time. Core code reaches them only through a guarded,
lazy import (see `unirl.core.maths.logprobs`), so a CPU-only install never needs Triton and
`import unirl` never loads it.
"""
