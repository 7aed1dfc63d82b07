"""The pure pools of the KV store: which block or slot holds what, and the policies over them.

block_pool.py (G1's paged pool and prefix cache), slot_table.py (the slots of a lower tier),
tier_policy.py (load or recompute) and admission.py (which blocks are worth a disk write). Plain
Python and numpy: no torch, NIXL, CUDA or file I/O, so the scheduler and the simulators use them
as they are and the tests run them in milliseconds. The bytes move in kvstore/movers/.
"""
