"""The `splitserve` command and its launchers.

gRPC's fork support is turned off for every splitserve process (before grpc loads): `serve` starts
children while its own gRPC server and channels run, and with fork support on, gRPC's fork handler
revived its threads in the child between fork and exec, which then aborted (SIGABRT) before the
child could exec. No splitserve process needs gRPC to survive a fork: children always exec.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
