"""glm53flash-plan: will a training setup fit? Memory per GPU by part, from the model's parameter shapes.

For a checkpoint folder (its ``config.json``) or the release configuration (``--release``) and a setup (GPUs and
their memory, FSDP2 / EP / SP sizes, sequence length, micro-batch, LoRA rank or full fine-tune, BF16 or FP8 base,
activation checkpointing), prints the bytes one GPU holds at the peak of a training step, by part (weights,
gradients, optimizer states, activations, communication buffers), and whether they fit in ``--gpu-memory-gib`` less
``--reserve-gib``. Not counted: the CUDA context, the allocator's caches (``--reserve-gib`` stands for them),
kernels' workspaces, the fused kernels' own saved sets.

Usage::

    glm53flash-plan --release --gpus 8 --gpu-memory-gib 141 --ep 8 --fsdp 8 --seq-len 4096 --lora-rank 16 --base fp8
    glm53flash-plan CHECKPOINT_DIR --gpus 2 --gpu-memory-gib 80 --fsdp 2 --seq-len 2048
    glm53flash-plan --release --table          # the README's release table
"""

from __future__ import annotations

import itertools
import math
import re
import sys
from dataclasses import dataclass, field

from ..fp8_blockwise import FP8_KEY_PATTERNS

GIB = 1024**3
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
BASES = ("bf16", "fp8", "fp32")
FP8_BLOCK = 128
#: the chunk length of KDA's chunked scan
KDA_CHUNK = 64


@dataclass
class Setup:
    """A training setup. ``fsdp`` is 1 (replicated) or ``gpus`` (FSDP2 over every rank, as the package shards);
    ``ep`` divides ``gpus`` and the routed-expert count; ``sp`` divides ``gpus`` and ``seq_len``; ``lora_rank`` 0
    means a full fine-tune; ``base`` is the stored dtype of the frozen base under LoRA (``bf16``, ``fp8`` or
    ``fp32``); ``compute_dtype`` the forward's (``bf16`` or ``fp32``); ``reserve_gib`` is kept free per GPU."""

    gpus: int = 1
    gpu_memory_gib: float = 80.0
    fsdp: int = 1
    ep: int = 1
    sp: int = 1
    seq_len: int = 4096
    micro_batch: int = 1
    lora_rank: int = 0
    base: str = "bf16"
    compute_dtype: str = "bf16"
    checkpointing: bool = True
    reserve_gib: float = 0.0


@dataclass
class MemoryPlan:
    """Bytes per GPU by part (``parts``: weights, gradients, optimizer_states, activations,
    communication_buffers), their ``total``, the usable ``budget`` and ``fits`` (``total <= budget``); ``details``
    holds the counts behind them (parameters, trainable elements, tokens per rank)."""

    parts: dict = field(default_factory=dict)
    total: int = 0
    budget: int = 0
    fits: bool = False
    details: dict = field(default_factory=dict)


def check_setup(setup: Setup, config) -> None:
    """Raise ``ValueError`` naming the option (as on the command line), its value and what is expected."""
    for name in ("gpus", "fsdp", "ep", "sp", "seq_len", "micro_batch"):
        value = getattr(setup, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {value!r}")
    if not setup.lora_rank >= 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tune); got {setup.lora_rank!r}")
    if not (isinstance(setup.gpu_memory_gib, (int, float)) and math.isfinite(setup.gpu_memory_gib)
            and setup.gpu_memory_gib > 0):
        raise ValueError(f"--gpu-memory-gib must be a finite number > 0; got {setup.gpu_memory_gib!r}")
    if not (math.isfinite(setup.reserve_gib) and 0 <= setup.reserve_gib < setup.gpu_memory_gib):
        raise ValueError(f"--reserve-gib must be in [0, --gpu-memory-gib={setup.gpu_memory_gib}); "
                         f"got {setup.reserve_gib!r}")
    if setup.fsdp not in (1, setup.gpus):
        raise ValueError(f"--fsdp must be 1 or --gpus={setup.gpus} (FSDP2 shards over every rank); "
                         f"got {setup.fsdp}")
    for part, whole in (("ep", "gpus"), ("sp", "gpus"), ("sp", "seq_len")):
        if getattr(setup, whole) % getattr(setup, part):
            raise ValueError(f"--{part}={getattr(setup, part)} must divide --{whole.replace('_', '-')}="
                             f"{getattr(setup, whole)}")
    if setup.ep > 1 and setup.sp > 1:
        raise ValueError(f"--ep and --sp cannot be combined (glm53flash-finetune refuses it); got --ep={setup.ep} "
                         f"--sp={setup.sp}")
    if config.n_routed_experts % setup.ep:
        raise ValueError(f"--ep={setup.ep} must divide the routed-expert count n_routed_experts="
                         f"{config.n_routed_experts}")
    if setup.base not in BASES:
        raise ValueError(f"--base must be one of {BASES}; got {setup.base!r}")
    if setup.compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"--compute-dtype must be one of {tuple(DTYPE_BYTES)}; got {setup.compute_dtype!r}")


