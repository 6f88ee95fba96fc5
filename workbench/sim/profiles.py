"""Hardware profiles and target-model sizes for the *modeled* clock.

The workbench keeps two clocks (see ``docs/hardware-profiles.md``): the *measured* clock is the
wall time of what really ran on this machine; the *modeled* clock replays the same trace of
decisions (hits, misses, prefetches, expert computations) on a discrete-event timeline whose
durations come from this module. Nothing here is ever measured at run time.

* :class:`HardwareProfile` — cost figures of one accelerator plus the link experts are fetched
  over (PCIe for host-offloaded experts, the NVMe read path for SSD swap on Jetson).
* :class:`TargetModel` — the sizes of a real VL-MoE whose costs a (small, embedded) model's trace
  is priced with, so a trace recorded on a CPU can be replayed "as if" it were Qwen3-VL-30B-A3B on
  an A100.

Every figure carries its source in ``sources``; figures that are assumptions say so in ``notes``
and in the document. Units are SI base units throughout: bytes, seconds, FLOP/s, bytes/s.
Memory *capacities* quoted by vendors as "GB" are binary (GiB, as the HBM/GDDR stacks are built
and as ``nvidia-smi`` reports them); *bandwidths* are decimal (1 GB/s = 1e9 B/s); model weight
sizes follow the VisMMOE paper and Hugging Face listings, which are decimal (1 MB = 1e6 B).

Pure standard library: importing this module never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.errors import KnobError

__all__ = [
    "HardwareProfile",
    "TargetModel",
    "PROFILES",
    "TARGET_MODELS",
    "get_profile",
    "get_target_model",
    "available_profiles",
    "available_target_models",
    "Interconnect",
    "INTERCONNECTS",
    "get_interconnect",
    "available_interconnects",
]

# Unit helpers (module-private; figures below are written in the unit their source uses).
_MB = 10**6
_GB = 10**9
_GiB = 2**30
_TFLOPS = 1e12
_US = 1e-6

# PCIe per-direction theoretical bandwidth of an x16 link: lanes x GT/s x 128b/130b encoding / 8.
# PCIe 4.0: 16 GT/s -> 31.5 GB/s; PCIe 5.0: 32 GT/s -> 63.0 GB/s (PCI-SIG base specifications).
_PCIE4_X16 = 31.5 * _GB
_PCIE5_X16 = 63.0 * _GB
# Achievable fraction of theoretical for large pinned host->device copies. ASSUMPTION, chosen
# from public measurements (see docs/hardware-profiles.md, "Link bandwidth"): A100-SXM4-40GB
# host_to_device_memcpy_sm 25.13 GB/s on PCIe 4.0 (NVIDIA/nvbandwidth#42, 80 % of 31.5);
# "almost 80 % of full PCIe Gen 4" (NVIDIA/nvbandwidth#50); 25 GB/s measured peak on PCIe 4.0 x16
# (ZaidQureshi/bam#54); H100 device_to_host_memcpy_sm 52.77 GB/s on PCIe 5.0 (NVIDIA/nvbandwidth#24,
# 84 % of 63).
_PCIE_EFFICIENCY = 0.80

# Fixed per-operation costs. ASSUMPTIONS (typical orders of magnitude, not vendor figures).
_PCIE_TRANSFER_LATENCY = 10 * _US  # cudaMemcpyAsync submission + DMA setup per expert copy
_CUDA_KERNEL_OVERHEAD = 5 * _US  # one kernel launch on a discrete GPU with an x86 host
_JETSON_KERNEL_OVERHEAD = 10 * _US  # launch from the slower Cortex-A78AE host cores
_NVME_SWAP_LATENCY = 100 * _US  # page-fault + NVMe read submission per swapped-in expert


def _positive(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a finite number above 0, not {value!r}")


def _non_negative(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be a finite number of at least 0, not {value!r}")


def _count(owner: str, name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be at least {minimum}, not {value}")


def _text(owner: str, name: str, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}.{name} must be a non-empty string, not {value!r}")


def _sources(owner: str, value: tuple[str, ...]) -> None:
    if not isinstance(value, tuple) or not value:
        raise ValueError(f"{owner}.sources must be a non-empty tuple of strings, not {value!r}")
    for item in value:
        _text(owner, "sources[...]", item)


def _amount(owner: str, name: str, value: float) -> float:
    """A work amount (bytes or FLOPs) given to a cost function: finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {name} must be a number, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite number of at least 0, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class HardwareProfile:
    """Cost figures of one accelerator + its expert-offload link, for the *modeled* clock only."""

    name: str  # registry key, e.g. "a100-40gb"
    label: str  # human label, e.g. "NVIDIA A100-40GB (PCIe 4.0 x16)"
    device_memory_bytes: int
    device_flops: float  # dense bf16/fp16 tensor FLOP/s (no sparsity)
    device_mem_bandwidth: float  # device memory bytes/s
    link: str  # "PCIe 4.0 x16", "PCIe 5.0 x16", "NVMe SSD (swap)"
    link_bandwidth: float  # host (or SSD) -> device bytes/s achievable for large pinned copies
    link_latency_s: float  # fixed cost per transfer (DMA setup / driver / IO submission), seconds
    kernel_overhead_s: float  # fixed cost per compute op (kernel launch), seconds
    host_flops: float  # host CPU dense FLOP/s (for GPU-CPU hybrid expert execution)
    host_mem_bandwidth: float  # host memory bytes/s
    sources: tuple[str, ...]  # citations: datasheet names/URLs + where each figure comes from
    notes: str = ""  # assumptions and derivations, e.g. "link bandwidth = 80 % of theoretical"
    #: dense FP8 / FP4 tensor FLOP/s; None: the GPU has no such tensor cores (then a
    #: low-precision expert is priced as a native one: no speedup is invented)
    fp8_flops: float | None = None
    fp4_flops: float | None = None

    def __post_init__(self) -> None:
        owner = f"HardwareProfile({self.name!r})"
        _text(owner, "name", self.name)
        _text(owner, "label", self.label)
        _text(owner, "link", self.link)
        _count(owner, "device_memory_bytes", self.device_memory_bytes, 1)
        for name in (
            "device_flops",
            "device_mem_bandwidth",
            "link_bandwidth",
            "host_flops",
            "host_mem_bandwidth",
        ):
            _positive(owner, name, getattr(self, name))
        _non_negative(owner, "link_latency_s", self.link_latency_s)
        _non_negative(owner, "kernel_overhead_s", self.kernel_overhead_s)
        _sources(owner, self.sources)
        for name in ("fp8_flops", "fp4_flops"):
            if getattr(self, name) is not None:
                _positive(owner, name, getattr(self, name))
        if not isinstance(self.notes, str):
            raise ValueError(f"{owner}.notes must be a string, not {self.notes!r}")

    def transfer_time(self, nbytes: int) -> float:
        """Modeled seconds to move ``nbytes`` over the link.

        ``link_latency_s + nbytes / link_bandwidth``.
        One call is one transfer, so the fixed latency is paid even for ``nbytes == 0``; callers
        that move nothing should not call it.
        """
        size = _amount(f"{self.name}.transfer_time", "nbytes", nbytes)
        return self.link_latency_s + size / self.link_bandwidth

    def compute_time(self, flops: float, nbytes: float) -> float:
        """Modeled seconds of one device op (roofline).

        ``kernel_overhead_s + max(flops / device_flops, nbytes / device_mem_bandwidth)``, where
        ``nbytes`` is the device-memory traffic of the op (weights read + activations in/out).
        """
        work = _amount(f"{self.name}.compute_time", "flops", flops)
        traffic = _amount(f"{self.name}.compute_time", "nbytes", nbytes)
        return self.kernel_overhead_s + max(
            work / self.device_flops, traffic / self.device_mem_bandwidth
        )

    def supports(self, precision: str) -> bool:
        """Whether the GPU has tensor cores of ``precision`` (``native`` always)."""
        return precision == "native" or {"fp8": self.fp8_flops,
                                         "nvfp4": self.fp4_flops}.get(precision) is not None

    def precision_compute_time(self, flops: float, nbytes: float, precision: str) -> float:
        """:meth:`compute_time` of an op run in ``precision`` (``native``, ``fp8``,
        ``nvfp4``): the precision's tensor rate, and ``nbytes`` (weights) scaled from 16 to
        its bits (8; NVFP4 4.5 with its group scales). A precision the GPU lacks is priced as
        native (:meth:`supports`): the profile says so rather than invent a speedup."""
        if precision == "native" or not self.supports(precision):
            return self.compute_time(flops, nbytes)
        rate = self.fp8_flops if precision == "fp8" else self.fp4_flops
        bits = 8.0 if precision == "fp8" else 4.0 + 8.0 / 16
        work = _amount(f"{self.name}.compute_time", "flops", flops)
        traffic = _amount(f"{self.name}.compute_time", "nbytes", nbytes) * bits / 16.0
        return self.kernel_overhead_s + max(work / rate, traffic / self.device_mem_bandwidth)

    def host_compute_time(self, flops: float, nbytes: float) -> float:
        """Modeled seconds of one op run on the host CPU (GPU-CPU hybrid mode), roofline.

        ``max(flops / host_flops, nbytes / host_mem_bandwidth)``. No launch overhead is added: the
        host runs the op in an already-running worker thread. Moving the activations between
        device and host is a separate transfer the caller models with :meth:`transfer_time`.
        """
        work = _amount(f"{self.name}.host_compute_time", "flops", flops)
        traffic = _amount(f"{self.name}.host_compute_time", "nbytes", nbytes)
        return max(work / self.host_flops, traffic / self.host_mem_bandwidth)

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte where device compute and memory take equal time (roofline ridge)."""
        return self.device_flops / self.device_mem_bandwidth


@dataclass(frozen=True)
class TargetModel:
    """A real model whose sizes the small model's trace is costed with (modeled)."""

    name: str  # "qwen3-vl-30b-a3b", "deepseek-vl2"
    label: str
    num_layers: int  # MoE layers (decoder layers that hold routed experts)
    num_experts: int  # routed experts per layer
    top_k: int
    shared_experts: int
    hidden_size: int
    moe_intermediate_size: int
    expert_bytes: int  # bytes of one routed expert as offloaded (VisMMOE Table 2)
    backbone_bytes: int  # resident non-routed-expert weights
    dense_flops_per_token_per_layer: float  # attention + router (+ shared experts), 2*params rule
    expert_flops_per_token: float  # one routed expert per token: 2 * 3 * hidden * moe_intermediate
    sources: tuple[str, ...]
    notes: str = ""

    def __post_init__(self) -> None:
        owner = f"TargetModel({self.name!r})"
        _text(owner, "name", self.name)
        _text(owner, "label", self.label)
        _count(owner, "num_layers", self.num_layers, 1)
        _count(owner, "num_experts", self.num_experts, 1)
        _count(owner, "top_k", self.top_k, 1)
        _count(owner, "shared_experts", self.shared_experts, 0)
        _count(owner, "hidden_size", self.hidden_size, 1)
        _count(owner, "moe_intermediate_size", self.moe_intermediate_size, 1)
        _count(owner, "expert_bytes", self.expert_bytes, 1)
        _count(owner, "backbone_bytes", self.backbone_bytes, 0)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{owner}.top_k must be at most num_experts ({self.num_experts}), not {self.top_k}"
            )
        _positive(owner, "dense_flops_per_token_per_layer", self.dense_flops_per_token_per_layer)
        _positive(owner, "expert_flops_per_token", self.expert_flops_per_token)
        _sources(owner, self.sources)
        if not isinstance(self.notes, str):
            raise ValueError(f"{owner}.notes must be a string, not {self.notes!r}")

    @property
    def expert_params(self) -> int:
        """Parameters of one routed SwiGLU expert: gate, up and down projections (no biases)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def derived_expert_bytes(self, bytes_per_param: int = 2) -> int:
        """Size of one routed expert computed from the config (bf16 by default).

        Compare with :attr:`expert_bytes`, the size the VisMMOE paper reports as offloaded; for
        Qwen3-VL-30B-A3B the two differ (see ``notes``).
        """
        _count(f"TargetModel({self.name!r})", "bytes_per_param", bytes_per_param, 1)
        return self.expert_params * bytes_per_param

    @property
    def layer_expert_bytes(self) -> int:
        """Bytes of all routed experts of one MoE layer (``S_layer`` in the pinned-prefix bound)."""
        return self.num_experts * self.expert_bytes


# ---------------------------------------------------------------------------------------------
# Hardware profiles
# ---------------------------------------------------------------------------------------------

_SRC_PCIE = (
    "PCI-SIG PCIe 4.0 / 5.0 base specifications: 16 / 32 GT/s per lane, 128b/130b encoding "
    "-> 31.5 / 63.0 GB/s per direction for x16 (theoretical link bandwidth)"
)
_SRC_PCIE4_MEASURED = (
    "Effective PCIe 4.0 bandwidth evidence: NVIDIA/nvbandwidth issue #42 "
    "(https://github.com/NVIDIA/nvbandwidth/issues/42, A100-SXM4-40GB host_to_device_memcpy_sm "
    "25.13 GB/s); issue #50 (https://github.com/NVIDIA/nvbandwidth/issues/50, 'almost 80% of full "
    "PCIe Gen 4'); ZaidQureshi/bam issue #54 (https://github.com/ZaidQureshi/bam/issues/54, "
    "25 GB/s measured peak on PCIe 4.0 x16)"
)
_SRC_PCIE5_MEASURED = (
    "Effective PCIe 5.0 bandwidth evidence: NVIDIA/nvbandwidth issue #24 "
    "(https://github.com/NVIDIA/nvbandwidth/issues/24, H100 device_to_host_memcpy_sm 52.77 GB/s)"
)
_SRC_VISMMOE = (
    "VisMMOE (Xu, Hou, Liu, Li; ASPLOS '27; docs/references.md), "
    "Sec. 4.1.1 and Table 2"
)

_NOTE_COMMON = (
    "Compute and memory figures are vendor peak numbers (dense, no sparsity); the modeled clock is "
    "a roofline lower bound, not a prediction of achieved throughput. Link bandwidth = 80 % of the "
    "theoretical PCIe x16 figure (ASSUMPTION backed by the cited measurements). link_latency_s "
    "(10 us) and kernel_overhead_s (5 us) are ASSUMPTIONS (typical orders of magnitude). "
    "Memory capacity is binary (GiB)."
)

_A100_40GB = HardwareProfile(
    name="a100-40gb",
    label="NVIDIA A100-40GB (PCIe 4.0 x16)",
    device_memory_bytes=40 * _GiB,
    device_flops=312 * _TFLOPS,
    device_mem_bandwidth=1555 * _GB,
    link="PCIe 4.0 x16",
    link_bandwidth=_PCIE_EFFICIENCY * _PCIE4_X16,
    link_latency_s=_PCIE_TRANSFER_LATENCY,
    kernel_overhead_s=_CUDA_KERNEL_OVERHEAD,
    host_flops=64 * 2.25e9 * 32,
    host_mem_bandwidth=8 * 3200e6 * 8,
    sources=(
        "NVIDIA A100 Tensor Core GPU datasheet "
        "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): A100 40GB, BF16 Tensor Core "
        "312 TFLOPS dense (624 with sparsity), 40 GB HBM2, 1,555 GB/s, PCIe Gen4",
        _SRC_PCIE,
        _SRC_PCIE4_MEASURED,
        "Host CPU: AMD EPYC 7742 (64 cores, 2.25 GHz base, 8 channels DDR4-3200), the CPU of the "
        "NVIDIA DGX A100 (https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100); "
        "one socket assumed",
        _SRC_VISMMOE + ": A100-40GB workstation (host CPU not stated in the paper)",
    ),
    notes=_NOTE_COMMON
    + " Host CPU is an ASSUMPTION (VisMMOE does not name it): one AMD EPYC 7742 socket; "
    "host_flops = 64 cores x 2.25 GHz x 32 FP32 FLOP/cycle (two 256-bit AVX2 FMA pipes; Zen 2 "
    "has no bf16 arithmetic, experts are computed in fp32) = 4.61 TFLOP/s; host_mem_bandwidth = "
    "8 channels x 3200 MT/s x 8 B = 204.8 GB/s.",
)

_RTX_3090 = HardwareProfile(
    name="rtx-3090",
    label="NVIDIA GeForce RTX 3090 (PCIe 4.0 x16)",
    device_memory_bytes=24 * _GiB,
    device_flops=71 * _TFLOPS,
    device_mem_bandwidth=936 * _GB,
    link="PCIe 4.0 x16",
    link_bandwidth=_PCIE_EFFICIENCY * _PCIE4_X16,
    link_latency_s=_PCIE_TRANSFER_LATENCY,
    kernel_overhead_s=_CUDA_KERNEL_OVERHEAD,
    host_flops=16 * 3.4e9 * 32,
    host_mem_bandwidth=2 * 3200e6 * 8,
    sources=(
        "NVIDIA Ampere GA102 GPU Architecture whitepaper V2.0, Appendix A (GeForce RTX 3090): "
        "Peak FP16 / BF16 Tensor TFLOPS with FP32 accumulate 71 dense (142 with sparsity; "
        "142 / 284 with FP16 accumulate), 24 GB GDDR6X, 936 GB/s, PCIe Gen 4",
        _SRC_PCIE,
        _SRC_PCIE4_MEASURED,
        "Host CPU: AMD Ryzen 9 5950X (16 cores, 3.4 GHz base, dual-channel DDR4-3200) - "
        "assumed desktop host",
        _SRC_VISMMOE + ": single RTX 3090 24 GB (host CPU not stated in the paper)",
    ),
    notes=_NOTE_COMMON
    + " device_flops uses the FP32-accumulate rate (71 TFLOPS), which is what bf16 GEMMs with fp32 "
    "accumulation get on GeForce Ampere; the 142 TFLOPS FP16-accumulate figure does not apply. "
    "Host CPU is an ASSUMPTION: AMD Ryzen 9 5950X; host_flops = 16 x 3.4 GHz x 32 FP32 "
    "FLOP/cycle (AVX2 FMA, fp32) = 1.74 TFLOP/s; host_mem_bandwidth = 2 x 3200 MT/s x 8 B = "
    "51.2 GB/s.",
)

_H200 = HardwareProfile(
    name="h200",
    label="NVIDIA H200 SXM 141GB (PCIe 5.0 x16 host link)",
    device_memory_bytes=141 * _GiB,
    device_flops=989 * _TFLOPS,
    device_mem_bandwidth=4.8e12,
    link="PCIe 5.0 x16",
    link_bandwidth=_PCIE_EFFICIENCY * _PCIE5_X16,
    link_latency_s=_PCIE_TRANSFER_LATENCY,
    kernel_overhead_s=_CUDA_KERNEL_OVERHEAD,
    host_flops=56 * 2.0e9 * 1024,
    host_mem_bandwidth=8 * 4800e6 * 8,
    fp8_flops=1979 * _TFLOPS,
    sources=(
        "NVIDIA H200 Tensor Core GPU product page / datasheet "
        "(https://www.nvidia.com/en-us/data-center/h200/): H200 SXM BF16 Tensor Core 1,979 TFLOPS "
        "with sparsity (989 dense), FP8 Tensor Core 3,958 TFLOPS with sparsity (1,979 dense), "
        "141 GB HBM3e, 4.8 TB/s; Hopper has no FP4 tensor cores",
        "MLPerf Inference v4.1, NVIDIA H200-SXM-141GBx8 system description "
        "(https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/NVIDIA/"
        "systems/H200-SXM-141GBx8_TRT_MaxQ.json): accelerator_host_interconnect 'PCIe Gen5 x16', "
        "host CPU Intel Xeon Platinum 8480C (56 cores)",
        _SRC_PCIE,
        _SRC_PCIE5_MEASURED,
        "Intel AMX: 1024 BF16 operations per cycle per core on 4th Gen Xeon Scalable "
        "(https://en.wikipedia.org/wiki/Advanced_Matrix_Extensions, citing Intel's AMX overview)",
    ),
    notes=_NOTE_COMMON
    + " The SXM part is modeled; the H200 NVL (PCIe card) has the same 141 GB / 4.8 TB/s but a "
    "lower clock: NVIDIA lists 1,671 TFLOPS BF16 with sparsity (about 836 dense) - not used here. "
    "Host CPU: one Intel Xeon Platinum 8480C socket (as in the MLPerf H200 system); host_flops = "
    "56 cores x 2.0 GHz (base clock, ASSUMED equal to the 8480+) x 1024 BF16 FLOP/cycle (AMX) = "
    "114.7 TFLOP/s theoretical peak, far above what AMX GEMMs sustain in practice; "
    "host_mem_bandwidth = 8 channels x DDR5-4800 x 8 B = 307.2 GB/s (ASSUMED 1 DIMM per channel).",
)

_JETSON_SOURCES = (
    "NVIDIA Jetson AGX Orin Series data sheet / technical brief and product page "
    "(https://www.nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/): "
    "AGX Orin 64GB: 2048-core Ampere GPU with 64 Tensor Cores (16 SMs) at up to 1.3 GHz, "
    "12-core Arm Cortex-A78AE at up to 2.2 GHz, 64 GB 256-bit LPDDR5 at 204.8 GB/s; "
    "AGX Orin 32GB: 1792-core GPU with 56 Tensor Cores (14 SMs) at up to 930 MHz, "
    "8-core Cortex-A78AE at up to 2.2 GHz, 32 GB LPDDR5 at 204.8 GB/s",
    "NVIDIA Deep-Learning-Accelerator-SW README (https://github.com/NVIDIA/Deep-Learning-"
    "Accelerator-SW): Jetson AGX Orin 64GB, MAXN, GPU sparse INT8 peak 171 TOPS",
    "Samsung NVMe SSD 980 PRO data sheet rev. 2.1 (https://download.semiconductor.samsung.com/"
    "resources/data-sheet/Samsung-NVMe-SSD-980-PRO-Data-Sheet_Rev.2.1_230509_10129505081019.pdf): "
    "sequential read up to 7,000 MB/s (PCIe 4.0 x4)",
    _SRC_VISMMOE + ": Jetson AGX Orin (32 GB) with a Samsung 980 PRO used as Linux swap; "
    "'theoretical sequential read bandwidth of 7,000 MB/s and around 3,000 MB/s in our "
    "practical setup'",
)

_JETSON_NOTES = (
    "Unified memory: device_memory_bytes is the whole LPDDR5 pool shared with the CPU and the OS, "
    "and host_mem_bandwidth is the same 204.8 GB/s bus as device_mem_bandwidth (GPU and CPU "
    "contend for it; the model does not subtract one from the other). The link is the SSD read "
    "path of Linux swap: link_bandwidth = 3.0 GB/s, the practical read bandwidth VisMMOE reports "
    "for its Samsung 980 PRO (datasheet peak 7.0 GB/s). device_flops is DERIVED, not a vendor "
    "figure: GPU sparse INT8 171 TOPS (64GB, MAXN) / 2 (dense) / 2 (FP16 tensor rate = half the "
    "INT8 rate, as on GA100) = 42.75 TFLOP/s, i.e. 2048 dense FP16 FLOP per clock per SM, "
    "consistent with 16 SMs x 1.3 GHz x 2048 = 42.6 TFLOP/s. host_flops = cores x 2.2 GHz x "
    "16 FP32 FLOP/cycle (two 128-bit NEON FMA pipes per Cortex-A78AE; ASSUMPTION). "
    "link_latency_s = 100 us per swapped-in expert (page fault + NVMe submission) and "
    "kernel_overhead_s = 10 us are ASSUMPTIONS. Memory capacity is binary (GiB)."
)

_JETSON_ORIN = HardwareProfile(
    name="jetson-orin",
    label="NVIDIA Jetson AGX Orin 64GB (experts swapped from NVMe SSD)",
    device_memory_bytes=64 * _GiB,
    device_flops=171 * _TFLOPS / 4,
    device_mem_bandwidth=204.8 * _GB,
    link="NVMe SSD (swap)",
    link_bandwidth=3000.0 * _MB,
    link_latency_s=_NVME_SWAP_LATENCY,
    kernel_overhead_s=_JETSON_KERNEL_OVERHEAD,
    host_flops=12 * 2.2e9 * 16,
    host_mem_bandwidth=204.8 * _GB,
    sources=_JETSON_SOURCES,
    notes=_JETSON_NOTES,
)

_JETSON_ORIN_32GB = HardwareProfile(
    name="jetson-orin-32gb",
    label="NVIDIA Jetson AGX Orin 32GB (experts swapped from NVMe SSD; VisMMOE's device)",
    device_memory_bytes=32 * _GiB,
    device_flops=14 * 930e6 * 2048,
    device_mem_bandwidth=204.8 * _GB,
    link="NVMe SSD (swap)",
    link_bandwidth=3000.0 * _MB,
    link_latency_s=_NVME_SWAP_LATENCY,
    kernel_overhead_s=_JETSON_KERNEL_OVERHEAD,
    host_flops=8 * 2.2e9 * 16,
    host_mem_bandwidth=204.8 * _GB,
    sources=_JETSON_SOURCES,
    notes=_JETSON_NOTES
    + " For the 32GB module device_flops = 14 SMs x 930 MHz x 2048 FLOP/clock/SM = 26.7 TFLOP/s "
    "(DERIVED with the per-SM rate of the 64GB module) and the CPU has 8 cores.",
)

_B200 = HardwareProfile(
    name="b200",
    label="NVIDIA B200 (HGX/DGX B200, 180 GB; PCIe 5.0 x16 host link)",
    device_memory_bytes=180 * _GiB,
    device_flops=2250 * _TFLOPS,
    device_mem_bandwidth=7.7e12,
    link="PCIe 5.0 x16",
    link_bandwidth=_PCIE_EFFICIENCY * _PCIE5_X16,
    link_latency_s=_PCIE_TRANSFER_LATENCY,
    kernel_overhead_s=_CUDA_KERNEL_OVERHEAD,
    host_flops=56 * 2.1e9 * 1024,
    host_mem_bandwidth=8 * 5600e6 * 8,
    fp8_flops=4500 * _TFLOPS,
    fp4_flops=9000 * _TFLOPS,
    sources=(
        "NVIDIA Blackwell datasheet, 'Individual Blackwell GPU Specifications', HGX B200 "
        "column (https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703): FP4 Tensor "
        "Core 18 PFLOPS, FP8/FP6 9 PFLOPS, FP16/BF16 4.5 PFLOPS - all with sparsity ('dense is "
        "one-half'); 180 GB HBM3e, 7.7 TB/s; NVLink 5 1.8 TB/s; PCIe Gen5 128 GB/s",
        "NVIDIA DGX B200 product page (https://www.nvidia.com/en-us/data-center/dgx-b200/): 8 "
        "GPUs, 1,440 GB GPU memory, 2 Intel Xeon Platinum 8570 processors (112 cores)",
        "NVIDIA PTX ISA (https://docs.nvidia.com/cuda/parallel-thread-execution/): FP4 (E2M1 "
        "with block scales, NVFP4) tensor MMA, tcgen05.mma .kind::mxf4nvf4, on sm_100a "
        "(Blackwell) only",
        _SRC_PCIE,
    ),
    notes=_NOTE_COMMON
    + " The datasheet figures were read from its verbatim quotes in public repositories (the "
    "pages themselves were not reachable from the machine that wrote this profile). Dense "
    "rates are half the printed sparse ones. The DGX page says 'up to 8 TB/s' of HBM per GPU; "
    "the datasheet's 7.7 TB/s is used. Host CPU: one Xeon Platinum 8570 socket of the DGX "
    "B200 (56 cores); host_flops = 56 x 2.1 GHz (base, ASSUMED) x 1024 BF16 FLOP/cycle (AMX), "
    "a theoretical peak; host_mem_bandwidth = 8 channels x DDR5-5600 x 8 B (ASSUMED).",
)

_RTX_5090 = HardwareProfile(
    name="rtx-5090",
    label="NVIDIA GeForce RTX 5090 (PCIe 5.0 x16; ReaLB's GPU)",
    device_memory_bytes=32 * _GiB,
    device_flops=209.5 * _TFLOPS,
    device_mem_bandwidth=1792 * _GB,
    link="PCIe 5.0 x16",
    link_bandwidth=_PCIE_EFFICIENCY * _PCIE5_X16,
    link_latency_s=_PCIE_TRANSFER_LATENCY,
    kernel_overhead_s=_CUDA_KERNEL_OVERHEAD,
    host_flops=16 * 3.4e9 * 32,
    host_mem_bandwidth=2 * 5600e6 * 8,
    fp8_flops=419 * _TFLOPS,
    fp4_flops=1676 * _TFLOPS,
    sources=(
        "NVIDIA RTX Blackwell GPU Architecture whitepaper, Appendix A (GeForce RTX 5090, 2407 "
        "MHz boost): Peak FP16/BF16 Tensor TFLOPS with FP32 accumulate 209.5 dense (419 with "
        "sparsity), FP8 with FP32 accumulate 419 (838), FP4 with FP32 accumulate 1676 (3352 "
        "= the 'AI TOPS'); 32 GB GDDR7, 512-bit at 28 Gbps = 1792 GB/s; PCIe Gen 5 x16 - as "
        "quoted by public spec tables (main-horse.github.io/posts/5090-mm-perf, 'Spec' "
        "column) and reviews; per clock: 170 SMs x 2.407 GHz x 512 / 1024 / 4096 FLOP",
        _SRC_PCIE,
        "ReaLB (seed 004) §5 Implementation Details: eight RTX 5090 GPUs, NVFP4 GEMMs from "
        "FlashInfer",
    ),
    notes=_NOTE_COMMON
    + " device_flops is the FP32-accumulate BF16 rate (209.5 TFLOPS, half the FP16-accumulate "
    "one on GeForce), as for the RTX 3090; FP8 likewise 419 with FP32 accumulate; NVFP4 "
    "(block-scaled) runs at full rate, 1676. The whitepaper itself was not reachable from the "
    "machine that wrote this profile: the figures are its values as quoted, consistent with "
    "the per-clock arithmetic. No NVLink: GPUs talk over PCIe (interconnect pcie5). Host "
    "CPU is an ASSUMPTION: a 16-core desktop CPU at 3.4 GHz, 32 FP32 FLOP/cycle, dual-channel "
    "DDR5-5600.",
)

PROFILES: dict[str, HardwareProfile] = {
    p.name: p for p in (_A100_40GB, _RTX_3090, _H200, _B200, _RTX_5090, _JETSON_ORIN,
                        _JETSON_ORIN_32GB)
}

# ---------------------------------------------------------------------------------------------
# Target models
# ---------------------------------------------------------------------------------------------

# Qwen3-VL-30B-A3B text config: hidden 2048, 48 layers (all MoE: decoder_sparse_step 1,
# mlp_only_layers []), 32 query heads / 4 KV heads of dim 128, 128 experts, top-8,
# moe_intermediate 768, vocab 151936, untied embeddings.
_Q_H, _Q_I, _Q_E = 2048, 768, 128
_Q_ATTN_PARAMS = _Q_H * 32 * 128 + 2 * _Q_H * 4 * 128 + 32 * 128 * _Q_H  # q, k, v, o projections
_Q_ROUTER_PARAMS = _Q_H * _Q_E

_QWEN3_VL_30B_A3B = TargetModel(
    name="qwen3-vl-30b-a3b",
    label="Qwen3-VL-30B-A3B (48 MoE layers x 128 experts, top-8)",
    num_layers=48,
    num_experts=_Q_E,
    top_k=8,
    shared_experts=0,
    hidden_size=_Q_H,
    moe_intermediate_size=_Q_I,
    expert_bytes=17_300_000,  # 17.3 MB, VisMMOE Table 2 (kept exactly; see notes)
    backbone_bytes=4_100_000_000,  # 4.1 GB "static"/backbone on A100-40GB, VisMMOE Sec. 4.3.1
    dense_flops_per_token_per_layer=2 * (_Q_ATTN_PARAMS + _Q_ROUTER_PARAMS),  # 38,273,024
    expert_flops_per_token=2 * 3 * _Q_H * _Q_I,  # 9,437,184
    sources=(
        _SRC_VISMMOE + ": 48 layers, 128 experts/layer, 8 activated, 17.3 MB per expert, 62 GB "
        "total weights; Sec. 4.3.1: backbone 4.1 GB, anchors 21.6 GB, cache 14.3 GB on A100-40GB",
        "Hugging Face model card and config.json of Qwen/Qwen3-VL-30B-A3B-Instruct "
        "(https://huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct): text_config hidden_size 2048, "
        "num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4, head_dim 128, "
        "num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, vocab_size 151936",
        "Cross-checks of the text config: NVIDIA Megatron-Bridge Qwen3-VL MoE provider "
        "(https://docs.nvidia.com/nemo/megatron-bridge/latest/apidocs/bridge/"
        "bridge.models.qwen_vl.qwen3_vl_provider.html) and Ascend MindSpeed-RL qwen3_30b_a3b.yaml "
        "(48 layers, hidden 2048, 4 query groups, kv_channels 128, 128 experts, top-8, "
        "moe_ffn_hidden_size 768)",
    ),
    notes=(
        "expert_bytes = 17.3 MB is kept exactly as VisMMOE reports it. It is NOT the bf16 size "
        "from the config: 3 x 2048 x 768 x 2 B = 9,437,184 B (9.44 MB, derived_expert_bytes()), "
        "and 48 x 128 x 9.44 MB + 4.16 GB non-expert weights = 62.1 GB matches the paper's own "
        "'Total Weight Size 62GB', whereas 48 x 128 x 17.3 MB = 106 GB does not. The 17.3 MB "
        "figure does match the paper's A100 memory split (10 pinned layers x 128 x 17.3 MB = 22.1 "
        "GB vs 'anchor: 21.6 GB'), so it is treated as the size of an expert as VisMMOE's runtime "
        "stores it. backbone_bytes = 4.1 GB from VisMMOE; the config gives 2.08 B non-expert "
        "parameters (1.54 B text: embeddings, lm_head, attention, routers, norms; 0.54 B vision "
        "tower and mergers) = 4.16 GB in bf16, consistent. dense_flops_per_token_per_layer = 2 x "
        "(q/k/v/o projection params 18,874,368 + router 262,144) = 38,273,024; it excludes the "
        "context-dependent attention score/value products (4 x 32 x 128 x context FLOPs per token "
        "per layer) and norms. No shared experts."
    ),
)

# DeepSeek-VL2 (27.5 B) language config: hidden 2560, 30 decoder layers with
# first_k_dense_replace 1 (layer 0 has a dense MLP of intermediate 12288; layers 1..29 are MoE),
# 72 routed + 2 shared experts, top-6, moe_intermediate 1536, MLA with 32 heads, q_lora_rank null,
# kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, vocab 129280.
_D_H, _D_I, _D_E, _D_HEADS = 2560, 1536, 72, 32
_D_ATTN_PARAMS = (
    _D_H * _D_HEADS * (128 + 64)  # q_proj (q_lora_rank null)
    + _D_H * (512 + 64)  # kv_a_proj_with_mqa
    + 512 * _D_HEADS * (128 + 128)  # kv_b_proj
    + _D_HEADS * 128 * _D_H  # o_proj
)
_D_ROUTER_PARAMS = _D_H * _D_E
_D_SHARED_PARAMS = 2 * 3 * _D_H * _D_I

_DEEPSEEK_VL2 = TargetModel(
    name="deepseek-vl2",
    label="DeepSeek-VL2 (29 MoE layers x 72 routed experts, top-6 + 2 shared)",
    num_layers=29,
    num_experts=_D_E,
    top_k=6,
    shared_experts=2,
    hidden_size=_D_H,
    moe_intermediate_size=_D_I,
    expert_bytes=23_600_000,  # 23.6 MB, VisMMOE Table 2 (kept exactly)
    backbone_bytes=5_670_000_000,  # derived, see notes
    dense_flops_per_token_per_layer=2 * (_D_ATTN_PARAMS + _D_ROUTER_PARAMS + _D_SHARED_PARAMS),
    expert_flops_per_token=2 * 3 * _D_H * _D_I,  # 23,592,960
    sources=(
        _SRC_VISMMOE + ": 27B total, 4.5B activated, 23.6 MB per expert, 55 GB total weights, "
        "'Layer Number 30', 72 experts/layer, '6+2(shared)' activated",
        "DeepSeek-VL2 paper, arXiv:2412.10302, and README of deepseek-ai/DeepSeek-VL2 "
        "(https://github.com/deepseek-ai/DeepSeek-VL2): DeepSeek-VL2 = 27.5B-MoE in total, 4.5B "
        "activated, built on DeepSeekMoE-27B with MLA",
        "Hugging Face deepseek-ai/deepseek-vl2 (https://huggingface.co/deepseek-ai/deepseek-vl2): "
        "8 bf16 safetensors shards totalling 54.94 GB; language_config hidden_size 2560, "
        "intermediate_size 12288, moe_intermediate_size 1536, n_routed_experts 72, "
        "n_shared_experts 2, num_experts_per_tok 6, first_k_dense_replace 1, 30 layers, "
        "32 heads, kv_lora_rank 512, q_lora_rank null (config values as mirrored by third-party "
        "loaders' tests of the official configs; not read from config.json itself here)",
    ),
    notes=(
        "num_layers = 29 MoE layers: the language model has 30 decoder layers (VisMMOE's 'Layer "
        "Number 30') but first_k_dense_replace = 1 makes layer 0 a dense-MLP layer with no routed "
        "experts. This count is confirmed by the sizes: 29 x 72 x 23.6 MB = 49.28 GB of routed "
        "experts + 5.67 GB rest = 54.9 GB = the 54.94 GB of published bf16 shards and the paper's "
        "'55GB' (30 MoE layers would give 56.5 GB). expert_bytes = 23.6 MB equals the bf16 size "
        "from the config (3 x 2560 x 1536 x 2 B = 23,592,960 B). backbone_bytes = 5.67 GB is "
        "DERIVED (VisMMOE gives no figure): 2.834 B parameters that are not routed experts - "
        "embeddings + lm_head 0.662 B, MLA attention of 30 layers 0.957 B, layer-0 dense MLP "
        "0.094 B, 2 shared experts x 29 layers 0.684 B, routers, norms, SigLIP-SO400M vision "
        "tower (27 blocks) 0.42 B and projector 0.018 B - in bf16; it includes the shared experts "
        "because they stay resident. dense_flops_per_token_per_layer = 2 x (MLA projection params "
        "31,883,264 + router 184,320 + shared experts 23,592,960) = 111,321,088, for the naive "
        "(non-absorbed) MLA; it excludes context-dependent attention score/value products and "
        "norms, and the dense layer 0 (2 x 3 x 2560 x 12288 = 188.7 MFLOP per token, resident)."
    ),
)

TARGET_MODELS: dict[str, TargetModel] = {m.name: m for m in (_QWEN3_VL_30B_A3B, _DEEPSEEK_VL2)}


# ---------------------------------------------------------------------------------------------
# Interconnects: the links an expert-parallel all-to-all crosses (dispatch and combine)
# ---------------------------------------------------------------------------------------------

# Achievable fraction of the per-direction peak for an all-to-all of MoE-sized messages.
# ASSUMPTION (see docs/hardware-profiles.md, "Interconnects"): the same 80 % as the host link.
_A2A_EFFICIENCY = 0.80
# Fixed cost of one all-to-all phase (kernel launch + handshake). ASSUMPTION: an order of
# magnitude, not a vendor figure; intra-node NVLink kernels are reported at ~10 µs scale.
_A2A_LATENCY = 10 * _US


@dataclass(frozen=True)
class Interconnect:
    """A GPU-to-GPU link of an expert-parallel group. ``bandwidth``: bytes/s one GPU can
    receive (per direction, achievable); ``latency_s``: fixed cost of one all-to-all phase."""

    name: str
    title: str
    bandwidth: float
    latency_s: float
    sources: tuple[str, ...]
    notes: str = ""

    def __post_init__(self) -> None:
        _positive(f"Interconnect {self.name}", "bandwidth", self.bandwidth)
        _non_negative(f"Interconnect {self.name}", "latency_s", self.latency_s)

    def all_to_all_s(self, received_bytes: float) -> float:
        """Modeled seconds of one all-to-all phase whose busiest GPU receives
        ``received_bytes`` (0 bytes: no phase, 0 s)."""
        return self.latency_s + received_bytes / self.bandwidth if received_bytes > 0 else 0.0


def _nvlink(name: str, title: str, total_gb_s: float, source: str) -> Interconnect:
    # vendors quote NVLink as the sum of both directions: half of it per direction
    return Interconnect(name, title, total_gb_s / 2 * _GB * _A2A_EFFICIENCY, _A2A_LATENCY,
                        (source,), f"{total_gb_s:g} GB/s total (both directions) per GPU, "
                                   f"half per direction, × {_A2A_EFFICIENCY} achievable")


INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in (
    _nvlink("nvlink-a100", "NVLink 3 (A100 SXM, NVSwitch)", 600,
            "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): "
            "NVLink 600 GB/s"),
    _nvlink("nvlink-h100", "NVLink 4 (H100 SXM, NVSwitch)", 900,
            "NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/): "
            "NVLink 900 GB/s (SXM)"),
    _nvlink("nvlink-h200", "NVLink 4 (H200 SXM, NVSwitch)", 900,
            "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): "
            "NVLink 900 GB/s (SXM)"),
    _nvlink("nvlink-b200", "NVLink 5 (HGX B200, NVSwitch)", 1800,
            "NVIDIA Blackwell datasheet, HGX B200 column "
            "(https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703): NVLink 5 "
            "1.8 TB/s per GPU"),
    Interconnect("pcie4", "PCIe 4.0 x16 (peer to peer)", _PCIE4_X16 * _PCIE_EFFICIENCY,
                 _A2A_LATENCY, ("PCI-SIG PCIe 4.0 base specification: 16 GT/s × 16 lanes, "
                                "128b/130b → 31.5 GB/s per direction",),
                 "× 0.8 achievable, as the host link"),
    Interconnect("pcie5", "PCIe 5.0 x16 (peer to peer)", _PCIE5_X16 * _PCIE_EFFICIENCY,
                 _A2A_LATENCY, ("PCI-SIG PCIe 5.0 base specification: 32 GT/s × 16 lanes, "
                                "128b/130b → 63.0 GB/s per direction",),
                 "× 0.8 achievable, as the host link"),
)}


def available_interconnects() -> list[str]:
    """Names of the registered interconnects, in the order above (fastest NVLink last)."""
    return list(INTERCONNECTS)


def get_interconnect(name: str) -> Interconnect:
    """The interconnect registered as ``name``; :class:`KnobError` lists the others."""
    try:
        return INTERCONNECTS[name]
    except (KeyError, TypeError):
        raise KnobError(f"interconnect {name!r} is unknown; available: "
                        f"{', '.join(available_interconnects())}") from None


# ---------------------------------------------------------------------------------------------
# Lookup
# ---------------------------------------------------------------------------------------------


def available_profiles() -> list[str]:
    """Names of the registered hardware profiles, sorted."""
    return sorted(PROFILES)


def available_target_models() -> list[str]:
    """Names of the registered target models, sorted."""
    return sorted(TARGET_MODELS)


def get_profile(name: str) -> HardwareProfile:
    """The hardware profile registered as ``name``.

    Raises :class:`~workbench.errors.KnobError` (a ``ValueError``) naming the bad value and the
    available profiles.
    """
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise KnobError(
            f"profile {name!r} is unknown; available: {', '.join(available_profiles())}"
        ) from None


def get_target_model(name: str) -> TargetModel:
    """The target model registered as ``name``.

    Raises :class:`~workbench.errors.KnobError` (a ``ValueError``) naming the bad value and the
    available target models.
    """
    try:
        return TARGET_MODELS[name]
    except (KeyError, TypeError):
        raise KnobError(
            f"target model {name!r} is unknown; available: {', '.join(available_target_models())}"
        ) from None

