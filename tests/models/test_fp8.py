"""Block-FP8 checkpoints on CPU (weights dequantised at use): a tiny MiMo-V2-Flash saved in the released
layout (e4m3 + 128 x 128 `weight_scale_inv`, experts one by one, attention o_proj kept bf16 through
`ignored_layers`) and a wide Gemma 3 (partial blocks, merged parts that are not whole blocks) give the
greedy tokens of HF transformers running the same weights dequantised (fp32); online FP8
(`quantization="fp8"`) holds exactly what the offline checkpoint holds; dummy loads draw FP8 weights with
plausible scales; dtypes survive `.to(bf16)`; unsupported variants and mismatches are clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from families import gemma3_wide, gemma4_moe, hf_greedy, make_hf_model, mimo_v2_flash
from harness import Harness

from swaserve.layers import fp8
from swaserve.layers.batch_invariant import make_batch_invariant
from swaserve.layers.linear import MergedLinear, OutLinear
from swaserve.layers.moe import StackedExperts
from swaserve.loader import load_model
from swaserve.loader.dummy import init_dummy_weights
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.loader.safetensors import iter_safetensors
from swaserve.model_config import ModelConfig
from swaserve.models.registry import build_model

STEPS = 6
PROMPT_LENS = (19, 9)  # windows of 8: both cross them
CPU = torch.device("cpu")


def _greedy_vs_hf(path, hf):
    config, model = load_model_from_dir(path, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    h = Harness(config, model, hybrid=True, full_tokens=sum(PROMPT_LENS) + 2 * STEPS + 8,
                swa_tokens=sum(PROMPT_LENS) + len(PROMPT_LENS))
    logits, tokens = h.generate(prompts, STEPS)
    h.assert_empty()
    for i, p in enumerate(prompts):
        ref_logits, ref_tokens = hf_greedy(hf, p, STEPS)
        assert tokens[i] == ref_tokens, f"prompt {i}: tokens differ from HF on the dequantised weights"
        assert (logits[i] - ref_logits).abs().max() < 1e-4
    assert len({t for toks in tokens for t in toks}) > 3  # not degenerate
    return model


def test_mimo_v2_flash_released_layout_matches_hf(tmp_path):
    hf = make_hf_model("mimo_v2_flash_fp8", tmp_path, seed=3)
    names = dict(iter_safetensors(tmp_path))
    assert names["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == fp8.FP8
    assert names["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].dtype == torch.float32
    assert names["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32  # ignored: as stored
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" not in names
    model = _greedy_vs_hf(tmp_path, hf)
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == fp8.FP8 and layer.self_attn.o_proj.fp8 is None
    assert layer.mlp.experts.gate_up_proj.dtype == fp8.FP8 and layer.mlp.gate.weight.dtype == torch.float32


def test_gemma3_partial_blocks_match_hf(tmp_path):
    hf = make_hf_model("gemma3_fp8", tmp_path, seed=4)
    model = _greedy_vs_hf(tmp_path, hf)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.fp8.scale_rows == 1  # q 160 / k 80 / v 80: parts not whole 128-row blocks
    assert tuple(attn.o_proj.weight_scale_inv.shape) == (2, 2)  # 160 x 160: a partial block each way
    assert tuple(mlp.down_proj.weight_scale_inv.shape) == (2, 3)  # inputs 272 = 128 + 128 + 16


def test_online_fp8_holds_what_the_offline_checkpoint_holds(tmp_path):
    make_hf_model("gemma3_wide", tmp_path / "bf16", seed=4)
    make_hf_model("gemma3_fp8", tmp_path / "fp8", seed=4)  # same weights, quantised at save
    online = load_model(str(tmp_path / "bf16"), CPU, torch.float32, quantization="fp8").model
    _, offline = load_model_from_dir(tmp_path / "fp8", device="cpu", dtype=torch.float32)
    a, b = dict(online.named_parameters()), dict(offline.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert p.dtype == b[name].dtype and torch.equal(p.float(), b[name].float()), name
    assert online.model.embed_tokens.weight.dtype == torch.float32
    assert sum(p.dtype == fp8.FP8 for p in a.values()) == 3 * 4  # qkv, o, gate_up, down of 3 layers
    with pytest.raises(ValueError, match="already is .quant_method 'fp8'"):
        load_model(str(tmp_path / "fp8"), CPU, torch.float32, quantization="fp8")


@pytest.mark.parametrize("make_config", [gemma3_wide, mimo_v2_flash], ids=["gemma3", "mimo"])
def test_dummy_load_draws_fp8(tmp_path, make_config):
    cfg = make_config()
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                               "ignored_layers": ["model.layers.*.self_attn.o_proj"]}
    cfg.architectures = [type(cfg).__name__.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    cfg.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), CPU, torch.bfloat16, load_format="dummy")
    params = dict(loaded.model.named_parameters())
    scales = [p for n, p in params.items() if n.endswith("_scale_inv")]
    assert scales and all(s.dtype == torch.float32 and (s > 1e-5).all() and (s < 1e-3).all() for s in scales)
    assert all(params[n].dtype == torch.bfloat16 for n in params if n.endswith("o_proj.weight"))
    for n, p in params.items():  # N(0, 0.02) through 128 x 128 blocks: RMS about 0.02
        if p.dtype == fp8.FP8:
            module = loaded.model.get_submodule(n.rpartition(".")[0])
            scale = params[n + "_scale_inv"] if n.endswith("_proj") else params[n.rpartition(".")[0] + ".weight_scale_inv"]
            rows = fp8.BLOCK if n.endswith("experts.down_proj") else module.fp8.scale_rows
            w = fp8.dequantize(p, scale, torch.float32, rows)
            assert 0.015 < w.pow(2).mean().sqrt() < 0.025, n
    h = Harness(loaded.config, loaded.model, hybrid=True, full_tokens=96, swa_tokens=64, dtype=torch.bfloat16)
    _, tokens = h.generate([list(range(5, 25)), list(range(30, 41))], 4)
    assert all(len(t) == 4 for t in tokens)


def test_dummy_fp8_weights_are_the_same_whatever_the_rank_count():
    """MiMo-V2-Flash's full layers at TP=4: a rank's K rows (1 head of 192) cut a 128-row block, so the
    rank keeps a scale per row; the dummy draw still holds TP=1's weights (quantised whole, then cut)."""
    from transformers import MiMoV2FlashConfig

    from swaserve.distributed.state import TPGroup, set_tp_group
    from swaserve.loader.dummy import init_dummy_weights, whole_parameter_shapes
    from swaserve.models.registry import get_model_class

    hf = MiMoV2FlashConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=512,
                           vocab_size=512,
                           sliding_window=129, layer_types=["full_attention", "sliding_attention"],
                           mlp_layer_types=["dense", "sparse"])
    hf.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                              "ignored_layers": ["model.layers.*.self_attn.o_proj"]}
    cls = get_model_class("MiMoV2FlashForCausalLM", "mimo_v2_flash")
    whole = whole_parameter_shapes(ModelConfig.from_hf(hf))

    def qkv(rank: int, size: int):
        set_tp_group(TPGroup(rank, size))
        try:
            model = cls(hf)
            init_dummy_weights(model, whole_shapes=whole if size > 1 else None)
        finally:
            set_tp_group(TPGroup())
        m = model.model.layers[0].self_attn.qkv_proj
        return m, fp8.dequantize(m.weight, m.weight_scale_inv, torch.float32, m.fp8.scale_rows)

    one, ref = qkv(0, 1)
    qo, ko, _ = one.out_sizes
    for rank in range(4):
        m, w = qkv(rank, 4)
        q, k, v = m.out_sizes
        assert m.fp8.scale_rows == 1 and k == 192
        want = torch.cat([ref[rank * q : (rank + 1) * q], ref[qo + rank * k : qo + (rank + 1) * k],
                          ref[qo + ko + rank * v : qo + ko + (rank + 1) * v]])
        assert torch.equal(w, want), f"rank {rank}"


