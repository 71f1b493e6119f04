"""NVML listing and the devices command with a fake NVML module (error handling and formatting
only: no GPU behaviour is claimed from it)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tuner.memory.devices import list_gpus, require_gpu
from tuner.errors import DeviceError


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    NVMLError = FakeNVMLError

    def __init__(self, gpus=(), init_error=None, procs_error=False):
        self.gpus, self.init_error, self.procs_error, self.shutdown = list(gpus), init_error, procs_error, 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["total"], free=h["free"], used=h["total"] - h["free"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if self.procs_error:
            raise FakeNVMLError("Not Supported")
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in h["procs"]]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)


H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1234", "total": 85520809984, "free": 80000000000,
        "procs": [(11, 3 << 30), (12, 1 << 30)]}


def test_list_gpus_reads_every_field():
    nvml = FakeNVML([H100, {**H100, "uuid": "GPU-5678", "procs": []}])
    gpus = list_gpus(nvml)
    assert [g.uuid for g in gpus] == ["GPU-1234", "GPU-5678"]
    g = gpus[0]
    assert (g.index, g.name, g.catalog_name, g.compute_capability) == (0, "NVIDIA H100 80GB HBM3", "H100-80GB", "9.0")
    assert g.used_memory_bytes == 85520809984 - 80000000000
    assert g.other_processes_bytes == 4 << 30 and g.processes == 2
    assert gpus[1].other_processes_bytes == 0
    assert nvml.shutdown == 1


def test_process_query_not_supported_leaves_unknown():
    g = list_gpus(FakeNVML([H100], procs_error=True))[0]
    assert g.other_processes_bytes is None and g.processes is None


@pytest.mark.parametrize("nvml, match", [
    (FakeNVML([], init_error=FakeNVMLError("Driver Not Loaded")), "no NVIDIA GPU / NVML not available: Driver Not Loaded"),
    (FakeNVML([]), "NVML reports 0 devices"),
])
def test_no_gpu_is_a_device_error(nvml, match):
    with pytest.raises(DeviceError, match=match):
        list_gpus(nvml)
    with pytest.raises(DeviceError, match="method 'cuda' needs an NVIDIA GPU"):
        require_gpu("cuda", nvml)


def test_devices_command_json_and_table(capsys):
    from tuner.commands import devices

    assert devices.run(SimpleNamespace(json=True), nvml=FakeNVML([H100])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc[0]["uuid"] == "GPU-1234" and doc[0]["total_memory_bytes"] == 85520809984
    assert devices.run(SimpleNamespace(json=False), nvml=FakeNVML([H100])) == 0
    assert "H100-80GB" in capsys.readouterr().out
    assert devices.run(SimpleNamespace(json=False), nvml=FakeNVML([], init_error=FakeNVMLError("x"))) == 1
    assert "no NVIDIA GPU" in capsys.readouterr().err


def test_auto_method_without_gpu_is_simulate():
    from tuner.measure import available_methods, pick_method

    assert available_methods(FakeNVML([], init_error=FakeNVMLError("x"))) == ["simulate"]
    assert pick_method("auto", FakeNVML([], init_error=FakeNVMLError("x"))) == "simulate"
