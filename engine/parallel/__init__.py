"""Tensor parallelism inside one worker: the collectives (group.py), the rank processes
(ranks.py, rank_main.py), rank 0 as the engine's runner (runner.py) and the KV transfer of a worker
whose KV cache is split over its ranks (kv.py)."""
