"""Device catalog and resolution (catalog names, mappings, NVML auto with a fake module)."""

from __future__ import annotations

import types

import pynvml
import pytest

from tuner.memory import devices
from tuner.memory.devices import Device, catalog, lookup, resolve_device
from tuner.errors import DeviceError

GIB = 2**30


def test_catalog_entries_are_consistent():
    devs = catalog()
    names = [d.name for d in devs]
    assert len(names) == len(set(names))
    assert {"H100-80GB", "RTX-3090", "A100-80GB", "A100-40GB", "H200", "L4", "T4"} <= set(names)
    for d in devs:
        assert type(d.total_memory_bytes) is int and d.total_memory_bytes > 5 * GIB  # RTX 3050 6GB: 5.66
        assert d.source in ("observed in vLLM log", "typical")
        assert d.compute_capability is not None


@pytest.mark.parametrize(
    ("name", "gib"),
    [("H100-80GB", "79.19"), ("RTX-3090", "23.58"), ("A100-80GB", "79.15"), ("A100-40GB", "39.39"),
     ("L40S", "44.39"), ("A10G", "22.07"), ("L4", "22.05"), ("H200", "139.80"), ("RTX-4090", "23.53"),
     ("B200", "178.40"), ("T4", "14.58"), ("V100-32GB", "31.74")],
)
def test_catalog_totals_round_to_the_quoted_gib(name, gib):
    dev = lookup(name)
    assert dev is not None
    assert f"{dev.total_memory_bytes / GIB:.2f}" == gib


def test_h100_exact_bytes_and_source():
    dev = resolve_device("H100-80GB")
    assert dev == Device("H100-80GB", 85_030_076_416, "observed in vLLM log", "9.0", interconnect="nvswitch")
    assert dev.uuid is None and dev.free_memory_bytes is None


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("nvidia h100 80gb", "H100-80GB"),
        ("h100 sxm5 80gb", "H100-80GB"),
        ("H100_80GB", "H100-80GB"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("rtx 3090", "RTX-3090"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("  NVIDIA H200 ", "H200"),
    ],
)
def test_lookup_by_alias(alias, canonical):
    assert lookup(alias).name == canonical
    assert resolve_device(alias).name == canonical


def test_rtx3090_observed_total():
    dev = resolve_device("nvidia geforce rtx 3090")
    assert dev.total_memory_bytes == 25_318_916_096
    assert dev.source == "observed in vLLM log"
    assert dev.compute_capability == "8.6"


def test_unknown_name_lists_known_names():
    with pytest.raises(DeviceError) as exc:
        resolve_device("GTX 1080")
    msg = str(exc.value)
    assert "'GTX 1080'" in msg
    for known in ("H100-80GB", "RTX-3090", "A100-40GB", "T4"):
        assert known in msg
    assert lookup("GTX 1080") is None
    assert lookup("A100") is None  # ambiguous between 40 GB and 80 GB: not an alias


def test_mapping_gib_converted_to_integer_bytes():
    dev = resolve_device({"name": "my-card", "total_memory_gib": 23.58})
    assert dev.total_memory_bytes == round(23.58 * GIB) == 25_318_832_210
    assert type(dev.total_memory_bytes) is int
    assert dev.name == "my-card" and dev.source == "given in drop" and dev.compute_capability is None


