"""The `splitserve serve` launcher hands its workers every engine flag it accepts."""

from __future__ import annotations

import argparse

from splitserve import serve
from splitserve.cli import _add_engine_args

# flags the launcher passes another way: the model directory it resolves, and the switches
_FORWARDED_ELSEWHERE = {"model", "no_prefix_caching", "no_cuda_graphs", "mock"}


def test_every_engine_flag_reaches_the_workers():
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    dests = {a.dest for a in p._actions if a.dest != "help"}
    assert dests - _FORWARDED_ELSEWHERE == set(serve._ENGINE_FLAGS)
