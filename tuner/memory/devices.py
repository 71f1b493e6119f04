"""GPU devices: a small catalog of common cards, and the device a drop names.

A :class:`Device` carries the **total memory the engine sees**, in bytes (an ``int``): the total of
CUDA's ``cudaMemGetInfo`` (``torch.cuda.mem_get_info()[1]``), which vLLM multiplies by
``gpu_memory_utilization``. That is slightly less than the physical size nvidia-smi / NVML print
(the driver keeps a reservation): an H100-80GB shows 81559 MiB in nvidia-smi but 79.19 GiB in vLLM.

A device is named in a drop as

- a catalog name or alias, case-insensitive (``"H100-80GB"``, ``"NVIDIA H100 80GB HBM3"``, ``"rtx 3090"``);
- a mapping ``{name: str, total_memory_gib: number}`` or ``{name: str, total_memory_bytes: int}``
  (GiB = 2**30 bytes), optionally with ``compute_capability: "9.0"``;
- ``"auto"``: GPU 0 of this machine, read through NVML (``pynvml``, imported lazily, so this module
  is importable without a GPU and never imports torch).

The catalog lives in ``tuner/data/gpus.yaml`` (package data); each entry says whether its total
was observed in a real vLLM log or is the card's typical value.
"""

from __future__ import annotations

import math
import os
import re
import types
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

import yaml

from tuner.errors import DeviceError

GIB = 1 << 30
MIB = 1 << 20

#: Interconnect classes (the same tuple as :data:`tuner.memory.budget.INTERCONNECTS`; kept here so this
#: module stays free of the budget's imports).
INTERCONNECTS = ("nvswitch", "nvlink", "pcie", "xgmi")

#: vLLM platforms a card runs (vllm/platforms/cuda.py, vllm/platforms/rocm.py).
PLATFORMS = ("cuda", "rocm")
#: Vendor words in a device name that mean an AMD card (vLLM's ROCm platform): what amdsmi /
#: ``torch.cuda.get_device_name`` print on ROCm ("AMD Instinct MI300X", "AMD Radeon PRO W7900").
ROCM_NAME_WORDS = ("amd", "instinct", "radeon")

#: Sanity bounds for a device's total memory given in a drop (bytes): 256 MiB … 4 TiB.
MIN_TOTAL_BYTES = 256 * MIB
MAX_TOTAL_BYTES = 4096 * GIB

_SOURCE_DROP = "given in drop"
_SOURCE_NVML = "nvml"

__all__ = ["Device", "catalog", "lookup", "resolve_device", "known_names", "unknown_message", "size_words", "GIB",
           "did_you_mean", "candidates_for", "platform_of_name"]


@dataclass(frozen=True)
class Device:
    """One GPU as the memory model sees it.

    Attributes:
        name: canonical catalog name (``"H100-80GB"``) or, for a card not in the catalog, the name
            as given / as NVML printed it.
        total_memory_bytes: total memory the engine sees (cudaMemGetInfo total), bytes.
        source: where the total comes from: ``"observed in vLLM log"``, ``"typical"``,
            ``"given in drop"`` or ``"nvml…"``.
        compute_capability: ``"major.minor"`` (``"9.0"``) or None when unknown.
        uuid: the GPU's UUID (``"GPU-…"``) when read from NVML, else None.
        free_memory_bytes: free memory at the time NVML was read, bytes; None for catalog devices.
    """

    name: str
    total_memory_bytes: int
    source: str
    compute_capability: str | None = None
    uuid: str | None = None
    free_memory_bytes: int | None = None
    #: How the card talks to its peers in a TP group: ``nvswitch``, ``nvlink``, ``pcie`` or
    #: ``xgmi`` (:data:`tuner.memory.budget.INTERCONNECTS`); None when unknown (the job then assumes PCIe
    #: without P2P and says so: :func:`tuner.jobs.job.topology_for`).
    interconnect: str | None = None
    #: CUDA peer-to-peer access between two such cards (None: unknown, taken as available).
    p2p: bool | None = None
    #: CUDA's ``is_integrated`` device property: GPU and CPU share one physical memory (DGX Spark
    #: GB10, Jetson); None when unknown. GH200/GB200 have their own HBM and are not integrated.
    integrated: bool | None = None
    #: The vLLM platform the card runs: ``"cuda"`` or ``"rocm"`` (catalog ``platform``; a card not in
    #: the catalog by its vendor words, :func:`platform_of_name`).
    platform: str = "cuda"

    @property
    def total_memory_gib(self) -> float:
        """Total memory in GiB (2**30 bytes), for display only."""
        return self.total_memory_bytes / GIB


def _key(text: str) -> str:
    """Lookup key: lower case, runs of blanks/'-'/'_' folded to one space."""
    return re.sub(r"[\s_\-]+", " ", text.strip().lower()).strip()


