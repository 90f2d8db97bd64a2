"""layers/mesh.py: the mesh rule (one -1 axis filled from the device count, the product must match) and the
batch split, with hand-worked sizes; layers/memory.py's placement names."""

import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.memory import MEMORIES, Memory
from spillway.layers.mesh import MeshConfig, batch_ways, check_batch_split


def test_the_minus_one_axis_takes_the_devices_the_others_leave():
    assert MeshConfig().resolve(8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert MeshConfig(data=-1, fsdp=1, tensor=4).resolve(8) == {"data": 2, "fsdp": 1, "tensor": 4}


def test_a_mesh_that_cannot_match_the_device_count_says_why():
    with pytest.raises(ValueError, match=r"does not fit 3 GPUs: 3 is not a multiple of 2"):
        MeshConfig(data=2).resolve(3, unit="GPUs")
    with pytest.raises(ValueError, match=r"needs 4 devices, but the device count is 8"):
        MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="mesh.tensor must be a positive number of devices or -1"):
        MeshConfig(tensor=0)


def test_the_batch_splits_over_data_times_fsdp():
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    assert batch_ways(sizes) == 4
    check_batch_split(sizes, 8, 2, micro_batches_too=True)            # 8 / 4 and 4 / 4
    with pytest.raises(ValueError, match=r"train.global_batch \(6\) must be divisible by the data x fsdp mesh size \(4\)"):
        check_batch_split(sizes, 6, 1, micro_batches_too=False)
    check_batch_split(sizes, 8, 4, micro_batches_too=False)           # a micro-batch of 2 is replicated: runs
    with pytest.raises(ValueError, match=r"a micro-batch of 2 sequences"):
        check_batch_split(sizes, 8, 4, micro_batches_too=True)
    check_batch_split({"data": 1, "fsdp": 1, "tensor": 1}, 3, 3, micro_batches_too=True)   # one device: any


def test_the_placement_names_are_plain_strings():
    assert MEMORIES == ("device", "host")
    assert Memory.HOST == "host" and f"{Memory.DEVICE}" == "device"
