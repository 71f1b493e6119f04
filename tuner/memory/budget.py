"""The engine's KV-cache budget: requested memory minus what the profile run found in use.

Pure functions (no torch, no I/O). The formula families follow vLLM's worker code by era
(reference §3.2 for V0 ``vllm/worker/worker.py``, §4.3 for V1 ``vllm/v1/worker/gpu_worker.py``
and ``vllm/utils/mem_utils.py``). Terms no formula gives exactly — non-torch memory and the
CUDA-graph estimate — are empirical models over the era and the parallel layout, calibrated on
the public start-up logs in ``shared/cases/vllm-observed.jsonl`` (documented per constant).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Any

from tuner.memory.eras import GiB, MiB, V0_FREE_DELTA, V0_PROFILING, V0_WHOLE_GPU, V1_CONSUMED, V1_WHOLE_GPU, Era


def requested_memory_bytes(era: Era, total_memory_bytes: int, gpu_memory_utilization: float) -> int:
    """``T·u`` in bytes: ``math.ceil`` from V1 0.14 (vllm/v1/worker/utils.py ``request_memory``),
    truncated to int before (the budget is later cast with ``int()``)."""
    raw = total_memory_bytes * gpu_memory_utilization
    return math.ceil(raw) if era.requested_rounds_up else int(raw)


#: Non-torch increase of a V1 0.9.1–0.10.x engine at TP1/PP1 (GiB). These releases snapshot
#: before ``init_worker_distributed_environment`` (vllm/v1/worker/gpu_worker.py), but a world of one
#: creates no NCCL communicator or custom all-reduce, so only module loads (cuBLAS/cuBLASLt,
#: Triton, FlashInfer kernels) remain. Calibrated, not derived: the two vLLM 0.10.1.1 A100-80GB
#: logs (Qwen2-7B, u = 0.25 and 0.5) both leave 0.546 GiB beyond the logged weights, of which the
#: simulated FlashInfer sampler peak (two fp32 [R, V] buffers, 0.9+) is 0.53 GiB: ≈0.02 GiB
#: non-torch (the V1 reserve of :func:`unexplained_bytes` still applies on top).
V1_0910_TP1_NON_TORCH_GIB = 0.02


#: GPU interconnect classes of the catalog (``tuner/data/gpus.yaml`` ``interconnect``):
#: ``nvswitch`` — every GPU reaches every other over NVLink through NVSwitch (SXM/OAM boards,
#: GH200/GB200 NVL); ``nvlink`` — NVLink pairs or bridges; ``pcie`` — PCIe only; ``xgmi`` — AMD
#: Infinity Fabric (fully connected, as vLLM's ROCm platform reports it).
INTERCONNECTS = ("nvswitch", "nvlink", "pcie", "xgmi")
FULLY_CONNECTED = frozenset({"nvswitch", "xgmi"})


@dataclass(frozen=True)
class Topology:
    """What decides the communication buffers of a TP/PP group on one node (per rank).

    ``interconnect`` one of :data:`INTERCONNECTS`; ``p2p``: CUDA peer access between the cards
    (``cudaDeviceCanAccessPeer``; GeForce cards have none over PCIe); ``compute_capability``
    ``"9.0"``…; ``disable_custom_all_reduce`` as vLLM's ``--disable-custom-all-reduce``;
    ``single_node``: every rank of the group on this host (custom all-reduce needs it).
    The dataclass default is the calibration centre (H100 SXM behind NVSwitch), for direct callers;
    a job builds its topology with :func:`tuner.jobs.job.topology_for` (an unknown card: PCIe, no P2P).
    """

    interconnect: str = "nvswitch"
    p2p: bool = True
    compute_capability: str | None = "9.0"
    disable_custom_all_reduce: bool = False
    single_node: bool = True
    #: vLLM's platform: ``"cuda"`` or ``"rocm"`` (:mod:`tuner.memory.platforms`).
    platform: str = "cuda"


#: vLLM's custom all-reduce world sizes (vllm/distributed/device_communicators/custom_all_reduce.py
#: ``CustomAllreduce._SUPPORTED_WORLD_SIZES``, 0.5–0.33).
CUSTOM_ALL_REDUCE_WORLD_SIZES = (2, 4, 6, 8)
#: ``CustomAllreduce.__init__`` default ``max_size=8192 * 1024`` (0.5–0.33).
CUSTOM_ALL_REDUCE_MAX_SIZE = 8192 * 1024
#: ``rank_data = torch.empty(8 * 1024 * 1024, dtype=torch.uint8)`` (a torch tensor, 0.5–0.33).
CUSTOM_ALL_REDUCE_RANK_DATA = 8 * 1024 * 1024
#: ``ops.meta_size()`` = ``sizeof(vllm::Signal)`` (csrc/custom_all_reduce.cuh): ``start`` and ``end``
#: ``uint32[kMaxBlocks=36][8]`` and ``_flag uint32[36]``, each ``alignas(128)``: 1152 + 1152 + 256.
CUSTOM_ALL_REDUCE_META_SIZE = 2560
#: vllm/distributed/device_communicators/all_reduce_utils.py ``CUSTOM_ALL_REDUCE_MAX_SIZES``
#: (0.11–0.33; applied when torch symmetric memory is enabled, i.e. on these capabilities):
#: the buffer size is ``min(this, max_size)``.
CUSTOM_ALL_REDUCE_MAX_SIZES = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: MiB // 2, 8: MiB // 4},
    "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
    "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB},
}


def custom_all_reduce_enabled(world_size: int, topology: Topology) -> tuple[bool, str]:
    """Whether vLLM's custom all-reduce comes up for a TP group, and why not
    (vllm/distributed/device_communicators/custom_all_reduce.py ``CustomAllreduce.__init__``,
    the same checks 0.5–0.33): off with ``disable_custom_all_reduce``, for a world of one, a world
    size outside 2/4/6/8, a group spanning nodes, more than two GPUs that are not fully connected
    ("not supported on more than two PCIe-only GPUs"), and GPUs without P2P access (checked on CUDA
    only)."""
    t = topology
    if t.disable_custom_all_reduce:
        return False, "disable_custom_all_reduce"
    if world_size <= 1:
        return False, "world size 1"
    if world_size not in CUSTOM_ALL_REDUCE_WORLD_SIZES:
        return False, f"world size {world_size} not in {list(CUSTOM_ALL_REDUCE_WORLD_SIZES)}"
    if not t.single_node:
        return False, "group spans several nodes"
    if world_size > 2 and t.interconnect not in FULLY_CONNECTED:
        return False, "not supported on more than two PCIe-only GPUs"
    if not t.p2p and t.interconnect == "pcie" and t.platform != "rocm":
        # ROCm skips the check: "On AMD GPU, p2p is always enabled between XGMI connected GPUs"
        # (custom_all_reduce.py, 0.5–0.34: ``not current_platform.is_rocm() and not _can_p2p``)
        return False, "no P2P access between the GPUs"
    return True, "on"


def custom_all_reduce_buffer_bytes(era: Era, world_size: int, topology: Topology) -> int:
    """Device memory one rank's custom all-reduce allocates outside torch's allocator (bytes):
    the IPC ``meta_ptrs`` buffer ``meta_size + max_size`` and ``buffer_ptrs`` ``max_size``
    (``create_shared_buffer``: cudaMalloc + IPC handles); ``max_size`` is 8 MiB, capped from 0.11 by
    ``CUSTOM_ALL_REDUCE_MAX_SIZES[capability][world]`` where torch symmetric memory is available
    (Hopper/Blackwell). The 8 MiB ``rank_data`` is a torch tensor (not non-torch). 0 when off."""
    on, _why = custom_all_reduce_enabled(world_size, topology)
    if not on:
        return 0
    max_size = CUSTOM_ALL_REDUCE_MAX_SIZE
    caps = CUSTOM_ALL_REDUCE_MAX_SIZES.get(str(topology.compute_capability or ""))
    if era.engine == "V1" and era.version >= (0, 11, 0) and caps and world_size in caps:
        max_size = min(caps[world_size], max_size)
    return CUSTOM_ALL_REDUCE_META_SIZE + 2 * max_size


#: vllm/distributed/device_communicators/all_reduce_utils.py ``SYMM_MEM_ALL_REDUCE_MAX_SIZES``:
#: the torch symmetric-memory all-reduce buffer per capability and TP world size (bytes), with the
#: release each capability first appears in (read: 0.10.2 and 0.11.0 "9.0"/"10.0"; 0.20.1–0.26 add
#: "10.3"; 0.28–0.32 add "10.7"; the same sizes in every wheel read).
SYMM_MEM_ALL_REDUCE_MAX_SIZES = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
    "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
    "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
    "10.7": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
}
SYMM_MEM_CAPABILITY_SINCE = {"9.0": (0, 10, 2), "10.0": (0, 10, 2), "10.3": (0, 20, 0), "10.7": (0, 28, 0)}
#: ``VLLM_ALLREDUCE_USE_SYMM_MEM`` defaults to 1 from 0.11.0 (vllm/envs.py; "0" in 0.10.2, whose
#: symm_mem.py is the first); ``VLLM_USE_NCCL_SYMM_MEM`` (NCCL window-registered pool,
#: pynccl_allocator.py) defaults to 0 in every release read (0.11–0.32): nothing by default.
SYMM_MEM_DEFAULT_ON_SINCE = (0, 11, 0)
#: torch's signal pad after each symmetric buffer: ``symm_max_nblocks (32) × max_cuda_p2p_domain_size
#: (72) × sizeof(uint32_t)`` (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryTypes.hpp,
#: torch 2.13 headers); the block is rounded up to the cuMem allocation granularity (2 MiB on NVIDIA
#: GPUs, ``CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`` in CUDASymmetricMemory.cu ``allocate``).
TORCH_SYMM_SIGNAL_PAD_BYTES = 32 * 72 * 4
CUMEM_GRANULARITY_BYTES = 2 * MiB


def symm_mem_buffer_bytes(era: Era, world_size: int, topology: Topology) -> int:
    """Device memory vLLM's torch symmetric-memory all-reduce allocates per rank of a TP group by
    default (bytes; 0 where it does not): vllm/distributed/device_communicators/symm_mem.py
    ``SymmMemCommunicator.__init__`` (0.10.2–0.32) allocates ``torch_symm_mem.empty(max_size)``
    with ``max_size = SYMM_MEM_ALL_REDUCE_MAX_SIZES[capability][world]`` for the ``tp`` group on
    CUDA when ``VLLM_ALLREDUCE_USE_SYMM_MEM`` is on (default from 0.11), before it checks
    multicast (the buffer stays allocated when multicast is unsupported, e.g. over PCIe); torch
    allocates it through cuMem (outside the caching allocator: non-torch memory) with its signal
    pad, rounded to the granularity. Independent of ``disable_custom_all_reduce``."""
    if era.engine != "V1" or world_size <= 1 or era.version < SYMM_MEM_DEFAULT_ON_SINCE:
        return 0
    cap = str(topology.compute_capability or "")
    since = SYMM_MEM_CAPABILITY_SINCE.get(cap)
    if since is None or era.version < since or world_size not in SYMM_MEM_ALL_REDUCE_MAX_SIZES[cap]:
        return 0
    size = -(-SYMM_MEM_ALL_REDUCE_MAX_SIZES[cap][world_size] // 16) * 16 + TORCH_SYMM_SIGNAL_PAD_BYTES
    return -(-size // CUMEM_GRANULARITY_BYTES) * CUMEM_GRANULARITY_BYTES


#: NCCL buffers an NVSwitch fabric of Hopper or newer adds during the profile of a TP ≥ 2 group
#: (GiB at world size 2, and per doubling): NVLink SHARP (NVLS) buffers, which NCCL ≥ 2.22
#: allocates at the first collective that uses the algorithm (``NCCL_RUNTIME_CONNECT``), i.e.
#: inside the profile run, in multicast-granularity units. Calibrated, not derived: vLLM 0.19.0
#: H100-SXM logs print 2.06–2.09 GiB non-torch at TP2 (5 models) and 2.13 at TP4 (2 models)
#: against 0.25 at TP1 (14 cases): 1.82 GiB at TP2, +0.06 GiB per doubling.
NVLS_TP2_GIB = 1.82
NVLS_PER_DOUBLING_GIB = 0.06
#: NCCL communicator buffers of a TP ≥ 2 group (NVLS aside), charged
#: where the start-up snapshot precedes ``init_worker_distributed_environment`` (V0 0.6.5–0.10,
#: V1 0.9.1–0.10; reference §3.1, §4.2) (GiB). Calibrated, not derived: a vLLM 0.8.4 V0 log on
#: 4× L40 (TP4, PCIe, custom all-reduce off) prints 0.37 / 0.33 GiB non-torch against the
#: release's 0.25 GiB TP1 term: 0.12 GiB (the larger rank decides, V0 takes the minimum blocks).
NCCL_COMMUNICATOR_GIB = 0.12


#: One NCCL communicator of a TP group on an NVLink / NVSwitch fabric (GiB per rank). Calibrated, not
#: derived (NCCL's channel buffers are sized inside NCCL, not by vLLM): the vLLM 0.11.0 H100 TP2 logs
#: (llm-d-benchmark, torch 2.8.0 / NCCL 2.27) print 0.54 / 0.55 GiB non-torch against 0.13 at TP1,
#: i.e. 0.41 / 0.42 GiB for the one communicator created inside the profile window
#: (:func:`lazy_communicator_bytes`); the same logs' start-up free memory cross-checks it: TP2 uses
#: 0.93 GiB more than TP1 before the snapshot = two pynccl communicators (``tp`` and ``ep`` groups,
#: parallel_state.py ``initialize_model_parallel``) + the custom all-reduce (16 MiB) and symmetric-
#: memory (66 MiB) buffers, 0.425 GiB each. Over PCIe :data:`NCCL_COMMUNICATOR_GIB` (fewer channels).
NCCL_NVLINK_COMMUNICATOR_GIB = 0.42
#: V1 releases whose profile window (``init_snapshot`` after ``init_worker_distributed_environment``
#: up to ``memory_profiling``'s exit) holds only the profile run: from 0.18 ``determine_available_memory``
#: also runs ``profile_cudagraph_memory`` inside ``memory_profiling`` (gpu_worker.py 0.18.0 – 0.34.0),
#: where the 0.19 calibration (:data:`NVLS_TP2_GIB`) was measured.
PROFILE_RUN_ONLY_WINDOW = ((0, 11, 0), (0, 18, 0))


def lazy_communicator_bytes(era: Era, world_size: int, topology: Topology) -> int:
    """The NCCL communicator a V1 0.11 – 0.17 profile run creates for a TP group (bytes per rank; 0
    elsewhere). The snapshot follows ``init_worker_distributed_environment`` (gpu_worker.py
    ``init_device``), so the pynccl communicators and custom all-reduce / symmetric-memory buffers are
    baseline; torch's own ``ProcessGroupNCCL`` for the group's ``device_group`` is not: vLLM calls
    ``init_process_group`` without ``device_id`` (distributed/parallel_state.py), so torch creates
    that communicator at the group's first collective, the profile's logits all-gather
    (``LogitsProcessor._gather_logits`` → ``DeviceCommunicatorBase.all_gather`` →
    ``dist.all_gather_into_tensor(group=device_group)``; ``use_all_gather`` is True on V1; read in
    0.11.0, 0.12.0, 0.14.0, 0.17.0). Its size: :data:`NCCL_NVLINK_COMMUNICATOR_GIB` on NVLink /
    NVSwitch, :data:`NCCL_COMMUNICATOR_GIB` otherwise."""
    lo, hi = PROFILE_RUN_ONLY_WINDOW
    if world_size <= 1 or era.engine != "V1" or not lo <= era.version < hi:
        return 0
    gib = NCCL_NVLINK_COMMUNICATOR_GIB if topology.interconnect in ("nvswitch", "nvlink") else NCCL_COMMUNICATOR_GIB
    return int(gib * GiB)


def nccl_profile_bytes(era: Era, world_size: int, topology: Topology) -> int:
    """NCCL memory the era charges to a rank of a TP group of ``world_size`` (bytes): NVLS
    buffers on an NVSwitch fabric with compute capability ≥ 9.0 (:data:`NVLS_TP2_GIB`, allocated
    during the profile), plus the communicator's own buffers where the snapshot precedes the
    distributed init (:data:`NCCL_COMMUNICATOR_GIB`; from V1 0.11 they are baseline). V1 0.11 – 0.17
    at TP2 charge the communicator the profile creates (:func:`lazy_communicator_bytes`) and no
    NVLS term: their H100 TP2 logs print 0.41 – 0.42 GiB beyond TP1, not 0.19's 1.82 (whose window
    also holds the CUDA-graph profiling captures); no 0.11 – 0.17 log at TP ≥ 4 says what NVLS adds
    there, so the 0.19 term stays for those."""
    if world_size <= 1:
        return 0
    out = 0.0
    lazy = lazy_communicator_bytes(era, world_size, topology)
    if not (lazy and world_size == 2):
        out += _nvls_gib(world_size, topology)
    snapshot_before_nccl = era.engine == "V0" or era.version < (0, 11, 0)
    if snapshot_before_nccl:
        out += NCCL_COMMUNICATOR_GIB
    return int(out * GiB) + lazy


def _nvls_gib(group_size: int, topology: Topology) -> float:
    """NCCL's NVLS buffers of a group of ``group_size`` ranks (GiB): on an NVSwitch fabric of compute
    capability ≥ 9.0 (unknown capability: the larger, safe, value) :data:`NVLS_TP2_GIB` +
    :data:`NVLS_PER_DOUBLING_GIB` per doubling beyond 2; else 0."""
    try:
        major = int(str(topology.compute_capability).split(".")[0])
    except (TypeError, ValueError):
        major = 9
    if topology.interconnect == "nvswitch" and major >= 9:
        return NVLS_TP2_GIB + NVLS_PER_DOUBLING_GIB * math.log2(group_size / 2)
    return 0.0


def tp_group_bytes(era: Era, world_size: int, topology: Topology) -> int:
    """A TP group's communication memory where the era charges all of it (V0 and V1 ≤ 0.10, whose
    snapshot precedes ``init_worker_distributed_environment``, and the whole-GPU formulas): NCCL's
    buffers by fabric (:func:`nccl_profile_bytes`) and vLLM's custom all-reduce and symmetric-memory
    buffers where they come up (:func:`custom_all_reduce_buffer_bytes`, :func:`symm_mem_buffer_bytes`)."""
    return (nccl_profile_bytes(era, world_size, topology) + custom_all_reduce_buffer_bytes(era, world_size, topology)
            + symm_mem_buffer_bytes(era, world_size, topology))


def moe_dp_group_bytes(era: Era, data_parallel_size: int, topology: Topology) -> int:
    """NCCL memory of the data-parallel group a MoE model's layers exchange tokens over in the
    profile run (bytes per rank; 0 at ``data_parallel_size`` 1).

    vllm/model_executor/layers/fused_moe/layer.py ``forward_impl`` (0.10.1): with ``dp_size > 1``
    every MoE layer dispatches and combines through ``get_ep_group().dispatch/combine``; the
    ``naive`` backend (vllm/distributed/device_communicators/all2all.py, ``VLLM_ALL2ALL_BACKEND``
    default ≤ 0.10.2) broadcasts every rank's tokens and combines with
    ``dp_group.all_reduce`` of ``[dp × N, H]`` (pynccl, far above the custom all-reduce's 8 MiB),
    ``allgather_reducescatter`` (default from 0.11.0, ``AgRsAll2AllManager``) all-gathers and
    reduce-scatters over the same group through pynccl (``CudaCommunicator.all_gatherv``), not
    torch's ``device_group``, so the lazily created torch communicator of
    :func:`lazy_communicator_bytes` (a TP group's logits all-gather, 0.11 – 0.17) does not apply.
    Charged like a TP group by topology, as :func:`nccl_profile_bytes` charges one outside that
    window: NVLS buffers on an NVSwitch fabric of compute capability ≥ 9.0
    (:data:`NVLS_TP2_GIB` + :data:`NVLS_PER_DOUBLING_GIB` per doubling), allocated at the profile's
    first large collective; the communicator's own buffers (:data:`NCCL_COMMUNICATOR_GIB`) where
    the start-up snapshot precedes ``init_worker_distributed_environment`` (V0, V1 ≤ 0.10). Both
    constants are the TP calibration's (not derived for a DP group). A dense model under DP runs
    no GPU collective in its forward (nothing charged; the caller passes 1)."""
    if data_parallel_size <= 1:
        return 0
    out = _nvls_gib(data_parallel_size, topology)
    if era.engine == "V0" or era.version < (0, 11, 0):
        out += NCCL_COMMUNICATOR_GIB
    return int(out * GiB)


def non_torch_bytes(era: Era, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    topology: Topology | None = None) -> int:
    """Non-torch memory the era charges to the instance (bytes, per rank).

    What it contains depends on the era (reference §8):
    - V0 0.6.4 and V1 0.7–0.9.0 count everything used on the GPU outside torch's allocations,
      the CUDA context included: 0.35 GiB on one RTX 3090 (case vllm-10517, 0.6.4); TP ≥ 2 adds the
      group's buffers by topology (:func:`tp_group_bytes`), not a flat charge.
    - V0 0.6.5–0.6.6 charge NCCL and workspaces since init: 1.79 GiB TP1, + the TP group's buffers
      by topology (3.58 GiB at TP2 on H100 NVSwitch, PR #10511 sanity log, reference §7A).
    - V1 0.9.1–0.10.x at TP1: :data:`V1_0910_TP1_NON_TORCH_GIB` (module loads only).
    - V0 ≤0.6.3 charges the free-memory drop since init: not the CUDA context (created before the
      baseline) but the torch cache the profile leaves (no ``empty_cache``), cuBLAS and NCCL;
      the 0.6.4 constant is kept as its estimate (no public ≤0.6.3 breakdown).
    - V1 0.9.1+ charge the non-torch increase during the profile: 0.25 GiB at TP1 on H100 with
      0.19 (0.24–0.26 over 14 cases; 0.13 with 0.11.0); 0.07 GiB on pipeline stages without TP.
    - TP ≥ 2 (V0 0.7+ and V1 0.9.1+) adds the TP group's communication memory by topology
      (:class:`Topology`): :func:`nccl_profile_bytes` and, where the snapshot precedes the
      distributed init (V0, V1 ≤ 0.10), :func:`custom_all_reduce_buffer_bytes` and
      :func:`symm_mem_buffer_bytes` (0 there by default; from 0.11 both are baseline).
    The TP1 terms are calibrated constants, not a per-model lookup.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    topo = topology or Topology()
    v = era.version
    f = era.budget_formula
    if f in (V0_WHOLE_GPU, V1_WHOLE_GPU, V0_FREE_DELTA):
        # whole-GPU formulas: the TP group's NCCL and custom all-reduce buffers count wherever they
        # are, by topology (no longer a flat 1.8 GiB: 2x RTX 4090 over PCIe print 0.25 GiB in all)
        base = int(0.35 * GiB)
        return base + (tp_group_bytes(era, tp, topo) if tp > 1 else 0)
    if f == V0_PROFILING and v < (0, 7, 0):
        # 0.6.5-0.6.6: 1.79 GiB at TP1; the TP group's buffers by topology (the PR #10511 H100 TP2 log's
        # 3.58 GiB = 1.79 + 1.79 on NVSwitch)
        return int(1.79 * GiB) + (tp_group_bytes(era, tp, topo) if tp > 1 else 0)
    if f == V0_PROFILING:
        base = int(0.25 * GiB)
    elif v < (0, 11, 0):
        base = int(V1_0910_TP1_NON_TORCH_GIB * GiB)
    elif v < (0, 12, 0):
        # 0.13 GiB measured on 0.11.0 (4 H100 cases); applied to 0.9.1–0.10 too (the 0.10.1.1 A100
        # logs print no breakdown; with it their KV is predicted −0.8 % / −3.4 %, without −1.3 / −5.8).
        base = int(0.13 * GiB)
    else:
        base = int(0.25 * GiB)
    if tp > 1:
        # buffers the distributed init allocates are charged only where the snapshot precedes it
        # (V0, V1 ≤ 0.10); symmetric memory is 0 there by default (symm_mem_buffer_bytes)
        charged_ar = era.engine == "V0" or v < (0, 11, 0)
        return (base + nccl_profile_bytes(era, tp, topo)
                + (custom_all_reduce_buffer_bytes(era, tp, topo) + symm_mem_buffer_bytes(era, tp, topo)
                   if charged_ar else 0))
    if pp > 1:
        return int(0.07 * GiB)
    return base


MiB = 1 << 20

#: Unexplained start-up memory of a V1 engine, charged with the profile pass (bytes) — a safety
#: reserve for what no derived term explains, reported apart from the activation:
#: :data:`UNEXPLAINED_WEIGHTS_FRACTION` of the rank's weights plus
#: :data:`UNEXPLAINED_ACTIVATION_FRACTION` of the modelled activation peak, at least
#: :data:`UNEXPLAINED_FLOOR_BYTES`, at most :data:`UNEXPLAINED_CAP_BYTES`.
#:
#: What vLLM's budget charges (source, V1 0.10 – 0.34; docs/accuracy-mechanisms.md §24): the weights
#: are the *allocated*-bytes increase over ``load_model`` (``DeviceMemoryProfiler`` →
#: platforms/cuda.py ``get_current_memory_usage``: ``empty_cache``, ``reset_peak_memory_stats``,
#: ``max_memory_allocated``), the activation the ``allocated_bytes.all.peak`` increase over the
#: profile, non-torch ``(total − free) − memory_reserved()`` since the init snapshot (utils
#: ``MemorySnapshot`` / ``memory_profiling``). No term counts reserved-but-unallocated slack, so
#: nothing in vLLM's budget grows with the weights beyond the allocated blocks — whose rounding by
#: the caching allocator is now derived (:func:`tuner.memory.allocator.weights_rounding_bytes`,
#: applied to V1 too): it was the Qwen2 family's +0.056 GiB (2 MiB per layer), Qwen2.5-72B's
#: +0.078 GiB at TP2, phi-4's +0.078, Gemma-3-27B's +0.061 that the former 0.56 % of W was fitted on.
#:
#: Refit on what is left (fit, not derived; prediction without reserve − engine KV, after the
#: rounding, on the V1 high-confidence cases whose log prints weights, activation and non-torch):
#: dense and MoE TP1 at 50 – 68 GiB of weights leave +0.020 – 0.054 GiB (Llama-3.3-70B-FP8 0.054 on
#: 67.7, Gemma-3-27B 0.033, Qwen3-32B 0.022, Qwen3-30B-A3B 0.020, Gemma-2-27B 0.020: ≤ 0.08 % of W),
#: gpt-oss-120b on 0.10.1.1 / 0.11.0 +0.057 / 0.097 / 0.107 GiB with a 7.3 GiB activation, small
#: models ≤ 0.021 GiB (floor), gpt-oss-20b on 0.11.0 +0.039 GiB with 7.4 GiB of activation.
#: 0.1 % of W + 0.5 % of the activation (floor 16 MiB, cap 176 MiB, unchanged) covers each of them.
#: Left uncovered, named (not reserve-sized): DeepSeek-V2-Lite / Kimi-VL (MLA + DeepSeek MoE) weights
#: +0.13 – 0.14 GiB per rank at TP 1 – 4 (not located), TP4 non-torch (+0.08 GiB), Granite's
#: non-torch (+0.21 GiB), the RTX 5090 NVFP4 pair (+0.43 GiB).
UNEXPLAINED_FLOOR_BYTES = 16 * MiB
UNEXPLAINED_WEIGHTS_FRACTION = 0.001
UNEXPLAINED_ACTIVATION_FRACTION = 0.005
UNEXPLAINED_CAP_BYTES = 176 * MiB


def unexplained_bytes(era: Era, weights_bytes: int, activation_peak_bytes: int = 0) -> int:
    """Start-up memory no modelled term explains, for one rank (bytes); 0 on V0 engines.
    ``activation_peak_bytes``: the modelled activation (simulated peak + cuBLAS workspace)."""
    if era.engine != "V1":
        return 0
    r = (UNEXPLAINED_WEIGHTS_FRACTION * max(0, weights_bytes)
         + UNEXPLAINED_ACTIVATION_FRACTION * max(0, activation_peak_bytes))
    return int(min(max(UNEXPLAINED_FLOOR_BYTES, r), UNEXPLAINED_CAP_BYTES))


def cublas_workspace_bytes(compute_capability: str | None) -> int:
    """cuBLAS workspace torch allocates through its caching allocator on the first GEMM of the
    profile run (bytes): ``4096 KiB × 8`` on compute capability ≥ 9.0 (Hopper, Blackwell), else
    ``4096 KiB × 2 + 16 KiB × 8`` (torch ``CublasHandlePool.cpp`` default
    ``CUBLAS_WORKSPACE_CONFIG``). Unknown capability → the larger (safe) value."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except (TypeError, ValueError):
        major = 9
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 2 * 1024 + 16 * 8 * 1024


def profile_overhead_bytes(compute_capability: str | None, era: Era | None = None) -> int:
    """Torch peak of a real profile run beyond the simulated model and sampler (bytes): the cuBLAS
    workspace (see also :func:`unexplained_bytes`, charged per rank with it).

    vLLM 0.33 (vllm/v1/worker/gpu_worker.py ``init_device``) runs ``torch.mm`` and a biased
    ``linear`` before the start-up snapshot, so the cuBLAS(Lt) handles and workspace are baseline
    and the profile charges none (0.30 still creates them on the profile's first GEMM)."""
    if era is not None and era.engine == "V1" and era.version >= (0, 33, 0):
        return 0
    return cublas_workspace_bytes(compute_capability)


def moe_rank_shape(num_experts: int, intermediate_size: int, *, tensor_parallel_size: int = 1,
                   data_parallel_size: int = 1, enable_expert_parallel: bool = False) -> tuple[int, int]:
    """``(experts on the rank, expert intermediate size on the rank)`` of a FusedMoE layer
    (vllm/model_executor/layers/fused_moe/config.py ``FusedMoEParallelConfig.make``: the MoE group
    flattens TP across DP, ``tp_size = dp × tp``; with ``enable_expert_parallel`` and more than one
    rank, ``ep_size = dp × tp`` and ``tp_size = 1``; layer.py ``determine_expert_map``: rank r holds
    ``E // ep + (1 if r < E % ep else 0)`` experts — rank 0, the largest, is returned). Without EP
    every rank holds all E experts with ``I / (dp × tp)`` of each; dense layers stay TP-sharded and
    replicated over DP (each DP rank is its own engine)."""
    ranks = max(1, int(tensor_parallel_size)) * max(1, int(data_parallel_size))
    if enable_expert_parallel and ranks > 1:
        e = int(num_experts)
        return e // ranks + (1 if e % ranks else 0), int(intermediate_size)
    return int(num_experts), int(intermediate_size) // ranks


def co_tenant_non_torch_bytes(era: Era, other_processes_bytes: int) -> int:
    """Memory of other processes the era's budget charges as this instance's non-torch memory
    (bytes): all of it where the budget is whole-GPU (V0 0.6.4 ``T·u − (peak + non_torch)`` with
    ``non_torch = (T − free) − allocated``; V1 0.7–0.9.0 the same, fixed by PR #19312 in 0.9.1),
    none where it is per instance (V0 ≤0.6.3 and 0.6.5+, V1 0.9.1+: the baseline excludes it)."""
    if era.budget_formula in (V0_WHOLE_GPU, V1_WHOLE_GPU):
        return max(0, int(other_processes_bytes))
    return 0


#: Compute capabilities vLLM 0.11.1–0.19.x treats as unified memory (vllm/utils/mem_utils.py
#: ``MemorySnapshot.measure`` ``shared_sysmem_device_mem_sms``: Orin 8.7, Thor 11.0, Spark 12.1).
UMA_CAPABILITIES_0_19 = ("8.7", "11.0", "12.1")
#: First release reading an integrated GPU's free memory from the host (psutil), and the first
#: deciding by the device's ``is_integrated`` property instead of the capability list (read in
#: every wheel 0.10.2–0.34.0: none through 0.11.0; the list 0.11.1–0.19.1; the property 0.20.0+).
FREE_FROM_HOST_SINCE = (0, 11, 1)
FREE_FROM_HOST_BY_PROPERTY_SINCE = (0, 20, 0)


def free_memory_from_host(era: Era, *, compute_capability: str | None, integrated: bool | None) -> bool:
    """Whether the release reads a device's free memory from the host's available memory
    (``psutil.virtual_memory().available``) instead of ``cudaMemGetInfo`` — so that RAM other host
    processes use is co-tenant memory to its free-memory check and its ``total − free`` snapshots.

    vllm/utils/mem_utils.py ``MemorySnapshot.measure`` (``device_memory_info`` in 0.34), read in
    every wheel 0.10.2–0.34.0: never through 0.11.0 (V0 likewise); by compute capability
    (:data:`UMA_CAPABILITIES_0_19`) in 0.11.1–0.19.1; by the device's ``is_integrated`` property
    (``CudaPlatform.is_integrated_gpu``; the catalog's ``integrated``) from 0.20.0."""
    if era.engine != "V1" or era.version < FREE_FROM_HOST_SINCE:
        return False
    if era.version < FREE_FROM_HOST_BY_PROPERTY_SINCE:
        return str(compute_capability or "") in UMA_CAPABILITIES_0_19
    return bool(integrated)


def uma_host_buffer_bytes(era: Era, *, free_from_host: bool, model_runner_v2: bool, max_num_seqs: int,
                          max_model_len: int, block_size: int = 16) -> int:
    """Host RAM the model runner takes after the start-up snapshot that a unified-memory device
    counts as consumed device memory (bytes; 0 where free memory is not read from the host,
    :func:`free_memory_from_host`).

    On such a device ``MemorySnapshot.measure`` (vllm/utils/mem_utils.py) reads free memory from
    ``psutil.virtual_memory().available``, so host allocations between ``init_device``'s snapshot
    and the end of the profile enter ``non_torch_increase`` (0.11.1 – 0.26) or ``total_consumed``
    (0.27+). The runner is built after the snapshot (vllm/v1/worker/gpu_worker.py ``init_device``,
    0.11.1 – 0.33 read) and holds one token-history row of ``max_model_len`` per request slot:
    V1 runner ``InputBatch.__init__`` (vllm/v1/worker/gpu_input_batch.py, 0.11.1 – 0.33 read):
    ``token_ids_cpu_tensor`` int32 and ``is_token_ids_tensor`` bool, ``[max_num_seqs,
    max_model_len]`` each, zero-filled (5 B per slot-token), and the placeholder block table's pinned
    host twin (vllm/v1/worker/block_table.py ``CpuGpuBuffer``, int32 ``[max_num_seqs,
    cdiv(max_model_len, block_size)]``); Model Runner V2 ``RequestState``
    (vllm/v1/worker/gpu/states.py, 0.22 – 0.33 read): ``all_token_ids`` int32 in pinned host
    memory (``uva_instead_of_gpu=True``; 4 B). Not modelled: 0.34 (its runner keeps the history
    dense on the GPU for some models), the process's other host growth (libraries, kernels loaded
    lazily, the page cache is available memory)."""
    if not free_from_host or era.engine != "V1" or era.version >= (0, 34, 0):
        return 0
    s, m = int(max_num_seqs), int(max_model_len)
    if model_runner_v2:  # its block tables are built with the KV cache, after the profile
        return 4 * s * m
    return 5 * s * m + 4 * s * -(-m // max(1, int(block_size)))


def free_memory_refusal(era: Era, *, total_memory_bytes: int, other_processes_bytes: int,
                        gpu_memory_utilization: float, requested_memory_bytes: int) -> str | None:
    """vLLM's start-up refusal when free memory is below the request (V1 0.9.1+,
    vllm/v1/worker/gpu_worker.py ``init_device``: ``init_snapshot.free_memory < requested_memory``),
    with free = total − other processes (this process's own CUDA context is not counted); its
    wording ("on device cuda:0" from 0.14). None when it starts or the era has no such check."""
    if era.engine != "V1" or era.version < (0, 9, 1) or other_processes_bytes <= 0:
        return None
    free = int(total_memory_bytes) - int(other_processes_bytes)
    if free >= requested_memory_bytes:
        return None
    where = "device cuda:0" if era.version >= (0, 14, 0) else "device"
    return (f"Free memory on {where} ({free / GiB:.2f}/{total_memory_bytes / GiB:.2f} GiB) on startup is less than "
            f"desired GPU memory utilization ({gpu_memory_utilization}, {requested_memory_bytes / GiB:.2f} GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.")


def _alloc(nbytes: int) -> int:
    """One allocation as the caching allocator counts it (512-byte granules)."""
    return -(-max(0, int(nbytes)) // 512) * 512


def runner_persistent_bytes(
    era: Era, *, model_runner_v2: bool, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
    hidden_size: int, vocab_size: int, dtype_bytes: int = 2, block_size: int = 16,
) -> int:
    """Persistent GPU buffers the model runner allocates between the start-up snapshot and the
    profile run, charged only where the budget is ``total_consumed``-based (V1 0.27+,
    vllm/utils/mem_utils.py ``memory_profiling``: ``init_free − free_after_profile``); earlier
    formulas take the torch peak increase from the profile's start and never see them (bytes).

    V1 runner (vllm/v1/worker/gpu_model_runner.py ``__init__``, 0.33): ``input_ids`` int32,
    ``positions``/``req_indices``/``query_pos`` int64, ``is_padding``/``is_token_ids`` bool, all
    ``[N]`` (``is_padding`` from 0.31; the release audit, docs/release-audit.md); ``inputs_embeds [N, H]`` in the model dtype; the placeholder ``InputBatch`` block
    table ``[S, cdiv(M, bs)]`` int32 and slot mapping ``[N]`` int64 (vllm/v1/worker/block_table.py).
    Model Runner V2 (vllm/v1/worker/gpu/*.py, 0.27–0.33): ``InputBuffers`` ``[N]`` ids/positions/
    padding, and the sampler's ``PenaltiesState`` — ``output_bin_counts [S, V]`` int32 and
    ``prompt_bin_mask [S, cdiv(V, 32)]`` int32 (block tables come after the profile, the token
    history lives in host memory). Buffers of ``[S]`` elements are left out (a few KiB).
    """
    if era.engine != "V1" or era.budget_formula != V1_CONSUMED:
        return 0
    n, s = int(max_num_batched_tokens), int(max_num_seqs)
    if model_runner_v2:
        return (_alloc(4 * n) + _alloc(8 * n) + _alloc(n)
                + _alloc(4 * s * vocab_size) + _alloc(4 * s * (-(-vocab_size // 32))))
    blocks = -(-int(max_model_len) // max(1, block_size))
    is_padding = _alloc(n) if era.version >= (0, 31, 0) else 0  # ``self.is_padding`` [N] bool: 0.31+
    return (_alloc(4 * n) + _alloc(8 * n) + is_padding + _alloc(8 * n) + _alloc(n)
            + _alloc(8 * max(s + 1, n)) + _alloc(n * hidden_size * dtype_bytes)
            + _alloc(4 * s * blocks) + _alloc(8 * n))


#: Bytes per element of the model dtypes a drop names (``dtype``), for the runner's ``[N, H]``
#: embeddings buffer in :func:`runner_persistent_bytes` (torch's element sizes).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def persistent_bytes(era: Era, spec: Any, settings: Any, batch: Any, model_runner_v2: bool) -> int:
    """The model runner's persistent buffers one profile pass charges (:func:`runner_persistent_bytes`)
    for a model spec, a rank's settings and the era's profile batch — what
    :func:`tuner.model.simulate.profile.run_pass` adds to a pass (at ``settings.max_model_len``, the
    grid's largest) and :meth:`tuner.jobs.job.Passes.passes_at` recomputes at each length evaluated
    (grid points, the proposal search's off-grid points, passes from the pass memo,
    :mod:`tuner.jobs.passmemo`): the one term of a pass that depends on ``max_model_len`` (bytes)."""
    n = batch.max_num_batched_tokens
    return runner_persistent_bytes(
        era, model_runner_v2=model_runner_v2, max_num_batched_tokens=n,
        max_num_seqs=settings.max_num_seqs or batch.max_num_seqs,
        max_model_len=settings.max_model_len or n, hidden_size=int(spec.hidden_size),
        vocab_size=int(spec.vocab_size), dtype_bytes=DTYPE_BYTES.get(settings.dtype, 2),
        block_size=settings.block_size or 16)


#: First release with split prefill / decode CUDA-graph capture sizes whose defaults widen on
#: data-centre Blackwell (vllm/config/vllm.py ``VllmConfig._split_cudagraph_capture_sizes``,
#: ``wide_defaults = is_device_capability_family(100)`` when no legacy size is set: 0.34.0).
WIDE_CAPTURE_DEFAULTS_SINCE = (0, 34, 0)
#: ``max_prefill_cudagraph_capture_tokens`` / ``max_decode_cudagraph_capture_tokens`` under the wide
#: defaults (0.34: 8192 each).
WIDE_CAPTURE_MAX_TOKENS = 8192


def _walk_grid(limit: int, step) -> list[int]:
    """vllm/config/compilation.py ``_walk_grid`` (0.34): sizes 1 … limit, each the next multiple of
    the largest power of two not above ``step(size)``."""
    grid, size = [], 1
    while size < limit:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = (size // stride + 1) * stride
    return [*grid, limit] if limit else []


def wide_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, query_len: int = 1) -> list[int]:
    """0.34's capture sizes (tokens) under the data-centre Blackwell wide defaults: the prefill grid
    up to ``min(8192, N)`` (``prefill_cudagraph_capture_grid``: 54 sizes at 8192) and the uniform
    decode graphs ``n · q`` of the request grid up to ``max_num_seqs`` (``decode_cudagraph_capture_grid``:
    64 sizes at 1024) within ``min(N, 8192)`` tokens (``decode_cudagraph_capture_shapes``: the first
    count above the limit is captured at the limit). Dynamic speculative-decoding tiers and draft
    decode graphs are not modelled."""
    n, q = int(max_num_batched_tokens), max(1, int(query_len))
    prefill = _walk_grid(min(WIDE_CAPTURE_MAX_TOKENS, n), lambda t: min(t, max(8, t / 4), 0.07 * max(t, 4096)))
    decode = _walk_grid(int(max_num_seqs), lambda r: 0.65 * r ** (2 / 3))
    limit = min(int(max_num_seqs), min(n, WIDE_CAPTURE_MAX_TOKENS) // q)
    reachable = decode[:bisect.bisect_left(decode, limit) + 1] if limit >= 1 else []
    return sorted(set(prefill) | {min(r, limit) * q for r in reachable})


#: First release whose default largest capture size counts the decode query length
#: ``1 + num_speculative_tokens`` (vllm/config/vllm.py ``VllmConfig._set_cudagraph_sizes``, 0.13.0).
SPEC_DECODE_CAPTURE_MAX_SINCE = (0, 13, 0)


def cudagraph_capture_sizes(era: Era, max_num_seqs: int, max_num_batched_tokens: int, *,
                            num_speculative_tokens: int = 0, cudagraph_capture_sizes: list[int] | None = None,
                            max_cudagraph_capture_size: int | None = None,
                            compute_capability: str | None = None) -> list[int]:
    """CUDA-graph capture sizes (tokens) as the release derives them.

    ≥0.12 (vllm/config/vllm.py ``VllmConfig._set_cudagraph_sizes``; 0.19–0.33 read): with
    ``q = 1 + num_speculative_tokens`` (from 0.13, :data:`SPEC_DECODE_CAPTURE_MAX_SINCE`; 1 in 0.12),
    ``max = min(max_num_seqs × q × 2, D)`` unless
    ``max_cudagraph_capture_size`` is given, then ``min(max, max_num_batched_tokens)``; ``D`` is
    512, and from 0.28 1024 on data-centre Blackwell (compute capability 10.x,
    ``is_device_capability_family(100)``); sizes ``[1, 2, 4]`` (those ≤ max) +
    ``range(8, min(max + 1, 256), 8)`` + ``range(256, max + 1, 16)``; from 0.20.1 also
    ``max_num_batched_tokens`` itself when it is ≤ max (0.20.0 lacks that step); from 0.29
    with spec decode (``q > 1``) the uniform decode sizes ``c × q`` for the request counts
    ``c`` of the same grid up to ``min(max_num_seqs, D)`` (and ``max_num_seqs`` itself) where
    ``c × q`` ≤ the uncapped max, from 0.31 without spec decode ``max_num_seqs`` when ≤ it —
    each kept when ≤ ``max_num_batched_tokens``. A user ``cudagraph_capture_sizes`` list
    replaces the derived one (deduplicated, sizes above N dropped). Not modelled: the
    ``interactivity`` performance mode, sequence-parallel rounding, dynamic spec-decode tiers.
    ≤0.11 (vllm/config/__init__.py, 0.10.1): ``[1, 2, 4] + range(8, max + 1, 8)`` with
    ``max = min(2·max_num_seqs, 512)``, capped at N.
    """
    n = int(max_num_batched_tokens)
    v = era.version
    if cudagraph_capture_sizes:
        return sorted({int(x) for x in cudagraph_capture_sizes if int(x) <= n})
    blackwell = bool(compute_capability) and str(compute_capability).split(".")[0] == "10"
    if v >= WIDE_CAPTURE_DEFAULTS_SINCE and blackwell and not max_cudagraph_capture_size:
        return wide_capture_sizes(max_num_seqs, n, 1 + int(num_speculative_tokens))
    if v < (0, 12, 0):
        max_graph = min(2 * max_num_seqs, 512)
        sizes = [1, 2, 4] + list(range(8, max_graph + 1, 8))
        return [x for x in sizes if x <= n]
    q = 1 + int(num_speculative_tokens)
    uniform: list[int] = []
    if max_cudagraph_capture_size:
        max_graph = int(max_cudagraph_capture_size)
    else:
        default = 1024 if v >= (0, 28, 0) and blackwell else 512
        # the decode query length multiplies the default from 0.13 (0.12: ``min(max_num_seqs * 2, 512)``)
        max_graph = min(max_num_seqs * (q if v >= SPEC_DECODE_CAPTURE_MAX_SINCE else 1) * 2, default)
        if v >= (0, 29, 0) and q > 1:
            reqs = min(max_num_seqs, default)
            counts = [c for c in (1, 2, 4) if c <= reqs] + list(range(8, min(reqs + 1, 256), 8)) \
                + list(range(256, reqs + 1, 16)) + [reqs]
            uniform = sorted({c * q for c in counts if c * q <= max_graph})
        elif v >= (0, 31, 0) and max_num_seqs <= max_graph:
            uniform = [max_num_seqs]
    max_graph = min(n, max_graph)
    sizes = [x for x in (1, 2, 4) if x <= max_graph]
    if max_graph >= 8:
        sizes += list(range(8, min(max_graph + 1, 256), 8))
    if max_graph >= 256:
        sizes += list(range(256, max_graph + 1, 16))
    if v >= (0, 20, 1) and n <= max_graph:
        sizes.append(n)
    sizes += [x for x in uniform if x <= n]
    return sorted(set(sizes))


#: First release whose worker estimates CUDA-graph memory on ROCm (vllm/v1/worker/gpu_worker.py
#: ``determine_available_memory``: ``current_platform.is_cuda_alike()``; ``is_cuda()`` in 0.21–0.25.1,
#: ``not is_rocm()`` in 0.19–0.20).
ROCM_CUDAGRAPH_ESTIMATE_SINCE = (0, 26, 0)

#: The capture sizes of the CUDA-graph fit's anchor logs (vLLM 0.19.0, max_num_seqs 1024,
#: max_num_batched_tokens 8192: max 512 → 51 sizes).
CUDAGRAPH_ANCHOR_SIZES = 51


def cudagraph_estimate_bytes(
    era: Era, *, num_layers: int, max_num_seqs: int, max_num_batched_tokens: int, hidden_size: int = 4096,
    always: bool = False, num_speculative_tokens: int = 0, capture_sizes: list[int] | None = None,
    compute_capability: str | None = None, extra_layer_hidden: int = 0,
    model_runner_v2: bool = False, platform: str = "cuda", full_graphs: bool = True,
) -> int:
    """The CUDA-graph memory estimate the era subtracts (bytes; 0 where it subtracts none).

    vLLM 0.19+ (vllm/v1/worker/gpu_model_runner.py ``profile_cudagraph_memory``) captures the two
    largest sizes per mode, measures free memory around each, and extrapolates
    ``first + per_graph·(n − 1)`` over the ``n`` capture sizes of the mode; 0.20+ subtracts it
    from the KV budget (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``). The measured value at the
    anchor's 51 sizes is a function of the stage's residual stream (layers × hidden), calibrated,
    not derived, on the 34 vLLM 0.19.0 H100 logs that print "CUDA graph pool memory: …
    (estimated)" (default 1024 seqs / 8192 tokens): 0.84 GiB at 131072 layer·hidden (Llama-3.1-8B,
    CodeLlama-7B, Qwen3-8B, Gemma-2-9B and Mistral-Small-24B all print 0.84), proportional below
    with a 0.5 GiB floor (Gemma-2-2B 0.52, 8-16-layer pipeline stages 0.49-0.54), +1.5 GiB per 10⁶
    above (Qwen2.5-72B: 1.63). Fit: median |error| 0.03 GiB on dense models; MoE/MLA models print
    0.3-0.9 GiB more (not modelled). Other graph counts scale it by ``graphs / 102``, vLLM's own
    extrapolation (``first + per_graph·(n − 1)`` per mode, the modes' growth added): the anchor's
    102 graphs are 51 PIECEWISE + 51 FULL (:func:`full_decode_capture_sizes`); small
    ``max_num_seqs`` captures fewer FULL graphs, spec decode's ``1 + num_speculative_tokens`` tokens
    per request and a user list change both (:func:`cudagraph_capture_sizes`). ``always`` returns the estimate
    even where the era does not subtract it (for reports). ``extra_layer_hidden``: a
    speculative-decoding drafter's layers × hidden captured with the target's
    (:func:`tuner.memory.specdecode.drafter_graph_layer_hidden`), added to the residual stream.

    Model Runner V2 (``model_runner_v2``) before 0.29 estimates nothing: its
    ``GPUModelRunner.profile_cudagraph_memory`` (vllm/v1/worker/gpu/model_runner.py) is
    ``return 0`` ("It is TBD whether we keep this API or not") in every release read from 0.19 to
    0.28 (0.19, 0.20.0, 0.20.1, 0.21, 0.22, 0.24, 0.25, 0.26, 0.27, 0.28), so
    ``Worker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py) subtracts no graph
    memory and the graphs are captured after the cache is sized, as before 0.20. From 0.29
    (0.29–0.33 read) it calls ``vllm/v1/worker/gpu/cudagraph_utils.py`` ``profile_cudagraph_memory``
    (captures into a throwaway pool, PIECEWISE in full, FULL extrapolated from samples), which the
    fit above stands for as it does for the V1 runner.

    ``full_graphs`` False: the mode was lowered to PIECEWISE (spec decode on an attention backend
    without ``UNIFORM_BATCH`` graphs, :func:`tuner.memory.attention.full_graphs_captured`): no FULL
    decode graphs are counted.

    ``platform`` ``"rocm"``: ``Worker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py)
    calls ``profile_cudagraph_memory`` only ``if not current_platform.is_rocm()`` (0.19–0.20),
    ``if current_platform.is_cuda()`` (0.21–0.25.1), ``if current_platform.is_cuda_alike()`` from
    :data:`ROCM_CUDAGRAPH_ESTIMATE_SINCE` (0.26.0, found by ``python -m tuner.releases.diff
    --timeline``): on ROCm before 0.26 nothing is subtracted and the graphs are captured after the
    cache is sized.
    """
    if not (era.subtracts_cudagraph_estimate or always) or era.engine != "V1":
        return 0
    if model_runner_v2 and era.version < (0, 29, 0) and not always:
        return 0
    if platform == "rocm" and era.version < ROCM_CUDAGRAPH_ESTIMATE_SINCE and not always:
        return 0
    x = num_layers * hidden_size + int(extra_layer_hidden)
    anchor, at_anchor = 131072, 0.84 * GiB
    if x <= anchor:
        est = max(0.5 * GiB, at_anchor * x / anchor)
    else:
        est = at_anchor + 1.507e-6 * GiB * (x - anchor)
    sizes = capture_sizes if capture_sizes is not None else cudagraph_capture_sizes(
        era, max_num_seqs, max_num_batched_tokens, num_speculative_tokens=num_speculative_tokens,
        compute_capability=compute_capability)
    graphs = len(sizes) + (len(full_decode_capture_sizes(sizes, max_num_seqs, num_speculative_tokens))
                           if full_graphs else 0)
    return int(est * graphs / (2 * CUDAGRAPH_ANCHOR_SIZES))


def full_decode_capture_sizes(sizes: list[int], max_num_seqs: int, num_speculative_tokens: int = 0) -> list[int]:
    """The FULL (uniform-decode) graphs vLLM captures beside the PIECEWISE ones under the default
    ``cudagraph_mode`` FULL_AND_PIECEWISE (vllm/v1/cudagraph_dispatcher.py
    ``initialize_cudagraph_keys``, 0.19–0.20 read): the capture sizes ``x`` with
    ``q ≤ x ≤ q · max_num_seqs``, ``q = 1 + num_speculative_tokens`` (the uniform decode query
    length). ``profile_cudagraph_memory`` (vllm/v1/worker/gpu_model_runner.py 0.19, 0.20) estimates
    each mode as its first capture plus ``(n − 1)`` times the second capture's growth, and adds the
    modes' growth: the graph count is PIECEWISE + FULL (the anchor's 0.19 logs: 51 + 51 at 1024
    sequences; 0.21 at 256 sequences prints "PIECEWISE=51 (largest=512), FULL=35 (largest=256)")."""
    q = 1 + int(num_speculative_tokens)
    return [x for x in sizes if q <= x <= q * int(max_num_seqs)]


#: vLLM 0.34's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py): the margin kept free
#: beyond the measured transient peak, ``max(floor, fraction × transient)``, the floor 1 GiB on CUDA
#: and 3 GiB on ROCm (``KV_CACHE_MARGIN_FLOOR_BYTES = (3 if current_platform.is_rocm() else 1) << 30``).
KV_CACHE_MARGIN_FLOOR_BYTES = {"cuda": 1 << 30, "rocm": 3 << 30}
KV_CACHE_MARGIN_FRACTION = 0.75
#: The part of the margin torch's allocator is capped to leave for allocations outside it
#: (``KV_CACHE_NON_TORCH_RESERVE_BYTES = (2 if rocm else 1) << 29``: 0.5 GiB CUDA, 1 GiB ROCm); it
#: caps torch after sizing and does not change the block count.
KV_CACHE_NON_TORCH_RESERVE_BYTES = {"cuda": 1 << 29, "rocm": 2 << 29}
#: Device memory in use before vLLM 0.34's start-up snapshot that the extensible cache's headroom
#: (``free memory after warmup + committed blocks``) does not have: the CUDA context, cuBLAS
#: handles. Calibrated, not derived: the whole-GPU non-torch term of the V0 0.6.4 log of case
#: vllm-10517 (RTX 3090, TP1: context + cuBLAS + what the profile left outside torch) is 0.35 GiB, the
#: value :func:`non_torch_bytes` uses for the whole-GPU eras; no 0.34 log with the breakdown yet.
STARTUP_BASELINE_GIB = 0.35


def platform_of(topology: "Topology | None") -> str:
    """The TP group's platform, ``"rocm"`` or ``"cuda"``: :attr:`Topology.platform`
    (:mod:`tuner.memory.platforms`), or ROCm for Infinity Fabric (``xgmi``)."""
    if topology is None:
        return "cuda"
    if getattr(topology, "platform", "cuda") == "rocm" or topology.interconnect == "xgmi":
        return "rocm"
    return "cuda"


def startup_baseline_bytes(era: Era, *, tensor_parallel_size: int = 1, topology: "Topology | None" = None) -> int:
    """Memory in use at vLLM 0.34's start-up snapshot besides other processes (bytes, per rank):
    :data:`STARTUP_BASELINE_GIB`, plus for a TP group the buffers the distributed init allocates
    before the snapshot (0.11+: NCCL communicator :data:`NCCL_COMMUNICATOR_GIB`, custom all-reduce
    :func:`custom_all_reduce_buffer_bytes`, symmetric memory :func:`symm_mem_buffer_bytes`)."""
    topo = topology or Topology()
    out = int(STARTUP_BASELINE_GIB * GiB)
    if tensor_parallel_size > 1:
        out += (int(NCCL_COMMUNICATOR_GIB * GiB) + custom_all_reduce_buffer_bytes(era, tensor_parallel_size, topo)
                + symm_mem_buffer_bytes(era, tensor_parallel_size, topo))
    return out


def measure_kv_cache_bytes(*, init_free_memory: int, free_memory: int, committed_bytes: int, requested_memory: int,
                           transient_peak_bytes: int = 0, torch_reserve_growth_bytes: int = 0,
                           margin_floor_bytes: int = KV_CACHE_MARGIN_FLOOR_BYTES["cuda"],
                           margin_fraction: float = KV_CACHE_MARGIN_FRACTION) -> int:
    """vLLM 0.34's extensible KV cache budget (vllm/v1/worker/extensible_kv_cache.py
    ``measure_kv_cache_bytes``, line for line): everything resident except the committed KV
    prefix is the engine's (``non_kv_used = init_free − free − committed``); the cache gets
    ``min(requested − non_kv_used, headroom − margin) − max(transient peak, torch reserve growth)``
    with ``headroom = free + committed`` and ``margin = max(floor, fraction × transient)``; never
    below 0 (bytes)."""
    non_kv_used = init_free_memory - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


#: The physical granule an extensible KV cache commits in (vllm/utils/extensible_tensor.py
#: ``granule_size``: the CUDA VMM allocation granularity, 2 MiB on NVIDIA GPUs).
VMM_GRANULE_BYTES = 2 * MiB


def kv_segment_strides(kv_cache_config: Any) -> list[int]:
    """The block strides of an extensible cache's segments (vllm/v1/worker/extensible_kv_cache.py
    ``ExtensibleKVCache._segments``, block-compact layer-outermost layouts: one segment per layer
    region, i.e. per distinct ``offset + i x layer_stride`` of the 0.32+ tensors); [] when the
    config's tensors carry no strides."""
    segs: dict[int, int] = {}
    for t in getattr(kv_cache_config, "kv_cache_tensors", ()) or ():
        if t.layer_stride_bytes is None or t.block_stride_bytes is None:
            continue
        for i in range(len(t.shared_by)):
            segs.setdefault(int(t.offset_bytes or 0) + i * int(t.layer_stride_bytes), int(t.block_stride_bytes))
    return list(segs.values())


def blocks_within(num_bytes: int, segment_strides: list[int], *, granule: int = VMM_GRANULE_BYTES,
                  capacity: int | None = None) -> int:
    """Most blocks whose physical footprint fits in ``num_bytes`` (``ExtensibleKVCache.blocks_within``,
    0.34): each segment's ``blocks x stride`` is rounded up to the granule."""
    per_block = sum(segment_strides)
    if per_block <= 0:
        return 0
    n = max(0, int(num_bytes)) // per_block
    if capacity is not None:
        n = min(n, capacity)

    def physical(k: int) -> int:
        return sum(-(-k * st // granule) * granule for st in segment_strides)

    while n > 0 and physical(n) > num_bytes:
        n -= 1
    return n


@dataclass(frozen=True)
class Budget:
    """One KV budget, all in bytes (per rank).

    ``available_kv_cache_bytes`` may be negative: the engine would refuse to start with
    "No available memory for the cache blocks".

    With vLLM 0.34's extensible KV cache (:func:`extensible_kv_budget`) also: ``headroom_bytes``
    (device memory free after warmup and capture, the committed prefix included), ``margin_bytes``,
    ``transient_bytes`` (the transient peak kept free) and ``capacity_kv_cache_bytes`` (the
    profile-based reservation the cache may grow to; None otherwise).
    """

    requested_memory_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    available_kv_cache_bytes: int
    headroom_bytes: int | None = None
    margin_bytes: int | None = None
    transient_bytes: int | None = None
    capacity_kv_cache_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def kv_budget(
    era: Era,
    *,
    total_memory_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    non_torch_bytes: int,
    cuda_graph_bytes: int = 0,
) -> Budget:
    """Available KV-cache bytes for one rank.

    All families reduce to ``requested − (W + activation peak + non-torch) [− graphs]``
    once each term carries the era's meaning (see :func:`non_torch_bytes`):
    V0 ≤0.6.3 ``T·u − (init_free − free_after)``; V0 0.6.4 / V1 0.7–0.9.0
    ``T·u − (torch_alloc_peak + non_torch_whole_gpu)`` where the torch peak includes W;
    V0 0.6.5–0.10.2 and V1 0.9.1–0.26 ``requested − (W + peak_increase + non_torch_increase)``
    (V1 0.20+ minus the CUDA-graph estimate); V1 0.27+ ``requested − (total_consumed +
    transient_headroom) − graphs`` with ``total_consumed`` = W + non-torch since the snapshot.
    """
    requested = requested_memory_bytes(era, total_memory_bytes, gpu_memory_utilization)
    graphs = cuda_graph_bytes if era.subtracts_cudagraph_estimate else 0
    avail = requested - weights_bytes - activation_peak_bytes - non_torch_bytes - graphs
    return Budget(requested, weights_bytes, activation_peak_bytes, non_torch_bytes, graphs, int(avail))


def extensible_kv_budget(
    era: Era, *, total_memory_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
    activation_peak_bytes: int, non_torch_bytes: int, cuda_graph_bytes: int, persistent_bytes: int = 0,
    other_processes_bytes: int = 0, baseline_bytes: int | None = None, platform: str = "cuda",
) -> Budget:
    """vLLM 0.34's KV budget with the extensible KV cache (bytes, per rank).

    Control flow (vllm/v1/engine/core.py ``_initialize_kv_caches``, 0.34): the profile
    (``determine_available_memory``, as 0.27–0.33 but with no CUDA-graph estimate:
    ``profile_cudagraph_memory`` returns 0 with the extensible cache) sizes only the address-space
    reservation, ``capacity = requested − (total_consumed + transient)``; warmup and CUDA-graph
    capture run against it; then ``measure_kv_cache_blocks`` sizes the cache from the memory free
    after them (:func:`measure_kv_cache_bytes`) and ``finalize_extensible_kv_cache`` takes the
    fewer blocks of the two.

    In this model's terms: ``non_kv_used = W + non-torch + persistent buffers + captured graphs``
    (``activation_peak_bytes`` holds the persistent buffers, ``persistent_bytes``, as in the 0.27+
    budget); ``transient = activation_peak_bytes − persistent_bytes`` (the profile's
    ``transient_peak_headroom``, the reserve the warmup may raise; torch reservation growth is not
    modelled, taken as no larger); ``init_free = T − other processes − baseline``
    (:func:`startup_baseline_bytes`); the margin floor by ``platform``
    (:data:`KV_CACHE_MARGIN_FLOOR_BYTES`). ``requested = ceil(T·u)``, u 1.0 by default; the
    free-memory refusal of ``request_memory`` does not apply (vllm/v1/worker/utils.py, 0.34).
    """
    requested = requested_memory_bytes(era, total_memory_bytes, gpu_memory_utilization)
    persistent = max(0, int(persistent_bytes))
    transient = max(0, int(activation_peak_bytes) - persistent)
    used = int(weights_bytes) + int(non_torch_bytes) + persistent + int(cuda_graph_bytes)
    baseline = int(STARTUP_BASELINE_GIB * GiB) if baseline_bytes is None else int(baseline_bytes)
    init_free = int(total_memory_bytes) - max(0, int(other_processes_bytes)) - baseline
    floor = KV_CACHE_MARGIN_FLOOR_BYTES.get(platform, KV_CACHE_MARGIN_FLOOR_BYTES["cuda"])
    margin = max(floor, int(transient * KV_CACHE_MARGIN_FRACTION))
    avail = measure_kv_cache_bytes(init_free_memory=init_free, free_memory=init_free - used, committed_bytes=0,
                                   requested_memory=requested, transient_peak_bytes=transient,
                                   margin_floor_bytes=floor)
    capacity = requested - int(weights_bytes) - int(activation_peak_bytes) - int(non_torch_bytes)
    return Budget(requested, int(weights_bytes), int(activation_peak_bytes), int(non_torch_bytes),
                  int(cuda_graph_bytes), int(min(avail, capacity)) if capacity > 0 else int(capacity),
                  headroom_bytes=init_free - used, margin_bytes=margin, transient_bytes=transient,
                  capacity_kv_cache_bytes=int(capacity))