def _keys(text: str) -> set[str]:
    k = _key(text)
    out = {k}
    if k.startswith("nvidia "):
        out.add(k[len("nvidia "):])
    else:
        out.add("nvidia " + k)
    return out


@lru_cache(maxsize=1)
def _catalog_data() -> Any:
    """``tuner/data/gpus.yaml`` parsed once (libyaml's safe loader where PyYAML has it: the same
    document, several times faster than the pure-Python parser a cold CLI otherwise pays for)."""
    text = resources.files("tuner").joinpath("data/gpus.yaml").read_text(encoding="utf-8")
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@lru_cache(maxsize=1)
def _load_catalog() -> tuple[tuple[Device, ...], dict[str, Device]]:
    """Read and check ``tuner/data/gpus.yaml``; return (devices, index by lookup key).

    Raises:
        DeviceError: the catalog file is malformed or two entries share a name/alias.
    """
    where = "tuner/data/gpus.yaml"
    data = _catalog_data()
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise DeviceError("catalog must be a mapping with a 'gpus' list", where=where)
    devices: list[Device] = []
    index: dict[str, Device] = {}
    for i, entry in enumerate(data["gpus"]):
        if not isinstance(entry, dict):
            raise DeviceError(f"entry {i} is not a mapping", where=where)
        unknown = set(entry) - {"name", "total_memory_bytes", "compute_capability", "source", "aliases",
                                "interconnect", "p2p", "integrated", "platform"}
        if unknown:
            raise DeviceError(f"entry {i}: unknown keys {sorted(unknown)}", where=where)
        name, total = entry.get("name"), entry.get("total_memory_bytes")
        if not isinstance(name, str) or not name:
            raise DeviceError(f"entry {i}: 'name' must be a non-empty string", where=where)
        if type(total) is not int or total <= 0:
            raise DeviceError(f"{name}: 'total_memory_bytes' must be a positive integer", where=where)
        cc = entry.get("compute_capability")
        if cc is not None and not (isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc)):
            raise DeviceError(f"{name}: 'compute_capability' must be a string like \"9.0\"", where=where)
        aliases = entry.get("aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise DeviceError(f"{name}: 'aliases' must be a list of strings", where=where)
        ic = entry.get("interconnect")
        if ic is not None and ic not in INTERCONNECTS:
            raise DeviceError(f"{name}: 'interconnect' must be one of {', '.join(INTERCONNECTS)}", where=where)
        p2p = entry.get("p2p")
        if p2p is not None and not isinstance(p2p, bool):
            raise DeviceError(f"{name}: 'p2p' must be true or false", where=where)
        integrated = entry.get("integrated")
        if integrated is not None and not isinstance(integrated, bool):
            raise DeviceError(f"{name}: 'integrated' must be true or false", where=where)
        platform = entry.get("platform", "cuda")
        if platform not in PLATFORMS:
            raise DeviceError(f"{name}: 'platform' must be one of {', '.join(PLATFORMS)}", where=where)
        dev = Device(name=name, total_memory_bytes=total, source=str(entry.get("source") or "typical"),
                     compute_capability=cc, interconnect=ic, p2p=p2p, integrated=integrated, platform=platform)
        devices.append(dev)
        for alias in [name, *aliases]:
            for k in _keys(alias):
                other = index.get(k)
                if other is not None and other.name != name:
                    raise DeviceError(f"alias {alias!r} names both {other.name} and {name}", where=where)
                index[k] = dev
    return tuple(devices), index


def catalog() -> list[Device]:
    """Every catalog device, in catalog order."""
    return list(_load_catalog()[0])


def known_names() -> list[str]:
    """Canonical names of the catalog devices (for error messages and docs)."""
    return [d.name for d in _load_catalog()[0]]


#: Words NVML / vLLM print around a card's model name that do not tell cards apart: vendor and
#: brand prefixes, memory technology, form-factor words, and a trailing memory size in
#: parentheses (``(24G)``, ``(48GB)``). :func:`_base_key` drops them.
_NOISE_WORDS = ("nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon", "generation",
                "hbm3e", "hbm3", "hbm2e", "hbm2", "gddr7", "gddr6x", "gddr6", "server", "edition", "workstation",
                "sxm", "sxm2", "sxm4", "sxm5", "oam")
_MEM_SUFFIX_RE = re.compile(r"\(\s*\d+(?:\.\d+)?\s*(?:g|gb|gib)?\s*\)")
_SIZE_WORD_RE = re.compile(r"^\d+(?:\.\d+)?\s*(?:g|gb|gib)$")


def _base_key(text: str) -> str:
    """The card's model name without noise words or memory sizes: ``"NVIDIA H100 80GB HBM3"`` →
    ``"h100"``, ``"NVIDIA GeForce RTX 4090 (24G)"`` → ``"rtx 4090"``, ``"H20-141GB"`` → ``"h20"``."""
    k = _MEM_SUFFIX_RE.sub(" ", text.lower())
    words = [w for w in _key(k).split(" ") if w and w not in _NOISE_WORDS and not _SIZE_WORD_RE.match(w)]
    return " ".join(words)


@lru_cache(maxsize=1)
def _families() -> dict[str, tuple[Device, ...]]:
    """Base key (:func:`_base_key`) of every catalog name and alias → the devices it may mean."""
    out: dict[str, list[Device]] = {}
    for dev in _load_catalog()[0]:
        for k in {_base_key(a) for a in [dev.name, *_aliases(dev.name)]}:
            if k and dev not in out.setdefault(k, []):
                out[k].append(dev)
    return {k: tuple(v) for k, v in out.items()}


def _aliases(name: str) -> list[str]:
    return [a for a, d in _alias_table().items() if d == name]


@lru_cache(maxsize=1)
def _alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for entry in (_catalog_data() or {}).get("gpus") or []:
        for a in entry.get("aliases") or []:
            table[a] = entry["name"]
    return table


#: How far a known total may be from a catalog total and still pick that card among several
#: that share a model name (fraction): ECC, driver and display reservations move the total by
#: ~1 %; neighbouring memory sizes of one model differ by ≥ 20 % (A100 40/80, H20 96/141).
TOTAL_MATCH_TOLERANCE = 0.08


def _variants(base: str) -> tuple[Device, ...]:
    """Catalog cards whose model name extends ``base`` by a variant word (``"h100"`` → the H100
    PCIe and H100 NVL beside the SXM card whose base key is ``"h100"``)."""
    if not base:
        return ()
    out: list[Device] = []
    for k, devs in _families().items():
        if k.startswith(base + " "):
            out.extend(d for d in devs if d not in out)
    return tuple(out)


def candidates_for(name: str) -> tuple[Device, ...]:
    """Every catalog device ``name`` may mean: the exact match when there is one, else every card
    whose model name (:func:`_base_key`) equals the name's or extends it by a variant word
    (``"H100"``: H100-80GB, H100-PCIe, H100-NVL), in catalog order."""
    if not isinstance(name, str):
        return ()
    exact = _load_catalog()[1].get(_key(name))
    if exact is not None:
        return (exact,)
    base = _base_key(name)
    pool = list(_families().get(base, ()))
    pool += [d for d in _variants(base) if d not in pool]
    if not pool and "pcie" in base.split(" "):
        # a board word that names no separate catalog card ("NVIDIA L40S PCIe"): the model's cards
        # (where it does, "H100 PCIe", that card was found above)
        plain = " ".join(w for w in base.split(" ") if w != "pcie")
        pool = list(_families().get(plain, ()))
    order = {d.name: i for i, d in enumerate(_load_catalog()[0])}
    return tuple(sorted(pool, key=lambda d: order[d.name]))


def lookup(name: str, *, total_memory_bytes: int | None = None) -> Device | None:
    """The catalog device ``name`` names, or None.

    Matching: case-insensitive, blanks/'-'/'_' interchangeable, a leading "NVIDIA " optional; then
    the spellings NVML and vLLM print (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA GeForce RTX 4090
    (24G)"``, ``"... Server Edition"``) by the card's model name (:func:`_base_key`). A name that fits
    several cards (``"NVIDIA A100"``, ``"H20"``) is resolved by ``total_memory_bytes`` when given (the
    card within :data:`TOTAL_MATCH_TOLERANCE`, nearest first). Without a total, a memory size the
    name spells (``"H20 96GB"``, :func:`size_words`) selects among the model's cards and must match
    one (:data:`SIZE_WORD_TOLERANCE`): ``"NVIDIA H100 40GB"`` or ``"H200-999GB"`` names no catalog
    card (None; :func:`unknown_message` says why), never the card of another size. A name that still
    fits several cards stays ambiguous (None)."""
    if not isinstance(name, str):
        return None
    exact = _load_catalog()[1].get(_key(name))
    family = candidates_for(name) if exact is None else _families().get(_base_key(name), ())
    if total_memory_bytes:
        pool = list(family) + ([exact] if exact is not None and exact not in family else [])
        near = sorted(pool, key=lambda d: abs(d.total_memory_bytes - total_memory_bytes))
        if near and abs(near[0].total_memory_bytes - total_memory_bytes) <= TOTAL_MATCH_TOLERANCE * near[0].total_memory_bytes:
            return near[0]
        return exact if exact is not None else (family[0] if len(family) == 1 else None)
    if exact is not None:
        return exact
    sizes = size_words(name)
    found = tuple(d for d in family if _size_fits(d, sizes)) if sizes else family
    if sizes and len(found) > 1:  # the card whose total is nearest the size word, when one is
        gap = {d.name: sum(abs(d.total_memory_bytes / 1e9 - w) for w in sizes) for d in found}
        best = min(gap.values())
        found = tuple(d for d in found if gap[d.name] == best)
    return found[0] if len(found) == 1 else None


#: How far a memory size written in a device name (``"80GB"``, ``"(24G)"``) may be from a catalog
#: card's total, read as decimal GB (fraction): the engine's total of an "80GB" H100 is 85.03 GB
#: (79.19 GiB), of a "24G" RTX 4090 25.27 GB; a card with another memory size differs by ≥ 20 %
#: (A100 40/80, H20 96/141, RTX 5060 Ti 8/16).
SIZE_WORD_TOLERANCE = 0.12


def size_words(name: str) -> tuple[float, ...]:
    """The memory sizes (GB) a device name spells as whole words or a parenthesised suffix:
    ``"NVIDIA H100 40GB"`` → ``(40.0,)``, ``"RTX 4090 (24G)"`` → ``(24.0,)``; ``"A10G"`` → ``()``
    (a model name, not a size)."""
    text = name.lower()
    out = [float(m.group(1)) for m in re.finditer(r"\(\s*(\d+(?:\.\d+)?)\s*(?:g|gb|gib)?\s*\)", text)]
    for w in _key(_MEM_SUFFIX_RE.sub(" ", text)).split(" "):
        if _SIZE_WORD_RE.match(w):
            out.append(float(re.match(r"\d+(?:\.\d+)?", w).group(0)))
    return tuple(out)


def _size_fits(dev: Device, sizes: tuple[float, ...]) -> bool:
    """Every size word is within :data:`SIZE_WORD_TOLERANCE` of ``dev``'s total (decimal GB)."""
    gb = dev.total_memory_bytes / 1e9
    return all(abs(gb - s) <= SIZE_WORD_TOLERANCE * s for s in sizes)


def unknown_message(value: object) -> str:
    """Why :func:`lookup` found no card for ``value``: a memory size in the name that no card of
    that model has, several cards the name may mean, or an unknown name (with the known ones)."""
    return _unknown(value).message


#: How the command line and a drop give a card the catalog lacks (or one whose total is known).
TOTAL_FORMS = ("a mapping {name: ..., total_memory_gib: ...} in a drop, or NAME:GIB on the command line "
               "(--device 'NAME:GIB', optionally ':nvlink' / ':nvswitch' / ':pcie' / ':xgmi' after it)")


def _card(d: Device) -> str:
    return f"{d.name} ({d.total_memory_bytes / GIB:.2f} GiB, {d.interconnect or 'interconnect unknown'})"


def _compact(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text.lower())


def did_you_mean(value: str, n: int = 3) -> list[Device]:
    """Catalog cards a near-miss name may mean (for an error message): names and aliases that read
    the same without blanks (``"RTX4090"`` → RTX-4090) or are close spellings of it (difflib ratio
    ≥ 0.75 on the model name without vendor and noise words), best first."""
    import difflib

    if not isinstance(value, str) or not value.strip():
        return []
    spellings: dict[str, Device] = {}
    for dev in _load_catalog()[0]:
        for a in [dev.name, *_aliases(dev.name)]:
            spellings.setdefault(_compact(_base_key(a)), dev)
            spellings.setdefault(_compact(a), dev)
    probe = _compact(_base_key(value)) or _compact(value)
    if probe in spellings:  # the same letters, blanks aside: that card only
        return [spellings[probe]]
    out: list[Device] = []
    for cand in difflib.get_close_matches(probe, list(spellings), n=8,
                                                                                     cutoff=0.75):
        dev = spellings[cand]
        if dev not in out:
            out.append(dev)
    return out[:n]


def _unknown(value: object) -> DeviceError:
    several = candidates_for(value) if isinstance(value, str) else ()
    sizes = size_words(value) if isinstance(value, str) and several else ()
    if sizes and not any(_size_fits(d, sizes) for d in several):
        cards = ", ".join(f"{d.name} {d.total_memory_bytes / GIB:.2f} GiB" for d in several)
        return DeviceError(
            f"device {value!r}: its memory size {', '.join(f'{s:g} GB' for s in sizes)} matches no card of "
            f"that model in the catalog ({cards}); name the card as the catalog does, or give its total: "
            f"{TOTAL_FORMS}", where="device")
    if len(several) > 1:
        return DeviceError(
            f"device {value!r} may be any of {len(several)} cards: {', '.join(_card(d) for d in several)}; "
            f"did you mean one of them? Name it (e.g. {several[0].name!r}) or give the total, which picks the "
            f"card: {TOTAL_FORMS}", where="device")
    near = did_you_mean(value) if isinstance(value, str) else []
    hint = f"; did you mean {' or '.join(repr(d.name) for d in near)}?" if near else ";"
    return DeviceError(
        f"unknown device {value!r}{hint} known devices: {', '.join(known_names())}; or 'auto' (GPU 0 of this "
        f"host), or the card with its total: {TOTAL_FORMS}",
        where="device",
    )


def _compute_capability(nvml: Any, handle: Any, nvml_error: type) -> str | None:
    """``"major.minor"`` of an NVML device handle, or None where NVML cannot tell."""
    get_cc = getattr(nvml, "nvmlDeviceGetCudaComputeCapability", None)
    if get_cc is None:
        return None
    try:
        major, minor = get_cc(handle)
    except nvml_error:
        return None
    return f"{int(major)}.{int(minor)}"


def resolve_device(value: Any, *, nvml: Any = None, amdsmi: Any = None) -> Device:
    """Turn what a drop says about its device into a :class:`Device`.

    Args:
        value: a :class:`Device` (returned as is); a catalog name or alias; ``"auto"`` (GPU 0 of
            this machine via NVML); or a mapping ``{name, total_memory_gib | total_memory_bytes,
            compute_capability?}``. GiB are 2**30 bytes; the result holds integer bytes
            (``round(gib * 2**30)``).
        nvml: the NVML module to use for ``"auto"`` (default: ``import pynvml``); tests inject a fake.
        amdsmi: the AMD SMI module for ``"auto"`` on a host without an NVIDIA GPU (default: ``import
            amdsmi`` when ``nvml`` is not injected); tests inject a fake.

    Returns:
        The device. For ``"auto"`` see :func:`_resolve_auto` for how the total is chosen.

    Raises:
        DeviceError: unknown name (the message lists the known names); malformed mapping; for
            ``"auto"``: NVML not installed / not loadable, no NVIDIA GPU, or an NVML call failing.
    """
    if isinstance(value, Device):
        return value
    if isinstance(value, str):
        if _key(value) == "auto":
            try:
                return _resolve_auto(nvml)
            except DeviceError as exc:
                if "no NVIDIA GPU" not in exc.message or (nvml is not None and amdsmi is None):
                    raise
                amd = _resolve_auto_amd(amdsmi)  # an AMD host: what vLLM's ROCm platform reads
                if amd is None:
                    raise
                return amd
        dev = lookup(value)
        if dev is None:
            raise _unknown(value)
        return _board_from_name(value, dev)
    if isinstance(value, Mapping):
        return _resolve_mapping(value)
    raise DeviceError(
        f"a device is a name, 'auto' or a mapping {{name, total_memory_gib}}, not {type(value).__name__}",
        where="device",
    )


def _resolve_mapping(value: Mapping) -> Device:
    allowed = {"name", "total_memory_gib", "total_memory_bytes", "compute_capability", "interconnect", "p2p"}
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise DeviceError(f"unknown key {unknown[0]!r} in device mapping; allowed: {sorted(allowed)}",
                          where="device")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 128:
        raise DeviceError("device mapping needs 'name': a non-empty string (≤128 characters)", where="device.name")
    has_gib, has_bytes = "total_memory_gib" in value, "total_memory_bytes" in value
    if has_gib and has_bytes:
        raise DeviceError("device mapping needs exactly one of 'total_memory_gib' or 'total_memory_bytes'",
                          where="device")
    if not has_gib and not has_bytes:  # a catalog card whose interconnect / p2p the mapping states
        cat = lookup(name)
        if cat is None:
            raise DeviceError(f"device mapping needs 'total_memory_gib' or 'total_memory_bytes' for a card the "
                              f"catalog does not know ({_unknown(name).message})", where="device")
        total, fld = cat.total_memory_bytes, "device.name"
    elif has_gib:
        gib = value["total_memory_gib"]
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib):
            raise DeviceError(f"total_memory_gib must be a finite number, not {gib!r}", where="device.total_memory_gib")
        if not MIN_TOTAL_BYTES / GIB <= gib <= MAX_TOTAL_BYTES / GIB:  # before int(): 1e300 GiB overflows
            raise DeviceError(f"total memory {gib:g} GiB is outside {MIN_TOTAL_BYTES // MIB} MiB – "
                              f"{MAX_TOTAL_BYTES // GIB} GiB", where="device.total_memory_gib")
        total = int(round(gib * GIB))
        fld = "device.total_memory_gib"
    else:
        total = value["total_memory_bytes"]
        if type(total) is not int:
            raise DeviceError(f"total_memory_bytes must be an integer, not {total!r}",
                              where="device.total_memory_bytes")
        fld = "device.total_memory_bytes"
    if not MIN_TOTAL_BYTES <= total <= MAX_TOTAL_BYTES:
        raise DeviceError(
            f"total memory {total} bytes ({total / GIB:.2f} GiB) is outside {MIN_TOTAL_BYTES // MIB} MiB – "
            f"{MAX_TOTAL_BYTES // GIB} GiB", where=fld)
    cc = value.get("compute_capability")
    if cc is not None and not (isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc)):
        raise DeviceError(f"compute_capability must be a string like \"9.0\", not {cc!r}",
                          where="device.compute_capability")
    ic = value.get("interconnect")
    if ic is not None and ic not in INTERCONNECTS:
        raise DeviceError(f"interconnect must be one of {', '.join(INTERCONNECTS)}, not {ic!r}",
                          where="device.interconnect")
    p2p = value.get("p2p")
    if p2p is not None and not isinstance(p2p, bool):
        raise DeviceError(f"p2p must be true or false, not {p2p!r}", where="device.p2p")
    known = lookup(name, total_memory_bytes=total)
    if known is not None:
        cc = cc if cc is not None else known.compute_capability
        ic = ic if ic is not None else known.interconnect
        p2p = p2p if p2p is not None else known.p2p
    stated_total = has_gib or has_bytes
    return Device(name=(name.strip() if stated_total or known is None else known.name), total_memory_bytes=total,
                  source=_SOURCE_DROP if stated_total else known.source, compute_capability=cc,
                  interconnect=ic, p2p=p2p, integrated=known.integrated if known is not None else None,
                  platform=known.platform if known is not None else platform_of_name(name))


