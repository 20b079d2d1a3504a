"""Ahead-of-time compilation of every Triton kernel the package launches, for NVIDIA targets, without a GPU.

Each kernel is compiled by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``: Triton's whole
NVIDIA pipeline (TTIR, TTGIR, LLVM IR, PTX, and the cubin through the ``ptxas`` shipped in the triton wheel). The
compiled kernel's metadata gives the shared memory and the warps; the ``ptxas -v`` log of the cubin step gives
registers per thread and spills. :func:`check_fit` compares them with the target's per-block limits.

What is compiled is captured at the launch sites: the package's own launchers (``mhc_fused``, ``dsa_fused``,
``moe_fused``; ``triton_utils.round_to`` is a ``@triton.jit`` helper inlined into their kernels) and the fla entry
points that ``kda_fused`` calls (chunk KDA forward and backward, causal conv forward and backward, gated RMSNorm
forward and backward, the fused recurrent decode step) are called on meta tensors of the release shapes with
``JITFunction.run`` replaced by a recorder; an autotuned kernel is recorded once per configuration its autotuner
would benchmark (after its pruning). fla's autotuners get the package's own prune first
(``glm53flash_hf.fla_compat.prune_by_shared_memory``, as on a GPU: each configuration is compiled for the target and
dropped when it needs more shared memory than the target's block may have), so the configurations recorded are the
ones the package can pick; ``--unpruned`` records fla's lists as they are. The configurations the prune drops are
listed after the table. Every recorded launch is bound by Triton's own binder (signature, constexprs, alignment
specialisation) and compiled for each target. fla reads the device (shared memory, capability, SM count) to choose
its block lists and configurations, so each target is captured in its own process with a stand-in driver reporting
that target's properties.

Nothing here runs on a GPU: compiling and fitting are checked, not speed or numerics.

Usage::

    python scripts/gpu_aot.py [--kernels SUBSTR ...] [--targets sm_80 sm_90 sm_100] [--out aot.json] [--jobs 2]
                              [--max-configs N] [--unpruned]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
import traceback

# per-block limits: (capability, max dynamic shared memory per block in bytes, SM count of the reference part)
TARGETS = {"sm_80": (80, 166912, 108), "sm_90": (90, 232448, 132), "sm_100": (100, 232448, 148)}
DEVICE_NAMES = {80: "NVIDIA A100-SXM4-80GB", 90: "NVIDIA H100 80GB HBM3", 100: "NVIDIA B200"}
MAX_REGS_PER_THREAD = 255
REGS_PER_BLOCK = 65536  # 64 Ki 32-bit registers per block on sm_80, sm_90 and sm_100
MAX_THREADS_PER_BLOCK = 1024

# release shapes (the configuration defaults of Glm53FlashConfig, with the release's index_kpool and MTP layer)
HIDDEN = 4096
TOKENS = 4096  # one training sequence; decode shapes use 1
HC_MULT = 4
DSA_HEADS, KV_LORA_RANK, INDEX_TOPK, INDEX_KPOOL = 64, 512, 2048, 4
EXPERTS, TOP_K, MOE_INTER, SWIGLU_LIMIT = 288, 8, 2048, 10.0
KDA_HEADS, KDA_HEAD_DIM, CONV_KERNEL, KDA_LOWER_BOUND, KDA_CHUNK = 64, 128, 4, -5.0, 64

FAMILIES = ("mhc", "dsa", "moe", "kda_chunk", "kda_conv", "kda_norm", "kda_recurrent")
PACKAGE_FAMILIES = ("mhc", "dsa", "moe")


# ================================================================================================ limits and fitting
def check_fit(result: dict, target: str) -> tuple[bool, str]:
    """Whether a compiled kernel can launch on ``target`` (``"sm_80"``, ``"sm_90"``, ``"sm_100"``).

    Args:
        result: a row of :func:`compile_launch`: ``error`` (None when compiled), ``shared`` bytes, ``regs`` per
            thread, ``spills`` (bytes of spill stores), ``num_warps``.
        target: a key of :data:`TARGETS`.

    Returns:
        ``(fits, reason)``; ``reason`` names every limit exceeded (empty when it fits). A kernel that did not compile
        does not fit. Spills are reported but do not stop a launch.

    Raises:
        KeyError: an unknown target.
    """
    _, max_shared, _ = TARGETS[target]
    if result.get("error"):
        return False, "compile error"
    reasons = []
    threads = 32 * result["num_warps"]
    if result["shared"] > max_shared:
        reasons.append(f"shared {result['shared']} B > {max_shared} B")
    regs = result.get("regs")
    if regs is None:
        reasons.append("no register count in the ptxas log")
    else:
        if regs > MAX_REGS_PER_THREAD:
            reasons.append(f"{regs} registers > {MAX_REGS_PER_THREAD}")
        if regs * threads > REGS_PER_BLOCK:
            reasons.append(f"{regs} registers x {threads} threads > {REGS_PER_BLOCK}")
    if threads > MAX_THREADS_PER_BLOCK:
        reasons.append(f"{threads} threads > {MAX_THREADS_PER_BLOCK}")
    return not reasons, "; ".join(reasons)


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> tuple[int | None, int]:
    """``(registers per thread, spill-store bytes)`` from a ``ptxas -v`` log (None: no register line)."""
    regs = [int(m) for m in _REGS.findall(log)]
    spills = [int(a) for a, _ in _SPILLS.findall(log)]
    return (max(regs) if regs else None), (max(spills) if spills else 0)


# ============================================================================================== capture and compile
class Launch:
    """One recorded launch: the JIT function, its arguments (tensors replaced by ``MockTensor`` of their dtype),
    the launch site and the autotune configuration it came from."""

    def __init__(self, fn, args, kwargs, site, config, tune=None):
        self.fn, self.args, self.kwargs, self.site, self.config = fn, args, kwargs, site, config
        self.tune = tune or {}  # the autotune configuration's kwargs (empty: a fixed launch)


_STATE = {"site": "", "config": "", "tune": {}, "launches": [], "dropped": []}


def _mock(value):
    import torch
    from triton.runtime.jit import MockTensor
    return MockTensor(value.dtype) if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def recording():
    """Replace ``JITFunction.run`` by a recorder and ``Autotuner.run`` by a loop over its pruned configurations; the
    recorded :class:`Launch` es are appended to ``_STATE["launches"]``. Nothing is launched; a ``warmup=True`` call
    (a prune compiling a configuration) compiles for the active driver's target as Triton does."""
    from triton.runtime import autotuner, jit

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return saved[0](self, *args, grid=grid, warmup=warmup, **kwargs)
        _STATE["launches"].append(Launch(self, tuple(_mock(a) for a in args),
                                         {k: _mock(v) for k, v in kwargs.items()}, _STATE["site"], _STATE["config"],
                                         dict(_STATE["tune"])))
        return None

    def tune(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        outer = _STATE["config"]
        try:
            for config in configs:
                _STATE["config"], _STATE["tune"] = f"autotune {config}", config.all_kwargs()
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            _STATE["config"], _STATE["tune"] = outer, {}
            self.nargs = None
        return None

    saved = jit.JITFunction.run, autotuner.Autotuner.run
    jit.JITFunction.run, autotuner.Autotuner.run = run, tune
    try:
        yield _STATE["launches"]
    finally:
        jit.JITFunction.run, autotuner.Autotuner.run = saved


@contextlib.contextmanager
def _site(name):
    _STATE["site"], _STATE["config"] = name, "fixed"
    try:
        yield
    finally:
        _STATE["site"] = ""


def bind(launch: Launch, target):
    """``(signature, constexprs, attrs, options)`` of ``launch`` for a ``GPUTarget``, by Triton's own binder."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _describe(constexprs, fn, options) -> str:
    names = fn.arg_names
    parts = []
    for path, value in sorted(constexprs.items()):
        if len(path) == 1 and value is not None:
            parts.append(f"{names[path[0]]}={getattr(value, 'name', value)}")
    parts.append(f"warps={options.num_warps}")
    parts.append(f"stages={options.num_stages}")
    return " ".join(parts)


def compile_launch(launch: Launch, target_name: str) -> dict:
    """Compile one recorded launch for ``target_name``; a row with ``kernel``, ``site``, ``target``, ``config``,
    ``error`` (the compiler's message or None), ``shared``, ``regs``, ``spills``, ``num_warps``, ``seconds``,
    ``fits`` and ``why`` (see :func:`check_fit`)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch = TARGETS[target_name][0]
    target = GPUTarget("cuda", arch, 32)
    row = {"kernel": launch.fn.__name__, "site": launch.site, "target": target_name, "error": None, "shared": None,
           "regs": None, "spills": None, "num_warps": None}
    start = time.time()
    try:
        signature, constexprs, attrs, options = bind(launch, target)
        row["config"] = _describe(constexprs, launch.fn, options)
        row["num_warps"] = options.num_warps
        log, dump = io.StringIO(), knobs.nvidia.dump_ptxas_log
        knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
        finally:
            knobs.nvidia.dump_ptxas_log = dump
        row["shared"] = int(kernel.metadata.shared)
        row["num_warps"] = int(kernel.metadata.num_warps)
        row["regs"], row["spills"] = parse_ptxas_log(log.getvalue())
        if row["regs"] is None:  # the cubin came from Triton's cache: read the registers from a fresh ptxas run
            row["regs"], row["spills"] = _ptxas_regs(kernel.asm["ptx"], arch)
    except Exception as exc:  # the compiler's own error is the result
        row.setdefault("config", launch.config)
        text = str(exc).strip() or type(exc).__name__
        row["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:300]}"
        if "ptxas" in text:
            lines = [ln for ln in text.splitlines() if "error" in ln.lower()]
            row["error"] += (" | " + " | ".join(lines[:3])) if lines else ""
    row["seconds"] = round(time.time() - start, 2)
    row["fits"], row["why"] = check_fit(row, target_name)
    row["autotune"] = launch.config
    return row


def _ptxas_regs(ptx: str, arch: int) -> tuple[int | None, int]:
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", src + ".o"],
                             capture_output=True, text=True)
    return parse_ptxas_log(out.stderr + out.stdout)


# ================================================================================================ stand-in driver
def install_target_driver(target_name: str) -> None:
    """Make triton and torch report ``target_name`` as the current device (capability, shared memory, SM count) for
    the host code that reads it (fla's block lists and configs). Must run before fla is imported; no launch works."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    arch, smem, sms = TARGETS[target_name]

    class _Utils:
        @staticmethod
        def get_device_properties(_device):
            return {"max_shared_mem": smem, "multiprocessor_count": sms, "max_num_regs": REGS_PER_BLOCK,
                    "warpSize": 32}

    class _Driver:
        utils = _Utils()

        @staticmethod
        def is_active():
            return True

        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", arch, 32)

        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(_device=None):
            return 0

        @staticmethod
        def get_active_torch_device():
            return torch.device("meta")

    driver.set_active(_Driver())
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    torch.cuda.get_device_name = lambda *a, **k: DEVICE_NAMES[arch]
    torch.cuda.device_count = lambda: 1


# ================================================================================================== launch sites
def _capture_mhc():
    import torch

    from glm53flash_hf import mhc_fused as m
    bf, f32 = torch.bfloat16, torch.float32
    n, m_dim = HC_MULT, (2 + HC_MULT) * HC_MULT
    for tokens in (TOKENS, 1):
        x = torch.empty(1, tokens, n, HIDDEN, dtype=bf, device="meta")
        y = torch.empty(1, tokens, HIDDEN, dtype=bf, device="meta")
        fn = torch.empty(m_dim, n * HIDDEN, dtype=f32, device="meta")
        base, scale = torch.empty(m_dim, dtype=f32, device="meta"), torch.empty(3, dtype=f32, device="meta")
        post = torch.empty(1, tokens, n, dtype=f32, device="meta")
        comb = torch.empty(1, tokens, n, n, dtype=f32, device="meta")
        tag = "train" if tokens > 1 else "decode"
        with _site(f"hc_pre fwd ({tag})"):
            _, _, collapsed, proj, sumsq = m._hc_pre_fwd_impl(x, fn, base, scale, 20, 1e-6, 1e-5)
        with _site(f"hc_pre bwd ({tag})"):
            pre = torch.empty(tokens, n, dtype=f32, device="meta")
            m._hc_pre_dpre_impl(x, collapsed)
            m._hc_pre_dx_impl(x, fn, proj, sumsq, pre, collapsed)
            m._hc_pre_dfn_impl(x, proj)
        with _site(f"hc_post fwd ({tag})"):
            m._hc_post_fwd_impl(y, x, post, comb)
        with _site(f"hc_post bwd ({tag})"):
            m._hc_post_bwd_impl(x, y, x, post, comb)


def _capture_dsa():
    import torch

    from glm53flash_hf import dsa_fused as d
    width = INDEX_TOPK + INDEX_KPOOL - 1
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.empty(1, TOKENS, DSA_HEADS, KV_LORA_RANK, dtype=dtype, device="meta")
        lat = torch.empty(1, TOKENS, KV_LORA_RANK, dtype=dtype, device="meta")
        idx = torch.empty(1, TOKENS, width, dtype=torch.int32, device="meta")
        lse = torch.empty(1, TOKENS, DSA_HEADS, dtype=torch.float32, device="meta")
        tag = str(dtype).replace("torch.", "")
        with _site(f"sparse_mla fwd ({tag})"):
            d._sparse_mla_fwd_impl(q, lat, idx, 1 / 16, None, None)
        with _site(f"sparse_mla bwd ({tag})"):
            d._sparse_mla_bwd_impl(q, lat, idx, q, lse, q, None, 1 / 16, None, None, True, True)


def _capture_moe():
    import torch

    from glm53flash_hf import moe_fused as mo
    rows = TOKENS * TOP_K
    bf = torch.bfloat16
    gate_up = torch.empty(rows, 2 * MOE_INTER, dtype=bf, device="meta")
    valid = torch.empty(1, dtype=torch.int32, device="meta")
    out_rows = torch.empty(rows, HIDDEN, dtype=bf, device="meta")
    weights = torch.empty(rows, dtype=torch.float32, device="meta")
    token_rows = torch.empty(TOKENS, TOP_K, dtype=torch.int64, device="meta")
    token_of_row = torch.empty(rows, dtype=torch.int64, device="meta")
    with _site("clamped_swiglu fwd"):
        mo._swiglu_fwd_impl(gate_up, valid, SWIGLU_LIMIT)
    with _site("clamped_swiglu bwd"):
        mo._swiglu_bwd_impl(gate_up, gate_up[:, :MOE_INTER], valid, SWIGLU_LIMIT)
    with _site("weighted_combine fwd"):
        mo._combine_fwd_impl(out_rows, weights, token_rows, token_of_row, valid, bf)
    with _site("weighted_combine bwd"):
        mo._combine_bwd_impl(torch.empty(TOKENS, HIDDEN, dtype=bf, device="meta"), out_rows, weights,
                             token_of_row, valid)


def _kda_inputs(tokens: int):
    import torch
    bf, f32 = torch.bfloat16, torch.float32
    h, k = KDA_HEADS, KDA_HEAD_DIM
    q = torch.empty(1, tokens, h, k, dtype=bf, device="meta")
    beta = torch.empty(1, tokens, h, dtype=bf, device="meta")
    a_log = torch.empty(h, dtype=f32, device="meta")
    dt_bias = torch.empty(h * k, dtype=f32, device="meta")
    return q, beta, a_log, dt_bias


def _capture_kda_chunk():
    import torch

    from glm53flash_hf import fla_compat
    from glm53flash_hf import kda_fused as kf
    q, beta, a_log, dt_bias = _kda_inputs(TOKENS)
    state = torch.empty(1, KDA_HEADS, KDA_HEAD_DIM, KDA_HEAD_DIM, dtype=torch.float32, device="meta")
    safe = kf._safe_gate(KDA_LOWER_BOUND)
    flags = (True, True, True, safe, KDA_LOWER_BOUND, KDA_CHUNK)
    with _site(f"chunk_kda fwd (chunk {KDA_CHUNK})"):
        out = fla_compat.chunk_forward(q, q, q, q, beta, a_log, dt_bias, state, None, KDA_HEAD_DIM ** -0.5, True,
                                       *flags)
    with _site(f"chunk_kda bwd (chunk {KDA_CHUNK})"):
        fla_compat.chunk_backward(q, state, q, q, q, q, beta, a_log, dt_bias, state, None, *out[2:],
                                  KDA_HEAD_DIM ** -0.5, *flags)


def _capture_kda_conv():
    import torch

    from glm53flash_hf import fla_compat
    width = 3 * KDA_HEADS * KDA_HEAD_DIM
    for tokens in (TOKENS, 1):
        x = torch.empty(1, tokens, width, dtype=torch.bfloat16, device="meta")
        w = torch.empty(width, CONV_KERNEL, dtype=torch.bfloat16, device="meta")
        h0 = torch.empty(1, width, CONV_KERNEL, dtype=torch.bfloat16, device="meta")
        tag = "train" if tokens > 1 else "decode"
        with _site(f"causal_conv1d fwd ({tag})"):
            fla_compat.conv_forward(x, w, h0, None, "silu", True)
        if tokens > 1:
            with _site("causal_conv1d bwd"):
                fla_compat.conv_backward(x, h0, x, w, h0, None, None, "silu")


def _capture_kda_norm():
    import torch

    from glm53flash_hf import fla_compat
    for tokens in (TOKENS, 1):
        x = torch.empty(1, tokens, KDA_HEADS, KDA_HEAD_DIM, dtype=torch.bfloat16, device="meta")
        w = torch.empty(KDA_HEAD_DIM, dtype=torch.float32, device="meta")
        tag = "train" if tokens > 1 else "decode"
        with _site(f"rms_norm_gated fwd ({tag})"):
            _, rstd = fla_compat.norm_forward(x, x, w, 1e-5)
        if tokens > 1:
            with _site("rms_norm_gated bwd"):
                fla_compat.norm_backward(x, x, x, w, rstd, 1e-5)


def _capture_kda_recurrent():
    import torch

    from glm53flash_hf import fla_compat
    q, beta, a_log, dt_bias = _kda_inputs(1)
    state = torch.empty(1, KDA_HEADS, KDA_HEAD_DIM, KDA_HEAD_DIM, dtype=torch.float32, device="meta")
    with _site("fused_recurrent_kda (decode)"), torch.no_grad():
        fla_compat.recurrent_step(q, q, q, q, beta, a_log, dt_bias, state, None, KDA_LOWER_BOUND)


CAPTURE = {"mhc": _capture_mhc, "dsa": _capture_dsa, "moe": _capture_moe, "kda_chunk": _capture_kda_chunk,
           "kda_conv": _capture_kda_conv, "kda_norm": _capture_kda_norm, "kda_recurrent": _capture_kda_recurrent}


def _size(launch: Launch) -> int:
    size = 1
    for value in launch.tune.values():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            size *= value
    return size


def bound_configs(launches: list[Launch], max_configs: int | None) -> list[Launch]:
    """At most ``max_configs`` autotune configurations per kernel and launch site: the largest ``max_configs - 1``
    by the product of their integer parameters (blocks, warps, stages: the ones nearest the limits) and the
    smallest; fixed launches are all kept. ``None``: every configuration."""
    if not max_configs:
        return launches
    groups: dict = {}
    for launch in launches:
        if launch.tune:
            groups.setdefault((launch.fn.__name__, launch.site), []).append(launch)
    keep = set()
    for group in groups.values():
        ranked = sorted(group, key=_size, reverse=True)
        chosen = ranked[:max_configs - 1] + ranked[-1:] if len(ranked) > max_configs else ranked
        keep.update(id(x) for x in chosen)
    return [x for x in launches if not x.tune or id(x) in keep]


def _config_text(config) -> str:
    parts = [f"{k}={v}" for k, v in config.kwargs.items()]
    return " ".join(parts + [f"warps={config.num_warps}", f"stages={config.num_stages}"])


def install_fla_prune(kernel_filters: tuple[str, ...] = ()) -> list[str]:
    """Chain the package's shared-memory prune (``fla_compat.prune_by_shared_memory``) onto fla's autotuners: those
    whose kernel name contains one of ``kernel_filters``, or all of them when none matches (no filter, or filters
    that name launch sites). Each configuration dropped is appended to ``_STATE["dropped"]``. Imports fla; returns
    the kernel names that got the prune."""
    from glm53flash_hf import fla_compat

    fla_compat.load()
    tuners = fla_compat.fla_autotuners()
    chosen = [t for t in tuners if any(f in t.base_fn.__name__ for f in kernel_filters)] or tuners

    def on_drop(tuner, config, need, limit):
        _STATE["dropped"].append({"kernel": tuner.base_fn.__name__, "site": _STATE["site"], "shared": need,
                                  "limit": limit, "config": _config_text(config)})

    for tuner in chosen:
        fla_compat.prune_by_shared_memory(tuner, on_drop=on_drop)
    return [t.base_fn.__name__ for t in chosen]


def capture(family: str) -> list[Launch]:
    """The launches of one family (a key of :data:`CAPTURE`), deduplicated by kernel, arguments and options."""
    _STATE["launches"] = []
    with recording() as launches:
        CAPTURE[family]()
    unique, seen = [], set()
    for launch in launches:
        key = (launch.fn.__module__, launch.fn.__name__,
               repr([(type(a).__name__, getattr(a, "dtype", a)) for a in launch.args]),
               repr(sorted((k, str(getattr(v, "dtype", v))) for k, v in launch.kwargs.items())))
        if key not in seen:
            seen.add(key)
            unique.append(launch)
    return unique


# ======================================================================================================== driver
SHARDS = {"kda_chunk": 6, "kda_conv": 2, "kda_norm": 2}  # jobs per family and target (fla's many configurations)


def _job(family: str, target_name: str, kernel_filters: tuple[str, ...], shard: int = 0, shards: int = 1,
         max_configs: int | None = None, prune: bool = True) -> list[dict]:
    """Capture one family under ``target_name``'s stand-in driver and compile its launches ``shard::shards`` (runs
    in a fresh process so that fla reads that target's properties at import). ``prune``: fla's autotuners get the
    package's shared-memory prune first (:func:`install_fla_prune`); shard 0 also returns a row per configuration
    it dropped (``pruned: True``)."""
    install_target_driver(target_name)
    rows = []
    try:
        if prune and family not in PACKAGE_FAMILIES:
            install_fla_prune(kernel_filters)
        _STATE["dropped"] = []
        launches = bound_configs(capture(family), max_configs)
    except Exception as exc:
        return [{"kernel": f"({family} capture)", "site": family, "target": target_name, "config": "",
                 "error": f"{type(exc).__name__}: {exc}"[:400], "shared": None, "regs": None, "spills": None,
                 "num_warps": None, "seconds": 0.0, "fits": False, "why": "capture failed", "autotune": "",
                 "trace": traceback.format_exc()[-2000:]}]
    for launch in launches[shard::shards]:
        if kernel_filters and not any(f in launch.fn.__name__ or f in launch.site for f in kernel_filters):
            continue
        row = compile_launch(launch, target_name)
        row["family"] = family
        rows.append(row)
    if shard == 0:
        for drop in _STATE["dropped"]:
            if kernel_filters and not any(f in drop["kernel"] or f in drop["site"] for f in kernel_filters):
                continue
            rows.append({**drop, "family": family, "target": target_name, "pruned": True})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (one line per kernel, launch site, configuration and target)."""
    head = "| family | kernel | launch site | target | config | compiled | shared B | regs | spills B | fits |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        compiled = "yes" if not r["error"] else f"no: {r['error'][:160]}".replace("|", "/")
        fits = "yes" if r["fits"] else f"**no** ({r['why']})"
        lines.append(f"| {r.get('family', '')} | `{r['kernel']}` | {r['site']} | {r['target']} | {r.get('config', '')} "
                     f"| {compiled} | {r['shared'] if r['shared'] is not None else '-'} "
                     f"| {r['regs'] if r['regs'] is not None else '-'} "
                     f"| {r['spills'] if r['spills'] is not None else '-'} | {fits} |")
    return "\n".join(lines)


def dropped_table(rows: list[dict]) -> str:
    """The configurations the prune dropped (rows with ``kernel``, ``site``, ``target``, ``config``, ``shared``,
    ``limit``) as a markdown table."""
    lines = ["| kernel | launch site | target | config | shared B | limit B |", "|" + "---|" * 6]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['site']} | {r['target']} | {r['config']} | {r['shared']} "
                     f"| {r['limit']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="*", default=[],
                        help=f"families ({', '.join(FAMILIES)}) or substrings of kernel / launch-site names")
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS),
                        help="targets to compile for (default: all three)")
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--unpruned", action="store_true",
                        help="record fla's autotune lists as they are, without the package's shared-memory prune")
    parser.add_argument("--max-configs", type=int, default=None,
                        help="bound the autotune configurations per kernel and launch site (default: all; see "
                             "bound_configs)")
    args = parser.parse_args(argv)
    families = [f for f in FAMILIES if f in args.kernels] or list(FAMILIES)
    filters = tuple(k for k in args.kernels if k not in FAMILIES)
    if args.max_configs is not None and args.max_configs < 2:
        parser.error(f"--max-configs must be >= 2 (the largest and the smallest); got --max-configs={args.max_configs}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got --jobs={args.jobs}")
    start = time.time()
    jobs = [(f, t, i, SHARDS.get(f, 1)) for t in args.targets for f in families for i in range(SHARDS.get(f, 1))]
    rows: list[dict] = []
    ctx = multiprocessing.get_context("spawn")
    # one process per job: fla reads the target at import, and a kernel's binder keeps the first target it saw
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(_job, f, t, filters, i, n, args.max_configs, not args.unpruned)
                   for f, t, i, n in jobs]
        for fut in concurrent.futures.as_completed(futures):
            rows.extend(fut.result())
            print(f"[{time.time() - start:.0f} s] {len(rows)} compiled", file=sys.stderr, flush=True)
    order = {f: i for i, f in enumerate(FAMILIES)}
    rows.sort(key=lambda r: (order.get(r.get("family", ""), 99), r["site"], r["kernel"], r.get("config", ""),
                             list(TARGETS).index(r["target"])))
    dropped = [r for r in rows if r.get("pruned")]
    rows = [r for r in rows if not r.get("pruned")]
    elapsed = time.time() - start
    print(markdown_table(rows))
    if dropped:
        print("\nDropped by the shared-memory prune (not compiled above):\n")
        print(dropped_table(dropped))
    failed = [r for r in rows if not r["fits"]]
    print(f"\n{len(rows)} compilations, {len(failed)} not fitting, {len(dropped)} configurations dropped by the "
          f"prune{' (not installed: --unpruned)' if args.unpruned else ''}, {elapsed:.0f} s with {args.jobs} worker(s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seconds": elapsed, "rows": rows, "pruned": dropped}, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
