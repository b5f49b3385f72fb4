"""triforce_offload.runtime"""
