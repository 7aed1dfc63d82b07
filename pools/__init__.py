"""Worker pools: how many workers each pool runs and carrying that out.

- book.py: the pure decision core (desired sizes, overrides, limits -> start / drain / stop).
- controller.py: the live loop that wires the book to discovery, worker load and a connector.
- connector.py with local_connector.py, ray_connector.py and k8s_connector.py: where workers run.
- restarts.py: the crash-restart policy; admin.py: the admin API (`splitserve pools ...`).
- k8s_controller.py: `splitserve controller`, the controller alone beside a Kubernetes release.

It does not decide sizes from load: that is the SLA planner's (planner/), which sets targets
through the controller's methods or the admin API.
"""
