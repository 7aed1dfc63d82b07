"""The KV store's movers: what touches torch, NIXL, CUDA or files.

host_pool.py (pinned host RAM), host_copy.py (G1 <-> G2 copies) with cuda_driver.py, disk_pool.py,
disk_index.py, disk_worker.py and file_io.py (the disk tier), transfer.py (KV between worker
processes over NIXL). They act on what the pure pools in kvstore/pools/ decide.
"""
