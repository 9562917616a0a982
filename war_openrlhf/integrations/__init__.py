"""Seams to foreign systems, one module each: :mod:`.openrlhf` (OpenRLHF's Ray PPO trainer)."""
