"""Speculative decoding: the levels and drafters, the N-level engine, the acceptance rule,
and the speculative modes' runners."""
