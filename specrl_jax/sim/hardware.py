"""Accelerator profiles: the peak rates a roofline needs, per chip.

Numbers are vendor datasheet figures (dense, no structured sparsity). What software
actually achieves is not a property of the chip: it lives in ``EngineProfile``
(rollout.py) as efficiency factors and overheads. The local CPU is the exception: its
profile is measured (``calibrate_cpu``), so its rates are achieved rates already.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from specrl_jax.config import ConfigError, check, check_finite_number, check_positive_int
from specrl_jax.sim import validation

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
  """Per-chip peak rates and sizes.

  interconnect_bandwidth is the per-chip, one-direction bandwidth inside the scale-up
  domain (NVLink, ICI), used for tensor/expert-parallel collectives; scale_out_bandwidth
  is the per-chip network bandwidth between domains (InfiniBand, DCN), used for weight
  sync between separate rollout and training pools.
  """

  name: str
  peak_flops_bf16: float  # FLOP/s, dense
  peak_flops_fp8: float  # FLOP/s, dense (int8 rate for chips without fp8 units)
  hbm_bandwidth: float  # bytes/s
  hbm_capacity: float  # bytes
  interconnect_bandwidth: float  # bytes/s per chip, one direction
  scale_out_bandwidth: float  # bytes/s per chip
  scale_up_domain: int  # chips that share the fast interconnect
  collective_latency_s: float  # fixed cost of one small all-reduce / all-to-all
  peak_flops_fp32: float | None = None  # FLOP/s; set for the measured CPU profile
  source: str = ""

  def __post_init__(self):
    owner = f"HardwareProfile({self.name!r})"
    check(isinstance(self.name, str) and bool(self.name), owner, "name", self.name,
          "a non-empty string")
    for field in ("peak_flops_bf16", "peak_flops_fp8", "hbm_bandwidth", "hbm_capacity",
                  "interconnect_bandwidth", "scale_out_bandwidth"):
      check_finite_number(owner, field, getattr(self, field), above=0)
    check_positive_int(owner, "scale_up_domain", self.scale_up_domain)
    check_finite_number(owner, "collective_latency_s", self.collective_latency_s, at_least=0)
    if self.peak_flops_fp32 is not None:
      check_finite_number(owner, "peak_flops_fp32", self.peak_flops_fp32, above=0)

  def peak_flops(self, precision: str) -> float:
    owner = f"HardwareProfile({self.name!r})"
    validation.one_of(owner, "precision", precision, ("bf16", "fp8", "fp32"))
    if precision == "fp32":
      check(self.peak_flops_fp32 is not None, owner, "peak_flops_fp32", None,
            "a measured rate to run fp32 (only the calibrated CPU profile has one)")
      return self.peak_flops_fp32
    return self.peak_flops_fp8 if precision == "fp8" else self.peak_flops_bf16

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> "HardwareProfile":
    return cls(**data)


# Collective latency: NCCL small-message all-reduce inside an NVLink domain is ~10 us
# end to end; ICI collectives are a few microseconds per hop.
HARDWARE: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100", peak_flops_bf16=989e12, peak_flops_fp8=1979e12,
        hbm_bandwidth=3.35 * TB, hbm_capacity=80 * GB,
        interconnect_bandwidth=450 * GB,  # NVLink 4: 900 GB/s bidirectional
        scale_out_bandwidth=50 * GB,  # one 400 Gb/s NDR NIC per GPU
        scale_up_domain=8, collective_latency_s=10e-6,
        source="NVIDIA H100 SXM datasheet"),
    "h200": HardwareProfile(
        name="h200", peak_flops_bf16=989e12, peak_flops_fp8=1979e12,
        hbm_bandwidth=4.8 * TB, hbm_capacity=141 * GB,
        interconnect_bandwidth=450 * GB, scale_out_bandwidth=50 * GB,
        scale_up_domain=8, collective_latency_s=10e-6,
        source="NVIDIA H200 SXM datasheet"),
    "b200": HardwareProfile(
        name="b200", peak_flops_bf16=2.25e15, peak_flops_fp8=4.5e15,
        hbm_bandwidth=8 * TB, hbm_capacity=180 * GB,
        interconnect_bandwidth=900 * GB,  # NVLink 5: 1.8 TB/s bidirectional
        scale_out_bandwidth=50 * GB, scale_up_domain=8, collective_latency_s=10e-6,
        source="NVIDIA HGX B200 datasheet"),
    "gb200": HardwareProfile(
        name="gb200", peak_flops_bf16=2.5e15, peak_flops_fp8=5e15,
        hbm_bandwidth=8 * TB, hbm_capacity=186 * GB,
        interconnect_bandwidth=900 * GB, scale_out_bandwidth=50 * GB,
        scale_up_domain=72,  # NVL72 rack
        collective_latency_s=10e-6,
        source="NVIDIA GB200 NVL72 datasheet, per GPU"),
    "tpu-v5p": HardwareProfile(
        name="tpu-v5p", peak_flops_bf16=459e12,
        peak_flops_fp8=918e12,  # int8 rate: v5p has no fp8 units
        hbm_bandwidth=2.765 * TB, hbm_capacity=95 * GB,
        interconnect_bandwidth=600 * GB,  # ICI 4,800 Gbps per chip, as published
        scale_out_bandwidth=25 * GB,  # DCN, assumed 200 Gb/s per chip
        scale_up_domain=8960, collective_latency_s=5e-6,
        source="Google Cloud TPU v5p system architecture page"),
    "tpu-v6e": HardwareProfile(
        name="tpu-v6e", peak_flops_bf16=918e12,
        peak_flops_fp8=1836e12,  # int8 rate: v6e has no fp8 units
        hbm_bandwidth=1.64 * TB, hbm_capacity=32 * GB,
        interconnect_bandwidth=448 * GB,  # ICI 3,584 Gbps per chip
        scale_out_bandwidth=25 * GB,  # DCN, assumed
        scale_up_domain=256, collective_latency_s=5e-6,
        source="Google Cloud TPU v6e (Trillium) system architecture page"),
}

# Where `specrl simulate --calibrate` writes the measured CPU profile by default.
DEFAULT_CPU_PROFILE_PATH = Path("results") / "sim" / "cpu_profile.json"


def get_hardware(name_or_path: str) -> HardwareProfile:
  """A registered profile by name ("h100", ...) or a profile JSON written by calibrate."""
  if name_or_path in HARDWARE:
    return HARDWARE[name_or_path]
  if name_or_path == "cpu":
    if not DEFAULT_CPU_PROFILE_PATH.exists():
      raise ConfigError(
          f"hardware='cpu' needs a measured profile at {DEFAULT_CPU_PROFILE_PATH}; "
          "run `specrl simulate --calibrate` first.")
    name_or_path = str(DEFAULT_CPU_PROFILE_PATH)
  path = Path(name_or_path)
  if path.suffix == ".json" and path.exists():
    return HardwareProfile.from_json(json.loads(path.read_text()))
  raise ConfigError(f"hardware={name_or_path!r} is invalid: expected one of "
                    f"{sorted(HARDWARE)}, 'cpu' or the path of a profile JSON.")


def _best_seconds(run, repeats: int) -> float:
  """Fastest of ``repeats`` timed calls: the achievable rate, least disturbed by
  other processes sharing the cores."""
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - start)
  return best


def measure_cpu(*, matmul_size: int = 1024, stream_megabytes: int = 256,
                repeats: int = 5) -> dict[str, float]:
  """Achieved float32 matmul FLOP/s, memory read bandwidth and jit dispatch overhead.

  Measured through JAX on the default (CPU) backend, the way the engine runs. Takes a
  few seconds.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  check_positive_int("measure_cpu", "matmul_size", matmul_size)
  check_positive_int("measure_cpu", "stream_megabytes", stream_megabytes)
  n = matmul_size
  a_NxN = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
  matmul = jax.jit(lambda x: x @ x)
  matmul(a_NxN).block_until_ready()
  matmul_s = _best_seconds(lambda: matmul(a_NxN).block_until_ready(), repeats)

  # A reduction reads every byte once and writes nothing: the read bandwidth the
  # decode loop sees when it streams weights and KV.
  stream = jnp.ones((stream_megabytes * 2**20 // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(stream).block_until_ready()
  stream_s = _best_seconds(lambda: total(stream).block_until_ready(), repeats)

  tiny = jnp.ones((8,), jnp.float32)
  noop = jax.jit(lambda x: x + 1)
  noop(tiny).block_until_ready()
  dispatch_s = _best_seconds(lambda: noop(tiny).block_until_ready(), 50)
  return {
      "matmul_flops": 2 * n**3 / matmul_s,
      "memory_bandwidth": stream.size * 4 / stream_s,
      "dispatch_overhead_s": dispatch_s,
  }


def cpu_profile_from_measurement(measured: dict[str, float]) -> HardwareProfile:
  """The local CPU as a HardwareProfile: measured rates stand in for peaks."""
  try:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    pages = 16 * GB
  return HardwareProfile(
      name="cpu-local",
      # Only float32 is measured (the engine's CPU default); the other rates repeat it.
      peak_flops_bf16=measured["matmul_flops"],
      peak_flops_fp8=measured["matmul_flops"],
      peak_flops_fp32=measured["matmul_flops"],
      hbm_bandwidth=measured["memory_bandwidth"],
      hbm_capacity=float(pages),
      # Simulated devices share one memory: collectives are memory copies.
      interconnect_bandwidth=measured["memory_bandwidth"],
      scale_out_bandwidth=measured["memory_bandwidth"],
      scale_up_domain=max(1, os.cpu_count() or 1),
      collective_latency_s=measured["dispatch_overhead_s"],
      source=(f"measured by specrl_jax.sim.hardware.measure_cpu on {os.cpu_count()} "
              f"cores; dispatch overhead {measured['dispatch_overhead_s'] * 1e6:.1f} us"),
  )


def calibrate_cpu(path: str | Path | None = DEFAULT_CPU_PROFILE_PATH,
                  **measure_kwargs) -> HardwareProfile:
  """Measures the local CPU and, when ``path`` is given, writes the profile JSON."""
  profile = cpu_profile_from_measurement(measure_cpu(**measure_kwargs))
  if path is not None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
  return profile