_SHAPES: dict = {}


def parameter_shapes(config) -> tuple[dict, set, int]:
    """``({name: shape}, fp32-kept names, buffer elements)`` of ``Glm53FlashForCausalLM(config)`` built on the meta
    device (no memory; cached per config)."""
    import torch

    from ..modeling_glm53flash import Glm53FlashForCausalLM
    from ..train.distributed import fp32_kept_parameter_names

    key = config.to_json_string()
    if key not in _SHAPES:
        with torch.device("meta"):
            model = Glm53FlashForCausalLM(config)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        kept = set(fp32_kept_parameter_names(model, torch.bfloat16))
        _SHAPES[key] = (shapes, kept, sum(b.numel() for b in model.buffers()))
    return _SHAPES[key]


# Our parameter names of the tensors the FP8 release quantizes (the fused experts hold the per-expert weights).
_FP8_PATTERNS = (r"\.mlp\.experts\.(gate_up_proj|down_proj)$",) + tuple(
    p for p in FP8_KEY_PATTERNS if "experts\\.\\d+" not in p
)


def _is_fp8(name: str, dsa_prefixes: set) -> bool:
    if not any(re.search(p, name) for p in _FP8_PATTERNS):
        return False
    if name.endswith("self_attn.o_proj.weight"):  # FP8 only in DSA / MTP attention (those with q_a_proj)
        return name[: -len("o_proj.weight")] in dsa_prefixes
    return True


def _fp8_bytes(shape) -> int:
    """e4m3 elements plus one fp32 scale per 128x128 block of the last two dimensions (per leading index)."""
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    return math.prod(shape) + 4 * lead * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)


def _lora_targets(name: str, shape) -> int:
    """Adapter elements per unit of rank for parameter ``name`` under ``default_lora_config`` (0: not adapted)."""
    from ..train.trainer import DEFAULT_TARGET_MODULES, EXPERT_TARGET_PARAMETERS

    if any(name.endswith(t) for t in EXPERT_TARGET_PARAMETERS):
        return shape[0] * (shape[1] + shape[2])
    leaf = name.rsplit(".", 2)
    if name.endswith(".weight") and len(shape) == 2 and len(leaf) == 3 and leaf[1] in DEFAULT_TARGET_MODULES:
        return shape[0] + shape[1]
    return 0


