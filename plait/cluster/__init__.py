"""Launching and placing processes: torchrun's environment and the collectives the loop needs
(comm), the planner that places trainers and generation replicas on nodes (placement), and the
Ray launcher that starts them there as actors running the same SPMD code (ray_launcher)."""
