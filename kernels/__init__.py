"""triforce_offload.kernels"""