def test_mapping_bytes_and_catalog_compute_capability():
    dev = resolve_device({"name": "H100-80GB", "total_memory_bytes": 85_000_000_000})
    assert dev.total_memory_bytes == 85_000_000_000
    assert dev.compute_capability == "9.0"  # filled in from the catalog entry of that name
    dev = resolve_device({"name": "x", "total_memory_gib": 16, "compute_capability": "7.5"})
    assert dev.total_memory_bytes == 16 * GIB and dev.compute_capability == "7.5"


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"name": "x"}, "device"),
        ({"name": "x", "total_memory_gib": 10, "total_memory_bytes": 10}, "device"),
        ({"total_memory_gib": 10}, "device.name"),
        ({"name": "x", "total_memory_gib": "80"}, "device.total_memory_gib"),
        ({"name": "x", "total_memory_gib": True}, "device.total_memory_gib"),
        ({"name": "x", "total_memory_bytes": 8.5e10}, "device.total_memory_bytes"),
        ({"name": "x", "total_memory_gib": 0.1}, "device.total_memory_gib"),
        ({"name": "x", "total_memory_gib": 1e9}, "device.total_memory_gib"),
        ({"name": "x", "total_memory_gib": float("nan")}, "device.total_memory_gib"),
        ({"name": "x", "total_memory_gib": 10, "color": "red"}, "device"),
        ({"name": "x", "total_memory_gib": 10, "compute_capability": 9.0}, "device.compute_capability"),
    ],
)
def test_bad_mapping(value, where):
    with pytest.raises(DeviceError) as exc:
        resolve_device(value)
    assert exc.value.where == where


def test_wrong_type():
    with pytest.raises(DeviceError):
        resolve_device(80)


def test_device_instance_passes_through():
    dev = Device("x", 10 * GIB, "given in drop")
    assert resolve_device(dev) is dev


# --- auto through a fake NVML module ------------------------------------------------------------


def _fake_nvml(name="NVIDIA H100 80GB HBM3", total=85_520_809_984, free=84_900_000_000, count=1,
               fail_on=None, cc=(9, 0)):
    """A stand-in for pynvml with the real function names and the real NVMLError class."""
    calls = []

    def call(fname, result=None):
        def fn(*args):
            calls.append(fname)
            if fail_on == fname:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
                                       if fname == "nvmlInit" else pynvml.NVML_ERROR_UNKNOWN)
            return result(*args) if callable(result) else result
        return fn

    mem = types.SimpleNamespace(total=total, free=free, used=total - free)
    mod = types.SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        nvmlInit=call("nvmlInit"),
        nvmlShutdown=call("nvmlShutdown"),
        nvmlDeviceGetCount=call("nvmlDeviceGetCount", count),
        nvmlDeviceGetHandleByIndex=call("nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}"),
        nvmlDeviceGetHandleByUUID=call("nvmlDeviceGetHandleByUUID", lambda u: f"handle-{u}"),
        nvmlDeviceGetName=call("nvmlDeviceGetName", name),
        nvmlDeviceGetMemoryInfo=call("nvmlDeviceGetMemoryInfo", mem),
        nvmlDeviceGetUUID=call("nvmlDeviceGetUUID", "GPU-1234abcd"),
        nvmlDeviceGetCudaComputeCapability=call("nvmlDeviceGetCudaComputeCapability", cc),
    )
    mod.calls = calls
    return mod


@pytest.fixture(autouse=True)
def _no_cuda_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_auto_known_card_uses_catalog_total_below_nvml_physical():
    nvml = _fake_nvml()
    dev = resolve_device("auto", nvml=nvml)
    assert dev.name == "H100-80GB"
    # NVML's 81559 MiB physical is more than CUDA sees; the observed engine total wins.
    assert dev.total_memory_bytes == 85_030_076_416
    assert dev.source == "nvml; total from catalog (observed in vLLM log)"
    assert dev.free_memory_bytes == 84_900_000_000
    assert dev.uuid == "GPU-1234abcd"
    assert dev.compute_capability == "9.0"
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"
    assert "nvmlDeviceGetHandleByIndex" in nvml.calls


def test_auto_unknown_card_uses_nvml_values():
    nvml = _fake_nvml(name=b"NVIDIA Example X1 Accelerator", total=102_000_000_000, free=101_000_000_000, cc=(12, 0))
    dev = resolve_device("AUTO", nvml=nvml)
    assert dev == Device("NVIDIA Example X1 Accelerator", 102_000_000_000, "nvml", "12.0", "GPU-1234abcd", 101_000_000_000)


def test_auto_known_card_with_smaller_nvml_total_keeps_nvml():
    dev = resolve_device("auto", nvml=_fake_nvml(name="Tesla T4", total=15_000_000_000, cc=(7, 5)))
    assert dev.name == "T4" and dev.total_memory_bytes == 15_000_000_000 and dev.source == "nvml"


