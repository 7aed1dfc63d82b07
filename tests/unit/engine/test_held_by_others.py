"""A worker's start-up check of GPU memory that other processes hold (engine/model_runner.py)."""

from engine.model_runner import held_by_others

MIB = 1 << 20
TOTAL = 143_771 * MIB            # an H200, as mem_get_info reports it
WEIGHTS = 16_000 * MIB           # the 8B architecture's bf16 weights, this worker's own
CONTEXT = 600 * MIB              # its CUDA context and libraries, outside the allocator


def test_the_kv_of_a_departed_decode_worker_is_reported():
    # measured on 4 x H200: a drained decode worker's 105,407 one-MiB KV blocks stayed mapped by the
    # prefill workers; the next worker on that GPU saw them as held by another process
    leaked = 105_412 * MIB
    free = TOTAL - leaked - WEIGHTS - CONTEXT
    assert held_by_others(TOTAL, free, WEIGHTS, 0.85) == leaked + CONTEXT


def test_a_gpu_to_itself_is_not_reported():
    assert held_by_others(TOTAL, TOTAL - WEIGHTS - CONTEXT, WEIGHTS, 0.85) == 0


def test_a_shared_gpu_within_its_share_is_not_reported():
    # --gpus-per-worker 0.5: the first worker took 0.425 of the free memory and its weights
    sibling = int(0.425 * (TOTAL - WEIGHTS - CONTEXT)) + WEIGHTS + CONTEXT
    free = TOTAL - sibling - WEIGHTS - CONTEXT
    assert held_by_others(TOTAL, free, WEIGHTS, 0.425) == 0
    # past its share (a third process, or a leak) it is
    assert held_by_others(TOTAL, free - 30_000 * MIB, WEIGHTS, 0.425) > 0
