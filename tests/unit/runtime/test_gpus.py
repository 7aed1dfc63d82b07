"""The host's GPU inventory from nvidia-smi's report, narrowed by CUDA_VISIBLE_DEVICES and --gpus."""

from __future__ import annotations

import subprocess

import pytest

from runtime.errors import InvalidRequest
from runtime.gpus import Gpu, inventory, own_gpus, parse_gpu_list, parse_query, query_gpus, visible_gpus, worker_env

REPORT = """0, GPU-aaaa-0001, NVIDIA H100 80GB HBM3, 81559
1, GPU-bbbb-0002, NVIDIA H100 80GB HBM3, 81559
2, GPU-cccc-0003, NVIDIA H100 80GB HBM3, 81559
"""
GPUS = parse_query(REPORT)


def test_the_report_is_parsed_in_the_drivers_numbering():
    assert GPUS[1] == Gpu(1, "GPU-bbbb-0002", "NVIDIA H100 80GB HBM3", 81559)
    assert len(GPUS) == 3 and parse_query("") == [] and parse_query("No devices were found\n") == []


def test_a_host_without_the_driver_has_no_gpus():
    def missing(*a, **kw):
        raise FileNotFoundError("nvidia-smi")

    def failing(*a, **kw):
        return subprocess.CompletedProcess(a, 9, "", "NVIDIA-SMI has failed")
    assert query_gpus(missing) == [] and query_gpus(failing) == []


def test_cuda_visible_devices_narrows_by_index_or_uuid_as_cuda_does():
    assert [g.index for g in visible_gpus(GPUS, {})] == [0, 1, 2]
    assert [g.index for g in visible_gpus(GPUS, {"CUDA_VISIBLE_DEVICES": "2,0"})] == [2, 0]
    assert [g.index for g in visible_gpus(GPUS, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"})] == [1]
    assert visible_gpus(GPUS, {"CUDA_VISIBLE_DEVICES": ""}) == []
    # an entry CUDA cannot find hides it and every one after it
    assert [g.index for g in visible_gpus(GPUS, {"CUDA_VISIBLE_DEVICES": "1,7,2"})] == [1]


def test_gpus_flag_picks_among_the_visible_ones_and_names_what_is_missing():
    assert [g.index for g in inventory("2,1", GPUS, {})] == [2, 1]
    assert [g.index for g in inventory(None, GPUS, {"CUDA_VISIBLE_DEVICES": "1"})] == [1]
    with pytest.raises(InvalidRequest, match=r"--gpus 0,1: GPU 0 is not on this host \(visible GPUs: 1\)"):
        inventory("0,1", GPUS, {"CUDA_VISIBLE_DEVICES": "1"})
    for bad in ("", "0,,x", "a"):
        with pytest.raises(InvalidRequest, match="GPU indices separated by commas"):
            parse_gpu_list(bad)
    with pytest.raises(InvalidRequest, match="names a GPU twice"):
        parse_gpu_list("1,1")


def test_a_worker_is_given_its_gpus_in_nvidia_smis_numbering():
    assert worker_env((2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert own_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == "2,3"
