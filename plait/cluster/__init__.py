"""Launching and placing processes: the planner that places trainers and generation replicas
on nodes (placement), and the Ray launcher that starts them there as actors running the same
SPMD code (ray_launcher). The collectives the loop needs are one floor down, in plait/comm.py."""
