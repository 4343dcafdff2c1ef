"""The choices that differ between the two GPUs lathe's MSL bodies run on, made in one place
(kernels/msl/NOTES.md has the hazards behind them). Each reads the backend that
launches are made for (kernels.runtime.target_backend: the device's, or CUDA's while launches are
recorded on a machine without a GPU)."""

from __future__ import annotations

from kernels import runtime


def cross_group_waits() -> bool:
    """Whether a launch may have threadgroups wait on the work of others: the seam
    (kernels.gemv.seam) and the decoder blocks (kernels.blocks) as one launch each. On CUDA,
    resident blocks keep running while others spin. Not on Metal, which promises no forward
    progress between the threadgroups of a dispatch and whose device atomics are relaxed only:
    there each runs its parts as separate launches (same results), unless a Metal run shows
    otherwise. Without a GPU, plans are CUDA's (as recorded launches are)."""
    return runtime.target_backend() != "metal"


# Each target's limits on a launch, defined (and why) beside the check that refuses a launch past
# them (kernels.runtime.check_launch)
THREADS_PER_THREADGROUP = runtime.THREADS_PER_THREADGROUP
THREADGROUP_MEMORY = runtime.THREADGROUP_MEMORY


def threadgroup_memory() -> int:
    """The threadgroup memory budget of the launches being made (the GEMVs size their staged X
    against it: kernels.gemv). Without a GPU, CUDA's, as recorded launches are."""
    return THREADGROUP_MEMORY["metal" if runtime.target_backend() == "metal" else "cuda"]


def threads_per_threadgroup() -> int:
    """The most threads a threadgroup of the launches being made may have (launches that size
    their threadgroups to their work stay within it: qmm's next_norm). Without a GPU, CUDA's."""
    return THREADS_PER_THREADGROUP["metal" if runtime.target_backend() == "metal" else "cuda"]
