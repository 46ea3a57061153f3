"""scripts/bench_llamacpp.py, the llama.cpp peer: its worker decodes each prompt from an empty
cache, exactly --max-new-tokens tokens, greedily, and the driver reports our bench's fields.
A stand-in llama_cpp module plays llama.cpp (the real one builds for ~10 minutes)."""

from __future__ import annotations

import sys

import pytest
from script_module import load_script

FAKE = '''
import time
__version__ = "fake"
calls = []

def llama_print_system_info():
    return b"AVX512 = 1 | fake"

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
        assert model_path.endswith(".gguf") and n_threads == 2 and n_ctx >= 4 + 6
        self.cached = []

    def reset(self):
        self.cached = []

    def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty, reset):
        assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0 and not reset
        assert self.cached == [], "a prompt decoded on a cache that still holds the last one"
        self.cached = list(tokens)
        time.sleep(0.02)  # the prefill
        t = tokens[-1]
        while True:  # like llama.cpp's generate: no end, EOS included
            time.sleep(0.001)
            t = (t * 7 + 1) % 50
            self.cached.append(t)
            yield t
'''


@pytest.fixture
def bench_llamacpp():
    return load_script("bench_llamacpp")


def test_worker_decodes_each_prompt_from_an_empty_cache(bench_llamacpp, tmp_path, monkeypatch):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3, 9]]  # the third starts like the first: no reuse either
    summary, outputs = bench_llamacpp.run_llamacpp(prompts, 6, threads=2, python=sys.executable)
    assert [len(o) for o in outputs] == [6, 6, 6]
    assert outputs[0][0] == (3 * 7 + 1) % 50 and outputs[1][0] == (5 * 7 + 1) % 50
    assert summary["tokens"] == 18 and summary["engine"] == "llama-cpp-python fake"
    assert summary["tokens_per_s"] == pytest.approx(18 / summary["seconds"], rel=1e-3)
    assert 15 < summary["ttft_ms"] < 1000 and 0.5 < summary["tpot_ms"] < summary["ttft_ms"]
    assert summary["system_info"].startswith("AVX512") and len(summary["per_prompt"]) == 3