def _shard(shape, n: int) -> int:
    """Elements of one ``Shard(0)`` piece over ``n`` ranks (``ceil(dim0 / n)`` rows)."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:]) if shape else 1


def saved_elements_per_token(config, kind: str, mlp: str) -> int:
    """Elements the forward saves for the backward per token in one decoder layer (``kind``
    ``"linear_attention"`` / ``"indexed_attention"`` / ``"mtp"``, ``mlp`` ``"dense"`` / ``"sparse"``), as the torch
    implementations save them: two mHC blocks (the ``hc * d`` stream and the Sinkhorn iterates), two RMSNorms, the
    two ``hc_post`` mixes, the attention (KDA: projections, conv input, gates and the chunked scan's per-chunk
    tensors; DSA: low-rank projections, absorbed queries, latent, top-k ids, latent outputs) and the MLP (dense
    SwiGLU, or router + ``k`` routed rows + shared experts)."""
    d, hc, it = config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters
    norm = 2 * d + 1
    if kind == "linear_attention":
        h, k = config.linear_num_heads, config.linear_head_dim
        attn = d + k + 29 * h * k + 3 * h + 3 * h * KDA_CHUNK
    else:
        h = config.num_attention_heads
        width = config.index_topk + config.index_kpool - 1
        attn = (d + 3 * config.q_lora_rank + 3 * config.kv_lora_rank + 2 + h * config.qk_nope_head_dim
                + 2 * h * config.kv_lora_rank + width + h * config.v_head_dim)
    if mlp == "dense":
        ffn = d + 6 * config.intermediate_size
    else:
        moe_i, top = config.moe_intermediate_size, config.num_experts_per_tok
        ffn = (2 * d + config.n_routed_experts + 8 + top * (2 * d + 5 * moe_i + 5)
               + 6 * config.n_shared_experts * moe_i)
    if kind == "mtp":  # enorm, hnorm, eh_proj input, the shared head's norm; no mHC
        return (2 * d + 1) + (d + 1) + 2 * d + 2 * norm + attn + ffn + norm
    mhc = hc * d + 2 + hc * (2 + hc) + 3 * hc + it * (2 * hc * hc + 2 * hc + 1)
    return 2 * mhc + 2 * norm + 2 * (hc * hc + d + hc) + attn + ffn


def _dsa_chunk_elements(config, rows: int, tokens: int) -> int:
    """Elements of the gathered latents ``[rows, chunk, W, kv_lora_rank]`` of one sparse-attention chunk."""
    from ..dsa_ops import DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS

    width = config.index_topk + config.index_kpool - 1
    chunk = max(1, DEFAULT_SPARSE_MLA_CHUNK_ELEMENTS // max(1, rows * width * (config.kv_lora_rank
                                                                              + config.num_attention_heads)))
    return rows * min(chunk, tokens) * width * config.kv_lora_rank


def _activations(config, setup: Setup, layer_kinds) -> tuple[int, int]:
    """(activation bytes at the peak, SP communication bytes) per rank."""
    b = DTYPE_BYTES[setup.compute_dtype]
    rows, tokens = setup.micro_batch, setup.seq_len // setup.sp
    t = rows * tokens
    vocab = config.vocab_size
    mtp_layers = config.num_nextn_predict_layers
    heads = 1 + (config.mtp_depth if mtp_layers and config.mtp_loss_weight > 0 else 0)
    upcast = 4 if b != 4 else 0  # the loss's fp32 copy of low-precision logits
    # forward end of the heads: earlier heads keep logits + log-softmax, the last one also its fp32 copy
    head = t * vocab * ((heads - 1) * (b + 4) + (b + upcast + 4))
    dsa_chunk = 3 * _dsa_chunk_elements(config, rows, tokens) * b
    saved = [saved_elements_per_token(config, kind, mlp) * t * b for kind, mlp in layer_kinds]
    if setup.checkpointing:
        d, hc = config.hidden_size, config.hc_mult
        inputs = sum(t * b * (2 * d if kind == "mtp" else hc * d) for kind, _ in layer_kinds)
        recompute = max(s + (dsa_chunk if kind != "linear_attention" else 0)
                        for s, (kind, _) in zip(saved, layer_kinds))
        act = inputs + max(head, recompute)
    else:
        act, kept = 0, 0
        for s, (kind, _) in zip(saved, layer_kinds):
            if kind != "linear_attention":
                act = max(act, kept + dsa_chunk)
            kept += s
        act = max(act, kept + head)
    sp_comm = 0
    if setup.sp > 1 and any(kind != "linear_attention" for kind, _ in layer_kinds):
        sp_comm = rows * setup.seq_len * (config.kv_lora_rank * b + 2 * config.index_head_dim * 4)
    return act, sp_comm


def plan_memory(config, setup: Setup) -> MemoryPlan:
    """The :class:`MemoryPlan` (bytes per GPU, module docstring) of ``setup`` for ``config`` (a text or top-level
    config); ``ValueError`` as :func:`check_setup`."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    check_setup(setup, config)
    names, kept, buffer_elements = parameter_shapes(config)
    lora = setup.lora_rank > 0
    dsa_prefixes = {n[: -len("q_a_proj.weight")] for n in names if n.endswith("self_attn.q_a_proj.weight")}
    base_b = {"bf16": 2, "fp32": 4, "fp8": 2}[setup.base]
    cb = DTYPE_BYTES[setup.compute_dtype]
    n_dense = setup.fsdp
    n_expert_fsdp = setup.gpus // setup.ep if setup.fsdp > 1 else 1

    weights = trainable = total_params = 0
    units: dict = {}  # FSDP unit -> [unsharded compute bytes, unsharded trainable elements]
    for name, full_shape in names.items():
        expert = ".mlp.experts." in name
        shape = (full_shape[0] // setup.ep,) + full_shape[1:] if expert else full_shape
        n = n_expert_fsdp if expert else n_dense
        total_params += math.prod(full_shape)
        local = _shard(shape, n)
        adapter = 0
        if lora:
            if name in kept or setup.base == "fp32":
                stored, compute = 4 * local, 4 * math.prod(shape)
            elif setup.base == "fp8" and _is_fp8(name, dsa_prefixes):
                stored = _fp8_bytes((math.ceil(shape[0] / n),) + shape[1:]) if len(shape) > 1 else local
                compute = _fp8_bytes(shape)
            else:
                stored, compute = base_b * local, base_b * math.prod(shape)
            adapter = setup.lora_rank * _lora_targets(name, shape)
            weights += stored + 4 * math.ceil(adapter / n)  # adapters: fp32, sharded like the weight they adapt
            trainable += math.ceil(adapter / n)
            compute += cb * adapter
        else:
            weights += 4 * local
            trainable += local
            compute = (4 if name in kept else cb) * math.prod(shape)
        m = re.match(r"model\.layers\.(\d+)\.", name)
        unit = (f"layer{m.group(1)}" + (".experts" if expert and setup.ep > 1 else "")) if m else "root"
        u = units.setdefault(unit, [0, 0])
        u[0] += compute
        u[1] += adapter if lora else math.prod(shape)
    weights += 4 * buffer_elements

    layer_kinds = [(config.layer_types[i], config.mlp_layer_types[i]) for i in range(config.num_hidden_layers)]
    layer_kinds += [("mtp", "sparse")] * config.num_nextn_predict_layers
    act, sp_comm = _activations(config, setup, layer_kinds)

    comm = sp_comm
    if setup.fsdp > 1:
        layer_units = [v for k, v in units.items() if k != "root"]
        largest = max(v[0] for v in layer_units)
        largest_grad = max(v[1] for v in layer_units)
        root_bytes = units.get("root", [0])[0]
        comm += 2 * largest + 4 * largest_grad + root_bytes - root_bytes // setup.fsdp
    if setup.ep > 1:
        t = setup.micro_batch * setup.seq_len // setup.sp
        comm += 2 * t * config.num_experts_per_tok * config.hidden_size * cb

    parts = {"weights": int(weights), "gradients": int(4 * trainable), "optimizer_states": int(8 * trainable),
             "activations": int(act), "communication_buffers": int(comm)}
    total = sum(parts.values())
    budget = int((setup.gpu_memory_gib - setup.reserve_gib) * GIB)
    details = {"parameters": total_params, "trainable_per_gpu": int(trainable),
               "tokens_per_gpu": setup.micro_batch * setup.seq_len // setup.sp}
    return MemoryPlan(parts=parts, total=total, budget=budget, fits=total <= budget, details=details)


def load_config(path: str | None):
    """The text config of the checkpoint folder ``path`` (its ``config.json``), or the release configuration
    (``Glm53FlashConfig()`` defaults plus the release's one MTP layer) when ``path`` is ``None``; ``ValueError`` when
    ``path`` is not a folder with a ``config.json``."""
    import os

    from ..configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig

    if path is None:
        return Glm53FlashTextConfig(num_nextn_predict_layers=1)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"checkpoint={path!r} must be a folder with a config.json")
    return Glm53FlashConfig.from_pretrained(path).get_text_config(decoder=True)


def fp8_load_bytes(config, dtype=None) -> dict[str, int]:
    """Weight bytes of ``Glm53FlashForCausalLM`` of ``config`` loaded in ``dtype`` (default bf16) from an FP8
    checkpoint in the release's layout, kept in FP8 and dequantized: the modules the load builds, on the meta device
    (design.md, FP8).

    Returns:
        ``{"fp8", "scales", "other", "total"}`` of the FP8-kept model (:func:`glm53flash_hf.fp8_kept.fp8_weight_bytes`),
        ``"dequantized"`` (total of the dequantized load), ``"converted"`` (bytes of the converted modules' FP8
        weights and scales), ``"converted_dequantized"`` (the same tensors dequantized), ``"fp8_keys"`` (published FP8
        weight tensors; each has one ``*_scale_inv``) and ``"fp8_modules"`` (modules converted).
    """
    import torch
    from transformers import FineGrainedFP8Config
    from transformers.core_model_loading import revert_weight_conversion

    from ..checkpoint import fp8_module_names_of_keys
    from ..fp8_blockwise import MODULES_TO_NOT_CONVERT, fp8_keys_of
    from ..fp8_kept import FP8_DTYPE, Glm53FlashFP8Quantizer, fp8_quantizer_for_load, fp8_weight_bytes
    from ..modeling_glm53flash import Glm53FlashForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype
    with torch.device("meta"):
        model = Glm53FlashForCausalLM._from_config(config, dtype=dtype)
    dequantized = fp8_weight_bytes(model)["total"]
    fp8_keys = fp8_keys_of(revert_weight_conversion(model, model.state_dict()))
    names = fp8_module_names_of_keys(fp8_keys)
    before = {n: t.numel() * t.element_size() for n, t in model.named_parameters()}
    fp8_config = FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK),
                                      modules_to_not_convert=MODULES_TO_NOT_CONVERT)
    quantizer = Glm53FlashFP8Quantizer(fp8_config, pre_quantized=True)
    with fp8_quantizer_for_load(names):
        quantizer.preprocess_model(model)
    out = fp8_weight_bytes(model)
    converted = [(n, t) for n, t in model.named_parameters() if t.dtype == FP8_DTYPE or n.endswith("_scale_inv")]
    out.update(dequantized=dequantized, converted=sum(t.numel() * t.element_size() for _, t in converted),
               converted_dequantized=sum(before[n] for n, t in converted if t.dtype == FP8_DTYPE),
               fp8_keys=len(fp8_keys),
               fp8_modules=sum(type(m).__name__.startswith("Glm53FlashFP8") for m in model.modules()))
    return out


