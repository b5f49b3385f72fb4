"""triforce_offload.cli"""
