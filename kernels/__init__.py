"""lathe's GPU kernels: MSL bodies (*.metal) with thin Python wrappers, one folder per family.

`kernels.runtime` picks the backend (Metal, or CUDA through msl/cuda_compat.h) and launches.
"""