def _board_from_name(name: str, dev: Device) -> Device:
    """A printed name's board word over the catalog card's usual board: ``"NVIDIA A100-PCIE-40GB"``
    or ``"NVIDIA A100 80GB PCIe"`` is a PCIe card even where the catalog's A100 is the SXM board
    behind NVSwitch (vLLM keeps custom all-reduce off past two PCIe GPUs)."""
    if "pcie" in _key(name).split(" ") and dev.interconnect not in (None, "pcie"):
        import dataclasses

        return dataclasses.replace(dev, interconnect="pcie", source=f"{dev.source}; PCIe board (by its name)")
    return dev


def platform_of_name(name: str) -> str:
    """The vLLM platform of a card by the vendor words of its name (:data:`ROCM_NAME_WORDS`):
    ``"rocm"`` for ``"AMD Instinct MI300A"`` or ``"AMD Radeon PRO W7900"``, else ``"cuda"``."""
    words = set(_key(str(name)).split(" "))
    return "rocm" if words & set(ROCM_NAME_WORDS) else "cuda"


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _resolve_auto_amd(amdsmi: Any = None) -> Device | None:
    """GPU 0 of an AMD host through AMD SMI, as vLLM's ROCm platform reads it (vllm/platforms/rocm.py,
    0.34: ``get_device_name`` — ``amdsmi_get_gpu_asic_info`` ``market_name``; ``get_device_total_memory``
    — ``amdsmi_get_gpu_memory_total(handle, VRAM)``); free memory = VRAM total − VRAM in use
    (``amdsmi_get_gpu_memory_usage``). "GPU 0" is the first of ``HIP_VISIBLE_DEVICES`` /
    ``CUDA_VISIBLE_DEVICES`` when it is an index. The total is the catalog's when the card is known
    and AMD SMI's physical total is larger (hipMemGetInfo, which vLLM budgets, reports less). None
    where AMD SMI is not importable or sees no GPU (the caller keeps the NVML error).

    Raises:
        DeviceError: an AMD SMI query failing on a host that has it.
    """
    where = "device auto"
    if amdsmi is None:
        try:
            import amdsmi  # noqa: PLC0415 - lazy on purpose
        except ImportError:
            return None
    err: type[BaseException] = getattr(amdsmi, "AmdSmiException", Exception)
    try:
        amdsmi.amdsmi_init()
    except (err, OSError):
        return None
    try:
        handles = list(amdsmi.amdsmi_get_processor_handles())
        if not handles:
            return None
        visible = os.environ.get("HIP_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible else "0"
        index = int(first) if first.isdigit() else 0
        if index >= len(handles):
            raise DeviceError(f"HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES={visible!r} names GPU {first} but AMD SMI "
                              f"sees {len(handles)}", where=where)
        h = handles[index]
        name = str(amdsmi.amdsmi_get_gpu_asic_info(h).get("market_name") or "").strip() or "AMD GPU"
        vram = getattr(getattr(amdsmi, "AmdSmiMemoryType", None), "VRAM", "VRAM")
        total = int(amdsmi.amdsmi_get_gpu_memory_total(h, vram))
        used = int(amdsmi.amdsmi_get_gpu_memory_usage(h, vram))
    except err as exc:
        raise DeviceError(f"AMD SMI query failed: {exc}", where=where) from exc
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:  # noqa: BLE001 - shutdown failure must not mask the result
            pass
    free = max(0, total - used)
    known = lookup(name, total_memory_bytes=total)
    if known is None:
        return Device(name=name, total_memory_bytes=total, source="amdsmi", free_memory_bytes=free,
                      platform="rocm", interconnect=None)
    source = "amdsmi"
    if known.total_memory_bytes < total:
        free = max(0, free - (total - known.total_memory_bytes))
        total, source = known.total_memory_bytes, f"amdsmi; total from catalog ({known.source})"
    return Device(name=known.name, total_memory_bytes=total, source=source, compute_capability=known.compute_capability,
                  free_memory_bytes=free, interconnect=known.interconnect, p2p=known.p2p, integrated=known.integrated,
                  platform=known.platform)


def _resolve_auto(nvml: Any) -> Device:
    """GPU 0 as CUDA numbers it, read through NVML.

    "GPU 0" honours ``CUDA_VISIBLE_DEVICES`` (first entry: an index or a ``GPU-…``/``MIG-…`` UUID);
    without it, NVML index 0.

    Total memory: NVML reports the physical size, which is larger than what CUDA (and so vLLM)
    sees. When the card is in the catalog, the smaller of NVML's total and the catalog total is
    used (``source`` says so), so a prediction never assumes more memory than the engine gets;
    otherwise NVML's total is used as is (``source == "nvml"``), which overstates the engine's total
    by the driver reservation (~0.5 GiB on 80 GB cards). ``free_memory_bytes`` is NVML's free.

    Raises:
        DeviceError: "no NVIDIA GPU / NVML not available" (pynvml missing, library not found,
            nvmlInit failing, zero devices, CUDA_VISIBLE_DEVICES empty) or an NVML query failing.
    """
    where = "device auto"
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - lazy on purpose
        except ImportError as exc:
            raise DeviceError(f"no NVIDIA GPU / NVML not available: cannot import pynvml ({exc})",
                              where=where) from exc
    nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (nvml_error, OSError) as exc:
        raise DeviceError(f"no NVIDIA GPU / NVML not available: {exc}", where=where) from exc
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible is not None else None
        if first == "" or (first is not None and first.lstrip("-").isdigit() and int(first) < 0):
            raise DeviceError("no NVIDIA GPU / NVML not available: CUDA_VISIBLE_DEVICES hides every GPU",
                              where=where)
        count = nvml.nvmlDeviceGetCount()
        if count < 1:
            raise DeviceError("no NVIDIA GPU / NVML not available: NVML reports 0 devices", where=where)
        if first is None:
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
        elif first.isdigit():
            if int(first) >= count:
                raise DeviceError(f"CUDA_VISIBLE_DEVICES={visible!r} names GPU {first} but NVML sees {count}",
                                  where=where)
            handle = nvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(first)
        raw_name = _text(nvml.nvmlDeviceGetName(handle))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        cc = _compute_capability(nvml, handle, nvml_error)
        integrated_total = _integrated_total(raw_name)
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml_error:
            if integrated_total is None:
                raise
            mem = None  # GB10 / DGX Spark: no device-level memory query (nvidia-smi prints [N/A])
    except nvml_error as exc:
        raise DeviceError(f"NVML query failed: {exc}", where=where) from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutdown failure must not mask the result
            pass

    if integrated_total is not None:
        return _integrated_device(raw_name, mem, cc, uuid)
    total, free = int(mem.total), int(mem.free)
    known = lookup(raw_name, total_memory_bytes=total)
    if known is None:
        return Device(name=raw_name.strip(), total_memory_bytes=total, source=_SOURCE_NVML,
                      compute_capability=cc, uuid=uuid, free_memory_bytes=free)
    if known.total_memory_bytes < total:
        total, source = known.total_memory_bytes, f"{_SOURCE_NVML}; total from catalog ({known.source})"
    else:
        source = _SOURCE_NVML
    return Device(name=known.name, total_memory_bytes=total, source=source,
                  compute_capability=cc or known.compute_capability, uuid=uuid, free_memory_bytes=free,
                  interconnect=known.interconnect, p2p=known.p2p, integrated=known.integrated,
                  platform=known.platform)


def _integrated_total(raw_name: str) -> int | None:
    """The catalog total of an integrated (unified-memory) card NVML names, else None."""
    known = lookup(raw_name)
    return known.total_memory_bytes if known is not None and known.integrated else None


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's available memory (``MemAvailable``, bytes): what ``psutil.virtual_memory().available``
    returns on Linux, and what vLLM reads as an integrated GPU's free memory (vllm/utils/mem_utils.py
    ``MemorySnapshot.measure`` 0.26–0.33, ``device_memory_info`` 0.34). None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _integrated_device(raw_name: str, mem: Any, cc: str | None, uuid: str) -> Device:
    """An integrated GPU read through NVML as vLLM reads it: the total is CUDA's (NVML has no
    device memory query on GB10: vllm/platforms/cuda.py ``get_device_total_memory`` falls back to the
    CUDA device properties, 0.34; the catalog holds that CUDA total), the free memory the host's
    available memory (:func:`host_available_bytes`; NVML's free where the host's cannot be read)."""
    known = lookup(raw_name)
    total = known.total_memory_bytes
    free = host_available_bytes()
    how = "free = host MemAvailable"
    if free is None:
        free = int(mem.free) if mem is not None else None
        how = "free from NVML" if mem is not None else "free unknown"
    nvml_note = "no NVML memory query" if mem is None else "NVML total not used"
    return Device(name=known.name, total_memory_bytes=total,
                  source=f"{_SOURCE_NVML}; unified memory ({nvml_note}): total from catalog ({known.source}), {how}",
                  compute_capability=cc or known.compute_capability, uuid=uuid,
                  free_memory_bytes=None if free is None else min(int(free), total),
                  interconnect=known.interconnect, p2p=known.p2p, integrated=True, platform=known.platform)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of this host as NVML reports it (bytes are ints; NVML's physical totals).

    ``other_processes_bytes`` is the memory held by compute processes on the GPU
    (``nvmlDeviceGetComputeRunningProcesses``), None when NVML cannot say (e.g. in a container
    without the PID namespace); ``processes`` their count.
    """

    index: int
    name: str
    uuid: str
    total_memory_bytes: int
    free_memory_bytes: int
    used_memory_bytes: int
    other_processes_bytes: int | None
    processes: int | None
    compute_capability: str | None
    catalog_name: str | None

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def list_gpus(nvml: Any = None) -> list[GpuInfo]:
    """Every NVIDIA GPU NVML sees, in NVML order (``CUDA_VISIBLE_DEVICES`` is not applied).

    Args:
        nvml: the NVML module (default ``import pynvml``, lazily); tests inject a fake.

    Raises:
        DeviceError: "no NVIDIA GPU / NVML not available" (pynvml missing, library or driver not
            found, 0 devices) or an NVML query failing (the message names the call's error).
    """
    where = "devices"
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - lazy on purpose
        except ImportError as exc:
            raise DeviceError(f"no NVIDIA GPU / NVML not available: cannot import pynvml ({exc})", where=where) from exc
    nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (nvml_error, OSError) as exc:
        raise DeviceError(f"no NVIDIA GPU / NVML not available: {exc}", where=where) from exc
    out: list[GpuInfo] = []
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count < 1:
            raise DeviceError("no NVIDIA GPU / NVML not available: NVML reports 0 devices", where=where)
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(nvml.nvmlDeviceGetName(h)).strip()
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
            except nvml_error:
                if _integrated_total(name) is None:
                    raise
                # GB10: no device memory query; the CUDA total and the host's available memory
                d = _integrated_device(name, None, None, "")
                mem = types.SimpleNamespace(total=d.total_memory_bytes, free=d.free_memory_bytes or 0,
                                            used=d.total_memory_bytes - (d.free_memory_bytes or 0))
            others: int | None = None
            nproc: int | None = None
            get_procs = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses", None)
            if get_procs is not None:
                try:
                    procs = list(get_procs(h))
                    nproc = len(procs)
                    used = [getattr(p, "usedGpuMemory", None) for p in procs]
                    others = None if any(u is None for u in used) else int(sum(int(u) for u in used))
                except nvml_error:
                    others = nproc = None
            cc = _compute_capability(nvml, h, nvml_error)
            known = lookup(name, total_memory_bytes=int(mem.total))
            out.append(GpuInfo(index=i, name=name, uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                               total_memory_bytes=int(mem.total), free_memory_bytes=int(mem.free),
                               used_memory_bytes=int(mem.used), other_processes_bytes=others, processes=nproc,
                               compute_capability=cc, catalog_name=known.name if known else None))
    except nvml_error as exc:
        raise DeviceError(f"NVML query failed: {exc}", where=where) from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutdown failure must not mask the result
            pass
    return out


def require_gpu(method: str, nvml: Any = None) -> list[GpuInfo]:
    """The GPUs of this host, for a ``method`` that needs one (``cuda``, ``vllm``).

    Raises:
        DeviceError: "method 'cuda' needs an NVIDIA GPU: …" when there is none or NVML fails.
    """
    try:
        return list_gpus(nvml)
    except DeviceError as exc:
        raise DeviceError(f"method {method!r} needs an NVIDIA GPU: {exc.message}", where=f"method {method}") from exc


def device_label(dev: Mapping[str, Any]) -> str:
    """``NAME (TOTAL GiB)`` for a report header; a device list (one card per pipeline stage) names each
    stage's card with its own total (``A100-40GB (39.39 GiB) | H100-80GB (79.19 GiB)``), never one
    total after the joined names, which read as the last card's size."""
    stages = dev.get("stages") or []
    if len({(s.get("name"), s.get("total_memory_bytes")) for s in stages}) > 1:
        return " | ".join(f"{s['name']} ({s['total_memory_bytes'] / 2**30:.2f} GiB)" for s in stages)
    return f"{dev['name']} ({dev['total_memory_bytes'] / 2**30:.2f} GiB)"