@pytest.mark.parametrize("make_config", [gemma3_wide, gemma4_moe], ids=["gemma3", "gemma4-moe"])
def test_online_fp8_dummy_weights_are_the_bf16_dummy_weights_quantised(make_config):
    """Dummy weights are drawn whatever the weights' dtype as a bf16 checkpoint holds them (experts one
    by one): the model built with online FP8 holds the bf16 model's weights quantised, code for code, so
    benchmarks/fp8_weights.py compares the same model in two formats."""

    def build(quantized: bool) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
        cfg = make_config()
        if quantized:
            fp8.with_online_fp8(cfg)
        model = build_model(ModelConfig.from_hf(cfg), torch.bfloat16, CPU)
        init_dummy_weights(model)
        return dict(model.named_parameters()), model

    dense, _ = build(False)
    params, model = build(True)
    checked = 0
    for n, p in params.items():
        if n.endswith("_scale_inv"):
            continue
        if p.dtype != fp8.FP8:
            assert torch.equal(p, dense[n]), n
            continue
        owner = model.get_submodule(n.rpartition(".")[0])
        stacked = isinstance(owner, StackedExperts)
        scale = params[n + "_scale_inv"] if stacked else params[n.rpartition(".")[0] + ".weight_scale_inv"]
        rows = fp8.BLOCK if n.endswith("experts.down_proj") else owner.fp8.scale_rows
        s = scale.repeat_interleave(rows, dim=-2).narrow(-2, 0, p.shape[-2])
        s = s.repeat_interleave(fp8.BLOCK, dim=-1).narrow(-1, 0, p.shape[-1])
        codes = (dense[n].float() / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        assert torch.equal(codes.view(torch.uint8), p.view(torch.uint8)), n
        checked += 1
    assert checked >= 8


def test_dtypes_survive_a_bf16_model_and_bytes_are_real():
    cfg = mimo_v2_flash()
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    model = build_model(ModelConfig.from_hf(cfg), torch.bfloat16, "cpu")
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == fp8.FP8 and experts.gate_up_proj.element_size() == 1
    assert experts.down_proj_scale_inv.dtype == torch.float32
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == fp8.FP8  # nothing ignored here
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_deterministic_mode_rows_do_not_depend_on_the_batch():
    m = MergedLinear(300, [128, 72], bias=True)
    from swaserve.layers.fp8_linear import convert_merged

    convert_merged(m, online=True)
    g = torch.Generator().manual_seed(0)
    for i, rows in enumerate(m.out_sizes):
        m.load_shard(i, "weight", 0.05 * torch.randn(rows, 300, generator=g))
    m.bias.data.normal_(generator=g)
    make_batch_invariant(m)
    x = torch.randn(40, 300, generator=g)
    full = m(x)
    for part in (slice(0, 1), slice(5, 22)):
        assert torch.equal(m(x[part]), full[part])


@pytest.mark.parametrize(("qc", "match"), [
    ({"weight_block_size": None}, "per-tensor or per-channel scales"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"fmt": "e5m2"}, "fmt .e5m2. are not supported"),
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported"),
    ({"quant_method": "mxfp4"}, "'mxfp4' is not supported for MiMoV2FlashForCausalLM"),
], ids=["per_tensor", "block64", "static", "e5m2", "ue8m0", "mxfp4"])
def test_unsupported_variants_are_clear_errors(qc, match):
    cfg = mimo_v2_flash()
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                               **qc}
    with pytest.raises(ValueError, match=match):
        build_model(ModelConfig.from_hf(cfg), torch.float32, "cpu")