def test_auto_honours_cuda_visible_devices(monkeypatch):
    nvml = _fake_nvml(count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    resolve_device("auto", nvml=nvml)
    assert "nvmlDeviceGetHandleByUUID" in nvml.calls
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match="no NVIDIA GPU"):
        resolve_device("auto", nvml=_fake_nvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(DeviceError, match="NVML sees 2"):
        resolve_device("auto", nvml=_fake_nvml(count=2))


def test_auto_nvml_init_error_is_device_error():
    with pytest.raises(DeviceError) as exc:
        resolve_device("auto", nvml=_fake_nvml(fail_on="nvmlInit"))
    assert "no NVIDIA GPU / NVML not available" in str(exc.value)
    assert isinstance(exc.value.__cause__, pynvml.NVMLError)


def test_auto_nvml_query_error_is_device_error_and_shuts_down():
    nvml = _fake_nvml(fail_on="nvmlDeviceGetMemoryInfo")
    with pytest.raises(DeviceError, match="NVML query failed"):
        resolve_device("auto", nvml=nvml)
    assert nvml.calls[-1] == "nvmlShutdown"


def test_auto_zero_devices():
    with pytest.raises(DeviceError, match="0 devices"):
        resolve_device("auto", nvml=_fake_nvml(count=0))


def test_auto_without_pynvml(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DeviceError, match="no NVIDIA GPU / NVML not available"):
        resolve_device("auto")


def test_import_pulls_in_neither_torch_nor_pynvml():
    import subprocess
    import sys

    code = ("import sys, tuner.memory.devices, tuner.question.drop; "
            "bad = [m for m in ('torch', 'transformers', 'pynvml') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["H200-999GB", "NVIDIA H100 40GB", "RTX 5060 Ti 8GB", "A100 50GB"])
def test_size_word_contradicting_the_catalog_was_accepted_silently(name, tmp_path, tiny_config):
    """A memory size in the name that no catalog card of that model has names no card (it used to
    pick the model's only card, e.g. 'H200-999GB' -> H200 139.80 GiB); the drop error names the
    file and the field."""
    from tuner.question.drop import load_drop
    from tuner.errors import DropError

    assert lookup(name) is None
    with pytest.raises(DeviceError, match=r"its memory size \d+ GB matches no card of that model") as exc:
        resolve_device(name)
    assert exc.value.where == "device"
    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: {name}\n")
    with pytest.raises(DropError, match="matches no card of that model") as exc2:
        load_drop(drop)
    assert f"{drop}:device" in str(exc2.value)


@pytest.mark.parametrize(("name", "canonical"), [
    ("H20 96GB", "H20"), ("H20 141GB", "H20-141GB"), ("GH200 96GB", "GH200"), ("GH200 144GB", "GH200-144GB"),
    ("NVIDIA A100 40GB PCIe", "A100-40GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("H100-SXM5-80GB", "H100-80GB"),
    ("A10G 24GB", "A10G"), ("NVIDIA GeForce RTX 4090 (24G)", "RTX-4090"), ("NVIDIA H100 NVL 94GB", "H100-NVL")])
def test_size_word_selects_among_a_models_cards(name, canonical):
    assert lookup(name).name == canonical
    assert devices.size_words("A10G") == () and devices.size_words("RTX 4090 (24G)") == (24.0,)


# ------------------------------------------------------------------------------------------------
# Names as NVML and vLLM print them (issue 29): vendor prefixes, GeForce, form-factor words and a
# size word read by one normaliser; near misses answered with "did you mean".
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("printed", "card", "bytes_"),
    [
        ("NVIDIA GB10", "GB10", 128526516224),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000-Blackwell", 101973229568),
        ("NVIDIA GeForce RTX 3050 6GB", "RTX-3050-6GB", 6077546496),  # the size word picks the variant
        ("NVIDIA GeForce RTX 3050", "RTX-3050-8GB", 8192524288),
        ("NVIDIA B300 SXM6 AC", "B300", 288406880256),
        ("NVIDIA GB200", "GB200", 197889916928),
        ("AMD Instinct MI300X", "MI300X", 206141652992),
        ("AMD Instinct MI355X", "MI355X", 309220868096),
        ("NVIDIA H100 80GB HBM3", "H100-80GB", 85030076416),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB", 84987084800),
        ("NVIDIA GH200 96GB", "GH200", 101468602368),
        ("NVIDIA H100 94GB", "H100-NVL", 99977527296),  # nearest total of the H100 family
    ],
)
def test_device_names_as_nvml_and_vllm_print_them(printed, card, bytes_):
    dev = resolve_device(printed)
    assert (dev.name, dev.total_memory_bytes) == (card, bytes_)


def test_rocm_cards_run_the_rocm_platform():
    from tuner.memory.devices import platform_of_name

    assert resolve_device("AMD Instinct MI300X").platform == "rocm"
    assert resolve_device("NVIDIA H100 80GB HBM3").platform == "cuda"
    assert platform_of_name("AMD Radeon PRO W7900") == "rocm"
    assert resolve_device({"name": "AMD Instinct MI300A", "total_memory_gib": 128}).platform == "rocm"


def test_near_miss_device_name_says_did_you_mean():
    with pytest.raises(DeviceError) as exc:
        resolve_device("RTX4090")
    assert "unknown device 'RTX4090'; did you mean 'RTX-4090'?" in exc.value.message
    assert exc.value.where == "device" and "NAME:GIB" in exc.value.message
    with pytest.raises(DeviceError, match="did you mean 'RTX-4090' or 'RTX-4080'"):
        resolve_device("RTX 4009")


def test_bare_h100_lists_the_h100_variants():
    with pytest.raises(DeviceError) as exc:
        resolve_device("h100")
    assert ("device 'h100' may be any of 3 cards: H100-80GB (79.19 GiB, nvswitch), H100-NVL (93.11 GiB, nvlink), "
            "H100-PCIe (79.19 GiB, pcie); did you mean one of them?") in exc.value.message
    # a total picks the card
    assert lookup("NVIDIA H100", total_memory_bytes=int(93.11 * GIB)).name == "H100-NVL"


def test_unknown_device_error_names_the_total_forms():
    with pytest.raises(DeviceError) as exc:
        resolve_device("Quantum Card 9000")
    assert exc.value.where == "device"
    assert "known devices: H100-80GB" in exc.value.message
    assert "{name: ..., total_memory_gib: ...} in a drop, or NAME:GIB on the command line" in exc.value.message


def test_catalog_mapping_without_total_states_the_interconnect():
    dev = resolve_device({"name": "A100-80GB", "interconnect": "pcie"})
    assert (dev.name, dev.total_memory_bytes, dev.interconnect) == ("A100-80GB", 84987084800, "pcie")
    with pytest.raises(DeviceError, match="needs 'total_memory_gib' or 'total_memory_bytes' for a card the catalog"):
        resolve_device({"name": "Quantum Card 9000", "interconnect": "pcie"})


def test_auto_on_gb10_without_nvml_memory_query_reads_the_host(monkeypatch, tmp_path):
    """DGX Spark: NVML has no device memory query (nvidia-smi [N/A]); ``auto`` once failed with
    "NVML query failed". vLLM takes the CUDA total (vllm/platforms/cuda.py get_device_total_memory,
    0.34) and the host's MemAvailable as free memory (vllm/utils/mem_utils.py): so does ``auto``."""
    monkeypatch.setattr(devices, "host_available_bytes", lambda meminfo="/proc/meminfo": 100_000_000 * 1024)
    dev = resolve_device("auto", nvml=_fake_nvml(name="NVIDIA GB10", fail_on="nvmlDeviceGetMemoryInfo", cc=(12, 1)))
    assert (dev.name, dev.total_memory_bytes, dev.free_memory_bytes) == ("GB10", 128526516224, 102_400_000_000)
    assert dev.integrated is True and "host MemAvailable" in dev.source
    [gpu] = devices.list_gpus(_fake_nvml(name="NVIDIA GB10", fail_on="nvmlDeviceGetMemoryInfo", cc=(12, 1)))
    assert (gpu.catalog_name, gpu.total_memory_bytes, gpu.free_memory_bytes) == ("GB10", 128526516224, 102_400_000_000)


def test_host_available_bytes_reads_memavailable(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       125000000 kB\nMemAvailable:    2048 kB\n")
    assert devices.host_available_bytes(str(p)) == 2048 * 1024
    assert devices.host_available_bytes(str(tmp_path / "none")) is None


def test_pcie_word_names_the_pcie_card_or_the_model():
    assert resolve_device("NVIDIA H100 PCIe").name == "H100-PCIe"  # a separate catalog card
    assert resolve_device("NVIDIA H100 80GB PCIe").name == "H100-PCIe"
    assert resolve_device("NVIDIA L40S PCIe").name == "L40S"  # the only L40S board


def _fake_amdsmi(name="AMD Instinct MI300X", total=192 * GIB, used=int(0.3 * GIB)):
    class AmdSmiException(Exception):
        pass

    return types.SimpleNamespace(
        AmdSmiException=AmdSmiException, AmdSmiMemoryType=types.SimpleNamespace(VRAM="VRAM"),
        amdsmi_init=lambda: None, amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: ["h0"],
        amdsmi_get_gpu_asic_info=lambda h: {"market_name": name, "device_id": "0x74a1"},
        amdsmi_get_gpu_memory_total=lambda h, kind: total,
        amdsmi_get_gpu_memory_usage=lambda h, kind: used)


def test_auto_on_an_amd_host_reads_amdsmi():
    """``auto`` on an MI300X host once answered "no NVIDIA GPU"; it reads AMD SMI as vLLM's ROCm
    platform does (market name, VRAM total): the catalog's 191.98 GiB below the physical 192."""
    dev = resolve_device("auto", nvml=_fake_nvml(fail_on="nvmlInit"), amdsmi=_fake_amdsmi())
    assert (dev.name, dev.total_memory_bytes, dev.platform, dev.interconnect) == ("MI300X", 206141652992, "rocm", "xgmi")
    assert dev.source == "amdsmi; total from catalog (typical)"
    assert dev.free_memory_bytes == 206141652992 - int(0.3 * GIB)
    other = resolve_device("auto", nvml=_fake_nvml(fail_on="nvmlInit"),
                           amdsmi=_fake_amdsmi(name="AMD Radeon PRO W7900", total=48 * GIB, used=0))
    assert (other.name, other.total_memory_bytes, other.platform) == ("AMD Radeon PRO W7900", 48 * GIB, "rocm")


def test_h800_is_an_nvswitch_board_not_the_pcie_h100():
    """"NVIDIA H800" (the SXM5 export H100 behind NVSwitch) was an alias of the PCIe H100: its TP
    groups were charged no NVLS buffers. The PCIe H800 names itself."""
    sxm, pcie = resolve_device("NVIDIA H800"), resolve_device("NVIDIA H800 PCIe")
    assert (sxm.name, sxm.interconnect, sxm.total_memory_bytes) == ("H800", "nvswitch", 85030076416)
    assert (pcie.name, pcie.interconnect) == ("H800-PCIe", "pcie")


def test_pcie_word_in_a_printed_name_is_a_pcie_board():
    """"NVIDIA A100-PCIE-40GB" resolved to the catalog A100, an NVSwitch board: custom all-reduce was
    taken as on for TP 4/8. The board word in the printed name decides."""
    from tuner.jobs.job import topology_for

    dev = resolve_device("NVIDIA A100-PCIE-40GB")
    assert (dev.name, dev.interconnect) == ("A100-40GB", "pcie")
    assert resolve_device("NVIDIA A100-SXM4-40GB").interconnect == "nvswitch"
    topo = topology_for({"name": dev.name, "total_memory_bytes": dev.total_memory_bytes,
                         "interconnect": dev.interconnect}, {})
    assert (topo.interconnect, topo.p2p) == ("pcie", True)
