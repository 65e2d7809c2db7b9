"""The GRPO algorithm as pure tensor functions: advantages, the clipped objective, KL, and
the loss aggregation table. Nothing here does I/O or knows about processes."""
