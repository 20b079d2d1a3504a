"""``glm53flash-crop``: FP8 crop equals the bf16 crop (exactly the dequantized FP8 tensors, within the e4m3 bound of
the bf16 ones), schedule rewrite, MTP renumbering, the cropped model loads and runs, ``--dry-run`` writes nothing,
and the peak memory of a crop stays near one shard (measured in a subprocess).

The FP8 bound is the one of ``tests/test_checkpoint.py`` (``ckpt_fixtures.fp8_error_bound``) plus ``2^-8 |y|`` for
the final rounding of the dequantized value ``y`` to bf16 (8 significant bits).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
from ckpt_fixtures import (
    CANONICAL_TEXT,
    ROOT,
    bf16_model,
    fp8_error_bound,
    read_all,
    read_index,
    save_canonical,
    shard_names,
    tiny_config,
    write_variant,
)

from glm53flash_hf.fp8_blockwise import dequantize_fp8_blockwise
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.tools import crop

H, N = 6, 3  # tiny.json: 6 main layers (+ MTP at layers.6); crops keep 3
EXTRA_FILES = {
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "preprocessor_config.json": "{}",
    "README.md": "model card (not copied)",
}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("crop_src")
    canonical = save_canonical(bf16_model(), root / "canonical")
    out = {
        "bf16": write_variant(canonical, str(root / "bf16")),
        "fp8": write_variant(canonical, str(root / "fp8"), fp8=True),
        "fp8_lm": write_variant(canonical, str(root / "fp8_lm"), "language_model.", "visual.", fp8=True),
    }
    for folder in out.values():
        for name, text in EXTRA_FILES.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
    return out


@pytest.fixture(scope="module")
def crops(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("crops")
    out = {}
    for name in ("bf16", "fp8", "fp8_lm"):
        out[name] = str(root / name)
        assert crop.main([src[name], out[name], "--layers", str(N), "--no-progress"]) == 0
    return out


def _source_key(key: str) -> str:
    """The source key of an output key (MTP layers.N -> layers.H)."""
    return key.replace(f"layers.{N}.", f"layers.{H}.", 1)


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        crop.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = ("SRC", "OUT", "--layers", "--dry-run", "--dtype", "--max-shard-size", "--list-keys", "--no-progress")
    for option in options:
        assert option in text, option
    assert "MTP" in text and "dequantized" in text
    eps = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert eps.get("glm53flash-crop") == "glm53flash_hf.tools.crop:main"


def test_console_script_runs_main():
    console = os.path.join(os.path.dirname(sys.executable), "glm53flash-crop")
    result = subprocess.run([console, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "glm53flash-crop" in result.stdout, result.stderr


def test_dry_run_writes_nothing(src, tmp_path, capsys):
    out = tmp_path / "never"
    assert crop.main([src["fp8"], str(out), "--layers", str(N), "--dry-run", "--list-keys"]) == 0
    assert not out.exists()
    text = capsys.readouterr().out
    assert f"MTP layer: layers.{H}.* -> layers.{N}.*" in text
    assert f"num_hidden_layers: {H} -> {N}" in text
    assert "indexer_types: ['full', 'full', 'full', 'full', 'full', 'shared'] -> ['full', 'full', 'full']" in text
    assert "quantization_config: present -> removed" in text
    mtp_line = f"rename             {CANONICAL_TEXT}layers.{H}.eh_proj.weight -> "
    mtp_line += f"{CANONICAL_TEXT}layers.{N}.eh_proj.weight"
    assert mtp_line in text
    assert f"drop               {CANONICAL_TEXT}layers.{N}.input_layernorm.weight" in text
    assert "scale" in text and "keep+dequantize" in text
    assert "files copied: chat_template.jinja, " in text and "README.md" not in text


def test_fp8_crop_equals_bf16_crop(src, crops):
    full_bf16, full_fp8 = read_all(src["bf16"]), read_all(src["fp8"])
    cb, cq = read_all(crops["bf16"]), read_all(crops["fp8"])
    expected = {
        k.replace(f"layers.{H}.", f"layers.{N}.")
        for k in full_bf16
        if not any(f"layers.{i}." in k for i in range(N, H))
    }
    assert cb.keys() == expected and cq.keys() == expected
    n_fp8 = 0
    for k in expected:
        sk = _source_key(k)
        assert torch.equal(cb[k], full_bf16[sk]) and cb[k].dtype == full_bf16[sk].dtype, k
        w = full_fp8[sk]
        if w.dtype == torch.float8_e4m3fn:
            s = full_fp8[sk + "_scale_inv"]
            assert cq[k].dtype == torch.bfloat16
            assert torch.equal(cq[k], dequantize_fp8_blockwise(w, s, torch.bfloat16)), k
            err = (cq[k].float() - cb[k].float()).abs()
            bound = fp8_error_bound(cb[k], s) + cq[k].float().abs() * 2.0**-8
            assert (err <= bound).all(), k
            n_fp8 += 1
        else:
            assert torch.equal(cq[k], cb[k]) and cq[k].dtype == cb[k].dtype, k
    assert n_fp8 == 92  # layers 0-2 and the MTP layer's FP8 weights
    for name in ("bf16", "fp8"):
        with open(os.path.join(crops[name], "config.json")) as f:
            config = json.load(f)
        text = config["text_config"]
        assert "quantization_config" not in config and text["num_hidden_layers"] == N
        assert text["layer_types"] == ["linear_attention", "linear_attention", "indexed_attention"]
        assert text["mlp_layer_types"] == ["dense", "sparse", "sparse"]
        assert text["indexer_types"] == ["full", "full", "full"]
        assert text["num_nextn_predict_layers"] == 1
        for extra in EXTRA_FILES:
            assert os.path.exists(os.path.join(crops[name], extra)) == (extra != "README.md"), extra
        assert os.path.exists(os.path.join(crops[name], "modeling_glm53flash.py"))
        index = read_index(crops[name])
        assert set(index["weight_map"].values()) == set(shard_names(crops[name])) and len(shard_names(crops[name])) > 1


def test_cropped_model_loads_and_runs(src, crops, tmp_path):
    """The crop (``--dtype fp32``) loads to the full FP8 model's first N layers + MTP (both dequantized to fp32)
    and gives the full model's logits when that runs its first N layers only. The default bf16 crop loads to the
    full model loaded in bf16."""
    fp32_crop = str(tmp_path / "fp32")
    assert crop.main([src["fp8"], fp32_crop, "--layers", str(N), "--dtype", "fp32", "--no-progress"]) == 0
    full = Glm53FlashForCausalLM.from_pretrained(src["fp8"], dtype=torch.float32, dequantize_fp8=True).eval()
    cropped = Glm53FlashForCausalLM.from_pretrained(fp32_crop, dtype=torch.float32).eval()
    assert cropped.config.text_config.num_hidden_layers == N and len(cropped.model.layers) == N + 1
    full_sd = full.state_dict()
    for k, v in cropped.state_dict().items():
        assert torch.equal(v, full_sd[_source_key(k)]), k
    load = functools.partial(Glm53FlashForCausalLM.from_pretrained, dequantize_fp8=True)
    full_bf16 = load(src["fp8"], dtype=torch.bfloat16).state_dict()
    for k, v in load(crops["fp8"], dtype=torch.bfloat16).state_dict().items():
        assert v.dtype == full_bf16[_source_key(k)].dtype and torch.equal(v, full_bf16[_source_key(k)]), k
    ids = torch.randint(0, 2000, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = cropped(input_ids=ids).logits
        full.config.text_config.num_hidden_layers = N  # the full model run through its first N layers only
        ref = full(input_ids=ids).logits
    assert torch.isfinite(logits).all() and torch.equal(logits, ref)
    lm = load(crops["fp8_lm"], dtype=torch.float32).state_dict()
    for k, v in load(crops["fp8"], dtype=torch.float32).state_dict().items():
        assert torch.equal(v, lm[k]), k  # the language_model.-prefixed crop loads the same weights


def test_crop_keeps_the_source_prefix(crops):
    keys = read_index(crops["fp8_lm"])["weight_map"]
    assert f"language_model.layers.{N}.eh_proj.weight" in keys and "visual.merger.proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)


def test_crop_errors(src, tmp_path, capsys):
    for bad in ("0", str(H + 1)):
        with pytest.raises(SystemExit) as e:
            crop.main([src["bf16"], str(tmp_path / "o"), "--layers", bad])
        assert e.value.code == 2
        assert f"--layers must be in [1, num_hidden_layers={H}]; got {bad}" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(SystemExit) as e:
        crop.main([src["bf16"], str(busy), "--layers", "2"])
    assert e.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    for bad in ("0", "0MB", "-5"):
        with pytest.raises(SystemExit) as e:
            crop.main([src["bf16"], str(tmp_path / "o"), "--layers", "2", "--max-shard-size", bad])
        assert e.value.code == 2 and f"not a size: {bad!r}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    plan = crop.plan_crop(src["bf16"], 2, torch.bfloat16)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"max_shard_size={bad!r}; expected a positive number of bytes"):
            crop.run_crop(plan, str(tmp_path / "o"), bad, progress=False)


def test_rewrite_config_schedule_fields():
    base = json.load(open(os.path.join(ROOT, "configuration", "tiny.json")))
    types = base["text_config"]["layer_types"]  # L L I L I I
    for offset in (0, 1):
        config = json.loads(json.dumps(base))
        config["text_config"]["first_k_dense_replace"] = 1
        config["text_config"]["linear_attn_config"] = {
            "kda_layers": [i + offset for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + offset for i, t in enumerate(types) if t == "indexed_attention"],
        }
        config["quantization_config"] = {"quant_method": "fp8"}
        out, changes = crop.rewrite_config(config, 4, 1)
        text = out["text_config"]
        assert text["linear_attn_config"]["kda_layers"] == [x + offset for x in (0, 1, 3)]
        assert text["linear_attn_config"]["full_attn_layers"] == [x + offset for x in (2,)]
        assert text["first_k_dense_replace"] == 1 and text["num_hidden_layers"] == 4
        assert "quantization_config" not in out and changes["quantization_config"] == ("present", "removed")
        out, _ = crop.rewrite_config(config, 1, 1)
        assert out["text_config"]["first_k_dense_replace"] == 1
    config["text_config"]["linear_attn_config"]["kda_layers"] = [0, 1, 2]
    with pytest.raises(ValueError, match=r"linear_attn_config\.kda_layers=\[0, 1, 2\] matches neither"):
        crop.rewrite_config(config, 4, 1)


def test_rewrite_config_writes_derived_schedules_explicitly():
    """A source config without ``layer_types`` / ``mlp_layer_types`` (derived by the config class from
    ``num_hidden_layers``) gets the source's resolved schedule, cut to N, written out."""
    config = json.load(open(os.path.join(ROOT, "configuration", "tiny.json")))
    config["text_config"].update(num_hidden_layers=8, indexer_types=["full"] * 8)
    del config["text_config"]["layer_types"], config["text_config"]["mlp_layer_types"]
    out, changes = crop.rewrite_config(config, 5, 1)
    text = out["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["indexed_attention", "linear_attention"]
    assert text["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 2
    assert changes["layer_types"][0][7] == "indexed_attention"


def test_shared_indexer_without_full_partner_rejected():
    """A prefix crop always keeps a shared layer's partner (the layer before it); a config whose kept layers hold
    a shared layer without one cannot be fixed by calling it 'full' (no indexer weights), so it is an error."""
    config = json.load(open(os.path.join(ROOT, "configuration", "tiny.json")))
    config["text_config"]["indexer_types"] = ["full", "full", "full", "shared", "full", "shared"]  # layer 3 is KDA
    config["text_config"]["layer_types"][3] = "indexed_attention"
    config["text_config"]["layer_types"][2] = "linear_attention"
    with pytest.raises(ValueError, match=r"indexer_types\[3\]='shared' but layer 2"):
        crop.rewrite_config(config, 4, 1)
    out, _ = crop.rewrite_config(json.load(open(os.path.join(ROOT, "configuration", "tiny.json"))), 6, 1)
    assert out["text_config"]["indexer_types"][-1] == "shared"


# ------------------------------------------------------------------------------------------------ memory

MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    from glm53flash_hf.tools import crop

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024

    warm_src, src, out, layers = sys.argv[1:5]
    # Warm-up crop of the tiny checkpoint: pays the one-time costs (imports, thread pools, first kernels).
    crop.main([warm_src, out + "_warm", "--layers", layers, "--no-progress"])
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM (peak RSS) to the current RSS
        f.write("5")
    base = status("VmRSS:")
    crop.main([src, out, "--layers", layers, "--no-progress"])
    print(json.dumps({"growth": status("VmHWM:") - base, "base": base}))
    """
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory, src):
    """A wider FP8 checkpoint (hidden 256, 32 experts of width 192: partial 128-blocks) in ~1.5 MB shards."""
    root = tmp_path_factory.mktemp("wide")
    config = tiny_config(hidden_size=256, moe_intermediate_size=192, intermediate_size=384, n_routed_experts=32)
    canonical = save_canonical(bf16_model(config), root / "canonical", max_shard_size="1500KB")
    return {"canonical": canonical, "fp8": write_variant(canonical, str(root / "fp8"), fp8=True), "warm": src["fp8"]}


def test_crop_memory_stays_near_one_shard(wide, tmp_path):
    """Peak RSS growth of a crop, measured in a fresh process: VmHWM is reset after a warm-up crop (so one-time
    library costs are excluded) and read after the measured crop. glibc is told to serve blocks over 64 KiB with
    mmap (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the process and RSS tracks live memory rather
    than allocator retention. Expected live data: the touched pages of the open source shard, one output shard
    being filled, safetensors' copy of it while writing, plus one tensor's conversion temporaries; we allow
    ``S_src + 2 S_out + 4 MiB``. Loading the checkpoint whole would need the whole output (several times that)."""
    src_sizes = [os.path.getsize(os.path.join(wide["fp8"], f)) for f in shard_names(wide["fp8"])]
    out = str(tmp_path / "wide_crop")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("cannot reset VmHWM (/proc/self/clear_refs not writable)")
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, wide["warm"], wide["fp8"], out, "5"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    growth = json.loads(run.stdout.strip().splitlines()[-1])["growth"]
    out_sizes = [os.path.getsize(os.path.join(out, f)) for f in shard_names(out)]
    bound = max(src_sizes) + 2 * max(out_sizes) + 4 * 2**20
    total_out = sum(out_sizes)
    print(
        f"crop peak RSS growth {growth / 2**20:.1f} MiB; largest source shard {max(src_sizes) / 2**20:.2f} MiB "
        f"({len(src_sizes)} shards, {sum(src_sizes) / 2**20:.1f} MiB); largest output shard "
        f"{max(out_sizes) / 2**20:.2f} MiB ({len(out_sizes)} shards, {total_out / 2**20:.1f} MiB); "
        f"bound {bound / 2**20:.1f} MiB"
    )
    assert total_out > 3 * bound  # the bound is discriminating: holding the output would break it
    assert growth <= bound


def test_wide_fp8_crop_partial_blocks_exact(wide, tmp_path):
    """The wide model's expert weights (192 rows: a full and a partial 128-block) are dequantized block by block:
    compared with an explicit per-block loop, and within the e4m3 bound of the bf16 source. Loading that FP8
    checkpoint directly is refused (transformers would use 96-row blocks); its crop loads."""
    out = str(tmp_path / "c")
    assert crop.main([wide["fp8"], out, "--layers", "2", "--no-progress"]) == 0
    raw = read_all(wide["fp8"])
    source = read_all(wide["canonical"])
    got = read_all(out)
    key = f"{CANONICAL_TEXT}layers.1.mlp.experts.5.down_proj.weight"  # [256, 192]
    other = f"{CANONICAL_TEXT}layers.{H}.mlp.experts.31.gate_proj.weight"  # [192, 256], MTP -> layers.2
    for src_key, out_key in ((key, key), (other, other.replace(f"layers.{H}.", "layers.2."))):
        w, s = raw[src_key].float(), raw[src_key + "_scale_inv"]
        ref = torch.empty_like(w)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
                ref[blk] = w[blk] * s[i, j]
        assert 1 in (w.shape[0] % 128 != 0, w.shape[1] % 128 != 0)
        assert torch.equal(got[out_key], ref.to(torch.bfloat16)), src_key
        err = (got[out_key].float() - source[src_key].float()).abs()
        assert (err <= fp8_error_bound(source[src_key], s) + got[out_key].float().abs() * 2.0**-8).all()
    with pytest.raises(ValueError, match="partial 128-block"):
        Glm53FlashForCausalLM.from_pretrained(wide["fp8"])
    model = Glm53FlashForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits).all()
