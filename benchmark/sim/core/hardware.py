"""Calibration table: public specifications of the GPUs the simulator models.

Every number is a vendor datasheet figure (named in ``source``); nothing here
is measured. Conventions (invariants of the table):

* ``hbm_gb``: device memory in GB (10^9 bytes) as printed on the datasheet.
* ``hbm_gbps``: peak device-memory bandwidth in GB/s.
* ``bf16_tflops`` / ``fp8_tflops``: dense tensor-core throughput (the
  datasheets print the 2:4-sparsity figure with an asterisk; we halve it).
  ``fp8_tflops`` is ``None`` where the GPU has no FP8 tensor cores.
* Link bandwidths are per direction in GB/s (datasheets print the
  bidirectional total; we halve it). ``nvlink_gbps`` is 0 for PCIe-only
  cards. ``host_link`` names the CPU-GPU link: ``pcie`` or ``c2c``.
* ``compute_eff`` / ``memory_eff`` are NOT datasheet numbers: they are the
  fraction of peak a well-tuned kernel reaches, applied by the roofline model
  (``roofline.py``). Defaults are deliberately uniform across GPUs; scenario
  files may override them per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GpuSpec", "GPUS", "gpu_spec", "calibration_rows"]


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Bandwidths in GB/s, compute in TFLOPS, memory in GB."""

    name: str
    hbm_gb: float
    hbm_gbps: float
    bf16_tflops: float
    fp8_tflops: float | None
    host_link: str  # "pcie" or "c2c"
    host_gbps: float  # CPU<->GPU, per direction
    nvlink_gbps: float  # GPU<->GPU, per direction (0: none)
    source: str
    compute_eff: float = 0.70
    memory_eff: float = 0.80

    @property
    def mem_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def mem_bw(self) -> float:
        """Effective memory bandwidth in bytes/s (peak x memory_eff)."""
        return self.hbm_gbps * 1e9 * self.memory_eff

    def flops(self, dtype: str = "bf16") -> float:
        """Effective dense FLOP/s for ``dtype`` (peak x compute_eff)."""
        peak = self.bf16_tflops
        if dtype == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            peak = self.fp8_tflops
        return peak * 1e12 * self.compute_eff

    def with_efficiency(self, compute_eff: float | None = None, memory_eff: float | None = None) -> GpuSpec:
        return replace(
            self,
            compute_eff=self.compute_eff if compute_eff is None else compute_eff,
            memory_eff=self.memory_eff if memory_eff is None else memory_eff,
        )


# PCIe per-direction x16 bandwidth: Gen4 32 GB/s, Gen5 64 GB/s (datasheets
# print 64 / 128 GB/s bidirectional).
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec(
            "H100-SXM",
            80,
            3350,
            989,
            1979,
            "pcie",
            64,
            450,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column): 80 GB HBM3, 3.35 TB/s, "
            "BF16 1,979* / FP8 3,958* TFLOPS (*sparsity), NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        ),
        GpuSpec(
            "H200",
            141,
            4800,
            989,
            1979,
            "pcie",
            64,
            450,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM column): 141 GB HBM3e, 4.8 TB/s, "
            "BF16 1,979* / FP8 3,958* TFLOPS, NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        ),
        GpuSpec(
            "GH200",
            96,
            4000,
            989,
            1979,
            "c2c",
            450,
            450,
            "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 variant): 4 TB/s, "
            "BF16 1,979* / FP8 3,958* TFLOPS, NVLink-C2C 900 GB/s CPU<->GPU, NVLink 900 GB/s",
        ),
        GpuSpec(
            "A100-80G",
            80,
            2039,
            312,
            None,
            "pcie",
            32,
            300,
            "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column): 80 GB HBM2e, 2,039 GB/s, "
            "BF16 312 / 624* TFLOPS, NVLink 600 GB/s, PCIe Gen4 64 GB/s",
        ),
        GpuSpec(
            "H20",
            96,
            4000,
            148,
            296,
            "pcie",
            64,
            450,
            "NVIDIA H20 product brief (HGX H20): 96 GB HBM3, 4.0 TB/s, BF16 148 / FP8 296 "
            "TFLOPS dense, NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        ),
        GpuSpec(
            "A10",
            24,
            600,
            125,
            None,
            "pcie",
            32,
            0,
            "NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s, BF16 125 / 250* "
            "TFLOPS, no NVLink, PCIe Gen4 64 GB/s",
        ),
        GpuSpec(
            "L40S",
            48,
            864,
            362,
            733,
            "pcie",
            32,
            0,
            "NVIDIA L40S GPU datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 / 733* TFLOPS, "
            "FP8 733 / 1,466* TFLOPS, no NVLink, PCIe Gen4 x16 64 GB/s",
        ),
    ]
}


def gpu_spec(name: str) -> GpuSpec:
    """Look a GPU up by name; raises ``KeyError`` listing the known names."""
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def calibration_rows() -> list:
    """The table as rows of strings (CLI ``hardware`` and docs)."""
    head = [
        "gpu",
        "mem GB",
        "HBM GB/s",
        "BF16 TFLOPS",
        "FP8 TFLOPS",
        "host link",
        "host GB/s/dir",
        "NVLink GB/s/dir",
        "eff (compute/mem)",
    ]
    rows = [head]
    for g in GPUS.values():
        rows.append(
            [
                g.name,
                f"{g.hbm_gb:g}",
                f"{g.hbm_gbps:g}",
                f"{g.bf16_tflops:g}",
                "-" if g.fp8_tflops is None else f"{g.fp8_tflops:g}",
                g.host_link,
                f"{g.host_gbps:g}",
                f"{g.nvlink_gbps:g}" if g.nvlink_gbps else "-",
                f"{g.compute_eff:.2f}/{g.memory_eff:.2f}",
            ]
        )
    return rows
