"""Model building blocks that own weights and delegate their arithmetic (engine/layers/linear.py)."""