def format_plan(plan: MemoryPlan, setup: Setup) -> str:
    """The plan as text: one line per part (GiB), the total against the budget, and the verdict."""
    lines = [f"{name.replace('_', ' '):24s} {value / GIB:9.2f} GiB" for name, value in plan.parts.items()]
    lines.append(f"{'total per GPU':24s} {plan.total / GIB:9.2f} GiB of {plan.budget / GIB:.2f} GiB usable "
                 f"({setup.gpu_memory_gib:g} GiB - {setup.reserve_gib:g} GiB reserve)")
    lines.append(f"fits: {'yes' if plan.fits else 'no'}")
    return "\n".join(lines)


#: The README's release table's GPUs: (name, GiB per GPU as CUDA reports it: 81559 MiB, 143771 MiB).
RELEASE_GPUS = (("8xH100 80GB", 79.6), ("8xH200 141GB", 140.4))


def release_setup(config, memory: float, lora_rank: int, base: str, seq_len: int) -> tuple[Setup, MemoryPlan]:
    """The setup of a row of the release table and its plan: 8 GPUs, FSDP2 over all 8, activation checkpointing,
    micro-batch 1, bf16 compute, 4 GiB reserve, and of EP 8 (SP 1) or SP 8 (EP 1) the one needing less memory."""
    setups = [Setup(gpus=8, gpu_memory_gib=memory, fsdp=8, ep=ep, sp=sp, seq_len=seq_len, micro_batch=1,
                    lora_rank=lora_rank, base=base, compute_dtype="bf16", checkpointing=True, reserve_gib=4.0)
              for ep, sp in ((8, 1), (1, 8))]
    return min(((s, plan_memory(config, s)) for s in setups), key=lambda pair: pair[1].total)


