"""The routing simulator: the real router over simulated workers on a virtual clock (simulator.py)."""
