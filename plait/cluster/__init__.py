"""Launching and talking between processes: torchrun's environment and the few collectives
the loop needs. Ray (a later issue) launches the same SPMD code."""