def release_table(config) -> str:
    """Markdown table of :func:`release_setup` over :data:`RELEASE_GPUS`, LoRA r=16 / full, BF16 / FP8, 4k / 32k."""
    rows = ["| GPUs | training | base | tokens | FSDP2 / EP / SP | ckpt | weights | grads + optim | activations "
            "| comm | total GiB | usable GiB | fits |", "|" + "---|" * 13]
    for (gpu, memory), rank, base, seq in itertools.product(RELEASE_GPUS, (16, 0), ("bf16", "fp8"), (4096, 32768)):
        s, p = release_setup(config, memory, rank, base, seq)
        g = {k: v / GIB for k, v in p.parts.items()}
        rows.append(f"| {gpu} | {'LoRA r=' + str(rank) if rank else 'full'} | {base.upper()} | {seq // 1024}k "
                    f"| {s.fsdp} / {s.ep} / {s.sp} | yes | {g['weights']:.1f} "
                    f"| {g['gradients'] + g['optimizer_states']:.1f} | {g['activations']:.1f} "
                    f"| {g['communication_buffers']:.1f} | {p.total / GIB:.1f} | {p.budget / GIB:.1f} "
                    f"| {'yes' if p.fits else 'no'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    """Console entry point ``glm53flash-plan`` (see the module docstring); returns 0 when the setup fits, 1 when it
    does not (``--table``: 0). Bad options exit with status 2 and a message naming the option."""
    from . import docstring_parser

    parser = docstring_parser("glm53flash-plan", __doc__)
    parser.add_argument("checkpoint", nargs="?", help="checkpoint folder (its config.json); omit with --release")
    parser.add_argument("--release", action="store_true", help="the release configuration (45 layers + MTP)")
    parser.add_argument("--table", action="store_true", help="print the README's release table and exit")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="kept free per GPU for the CUDA context and the allocator (default: %(default)s)")
    parser.add_argument("--fsdp", type=int, default=None, help="FSDP2 size: 1 or --gpus (default: --gpus)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --gpus and the experts)")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size (divides --gpus and --seq-len)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per SP group and step")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--base", default="bf16", help=f"stored dtype of the frozen base under LoRA: {BASES}")
    parser.add_argument("--compute-dtype", default="bf16", help=f"forward dtype: {tuple(DTYPE_BYTES)}")
    parser.add_argument("--no-checkpointing", action="store_true", help="without activation checkpointing")
    args = parser.parse_args(argv)
    if args.release == (args.checkpoint is not None):
        parser.error("give a checkpoint folder or --release (one of them)")
    try:
        config = load_config(None if args.release else args.checkpoint)
        if args.table:
            print(release_table(config))
            return 0
        fields = ("gpus", "gpu_memory_gib", "ep", "sp", "seq_len", "micro_batch", "lora_rank", "base", "compute_dtype",
                  "reserve_gib")
        setup = Setup(**{f: getattr(args, f) for f in fields}, checkpointing=not args.no_checkpointing,
                      fsdp=args.gpus if args.fsdp is None else args.fsdp)
        plan = plan_memory(config, setup)
    except ValueError as exc:
        parser.error(str(exc))
    print(format_plan(plan, setup))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
