"""Runnable examples built on rlk_jax (not part of the installed package)."""
