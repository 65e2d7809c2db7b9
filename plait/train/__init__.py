"""Training: the loop (loop.py) and the small pieces it calls."""