@pytest.fixture(scope="module")
def mimo_fp8_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_fp8")
    make_hf_model("mimo_v2_flash_fp8", path, seed=3)
    return path


def _load(path, weights, config_edit=None):
    cfg = json.loads((path / "config.json").read_text())
    if config_edit:
        config_edit(cfg["quantization_config"])
    from swaserve.loader.hf_dir import load_hf_config

    (path / "edited").mkdir(exist_ok=True)
    (path / "edited" / "config.json").write_text(json.dumps(cfg))
    model = build_model(ModelConfig.from_hf(load_hf_config(path / "edited")), torch.float32, "cpu")
    model.load_weights(weights)


def test_checkpoint_mismatches_are_clear_errors(mimo_fp8_dir):
    weights = list(iter_safetensors(mimo_fp8_dir))
    no_scale = [(n, t) for n, t in weights if n != "model.layers.0.self_attn.k_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"missing 1 weights.*qkv_proj.weight_scale_inv\[shard 1\]"):
        _load(mimo_fp8_dir, no_scale)
    no_expert_scale = [(n, t) for n, t in weights if n != "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"missing 1 expert weights.*\(5, 'down_proj.weight_scale_inv'\)"):
        _load(mimo_fp8_dir, no_expert_scale)
    dense_q = [(n, t.float() if n == "model.layers.0.self_attn.q_proj.weight" else t) for n, t in weights]
    with pytest.raises(ValueError, match="stored as torch.float32 but the checkpoint's FP8 quantization_config"):
        _load(mimo_fp8_dir, dense_q)
    with pytest.raises(ValueError, match="is stored as FP8 but swaserve keeps .*o_proj.weight in torch.float32"):
        _load(mimo_fp8_dir, [*weights, *[(n.replace("q_proj", "o_proj"), t) for n, t in weights
                                         if n == "model.layers.0.self_attn.q_proj.weight"]])
    with pytest.raises(ValueError, match="keep some of .* unquantised but not all"):
        _load(mimo_fp8_dir, weights, lambda qc: qc["ignored_layers"].append("model.layers.0.self_attn.k_proj"))


def test_tensor_parallel_cut_inside_a_block_is_refused():
    from swaserve.distributed.state import TPGroup, set_tp_group
    from swaserve.layers.fp8_linear import convert_experts, convert_out

    set_tp_group(TPGroup(1, 2))
    try:
        out = OutLinear(80, 64, bias=False, shard=(80, 160))  # rank 1's inputs start at 80
        with pytest.raises(ValueError, match="start at 80, inside a 128-input FP8 scale block"):
            convert_out(out, online=False, name="o_proj")
        convert_out(out, online=True, name="o_proj")  # online: each rank quantises its own part
        experts = StackedExperts(4, 64, 320, "silu")  # 160 a rank
        with pytest.raises(ValueError, match="expert inputs start at 160"):
            convert_experts(experts, online=False, name="experts")
    finally:
        set_tp_group(TPGroup())


def test_online_fp8_gemma4_moe_matches_hf_on_the_same_blocks(tmp_path):
    """Gemma 4's stacked experts (the 26B-A4B form) quantised online: HF run on the weights each
    checkpoint tensor becomes after 128 x 128 quantisation (stacked experts per expert, blocks over
    gate and up rows together, as `StackedExperts` quantises them) gives the same greedy tokens."""
    from families import _FP8_LINEARS

    hf = make_hf_model("gemma4_moe", tmp_path, seed=2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if (name.endswith(_FP8_LINEARS) and ".layers." in name) or name.endswith(
                    ("experts.gate_up_proj", "experts.down_proj")):
                q, s = fp8.quantize(p.data)
                p.copy_(fp8.dequantize(q, s, p.dtype))
    loaded = load_model(str(tmp_path), CPU, torch.float32, quantization="fp8")
    experts = [m for m in loaded.model.modules() if isinstance(m, StackedExperts)]
    assert experts and all(m.gate_up_proj.dtype == fp8.FP8 for m in experts)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, hf.config.vocab_size, (17,), generator=g).tolist()
    h = Harness(loaded.config, loaded.model, hybrid=True, full_tokens=40, swa_tokens=30)
    logits, tokens = h.generate([prompt], STEPS)
    ref_logits, ref_tokens = hf_greedy(hf, prompt, STEPS)
    assert tokens[0] == ref_tokens and (logits[0] - ref_logits).abs().max() < 1e-4
