"""MiMo-V2-Flash's MTP layer drafting for its tiny random target (MTP weights written into the target's
safetensors under the released names): every proposal equals a plain-torch reference of the layer fed
the target's final states from HF transformers; greedy tokens identical to plain decoding (batched,
prompts crossing the window, prefill chunked); pools (target and MTP) empty at the end; a checkpoint
without MTP layers, or a target that has none, is refused with a clear error. The same with a block-FP8
target whose MTP layers are stored FP8 in part (`FP8_STORED`), and with dummy FP8 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from families import fp8_config, make_hf_model, mimo_v2_flash
from safetensors.torch import load_file, save_file
from scheduled import greedy_tokens, spy_with_truth

from swaserve.engine import Engine
from swaserve.layers import fp8

# Out-of-window SWA slots are freed 4 at a time (the MTP layer's cache follows the target's chunk).
OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 160, "kv_cache_bytes": 4 << 20,
           "swa_evict_chunk": 4}
# An FP8 checkpoint's MTP tensors stored e4m3 + weight_scale_inv (the rest as they are): eh_proj (which
# the head keeps unquantised: dequantised at load), q/v (k stays fp32: the q/k/v GEMM is FP8 all the same,
# so k is quantised at load) and the MLP; o_proj stays fp32, and so does its GEMM.
FP8_STORED = ("eh_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight")
QUANTIZED_AT_LOAD = ("self_attn.k_proj.weight",)


def add_mtp_weights(target_dir, cfg, layers: int = 2, seed: int = 1, fp8_layout: bool = False
                    ) -> list[dict[str, torch.Tensor]]:
    """Random `model.mtp.layers.{i}.*` tensors (sliding-layer attention shape, dense MLP) appended to
    the target's model.safetensors; each layer's weights by short name, as the head holds them
    (`fp8_layout`: `FP8_STORED` saved in block FP8, those and `QUANTIZED_AT_LOAD` returned as their
    dequantised 128 x 128 blocks)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.15):
        return scale * torch.randn(*shape, generator=g)

    H, heads, kv, d, dv, inter = cfg.hidden_size, cfg.num_attention_heads, 2 * cfg.num_key_value_heads, \
        cfg.head_dim, cfg.v_head_dim, cfg.intermediate_size
    path = target_dir / "model.safetensors"
    tensors = load_file(str(path))
    out = []
    for i in range(layers):
        w = {"enorm.weight": 1 + rnd(H), "hnorm.weight": 1 + rnd(H), "eh_proj.weight": rnd(H, 2 * H),
             "input_layernorm.weight": 1 + rnd(H), "self_attn.q_proj.weight": rnd(heads * d, H),
             "self_attn.k_proj.weight": rnd(kv * d, H), "self_attn.v_proj.weight": rnd(kv * dv, H),
             "self_attn.o_proj.weight": rnd(H, heads * dv), "self_attn.attention_sink_bias": rnd(heads, scale=0.5),
             "pre_mlp_layernorm.weight": 1 + rnd(H), "mlp.gate_proj.weight": rnd(inter, H),
             "mlp.up_proj.weight": rnd(inter, H), "mlp.down_proj.weight": rnd(H, inter),
             "final_layernorm.weight": 1 + rnd(H)}
        tensors.update({f"model.mtp.layers.{i}.{k}": v for k, v in w.items()})
        for name in (FP8_STORED + QUANTIZED_AT_LOAD) if fp8_layout else ():
            q, scale = fp8.quantize(w[name])
            w[name] = fp8.dequantize(q, scale, torch.float32)
            if name in FP8_STORED:
                tensors[f"model.mtp.layers.{i}.{name}"] = q
                tensors[f"model.mtp.layers.{i}.{name.replace('.weight', '.weight_scale_inv')}"] = scale
        out.append(w)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return out


# -- a plain-torch reference of the MTP layer ---------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, rot: int, theta: float):  # x [n, heads, d]: rotate-half on the first `rot` dims only
    f = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
    r, rest = x[..., :rot], x[..., rot:]
    return torch.cat([r * cos + torch.cat([-r[..., rot // 2:], r[..., : rot // 2]], -1) * sin, rest], -1)


def reference_drafts(cfg, w, embed, head, states, next_ids, base: int, k: int) -> list[int]:
    """Entries at positions base.. from (states[j], embed[next_ids[j]]); then k - 1 chained steps on the
    layer's own (final-normed) output. Sliding window W with learned sinks, V scaled, partial rope."""
    eps, W = cfg.rms_norm_eps, cfg.sliding_window
    heads, kv, d, dv = cfg.num_attention_heads, 2 * cfg.num_key_value_heads, cfg.head_dim, cfg.v_head_dim
    rope = cfg.rope_parameters["sliding_attention"]
    rot = int(d * rope["partial_rotary_factor"])
    keys, vals, kpos = [], [], []

    def layer(e, g, pos):  # e, g [n, H] -> final-normed out [n, H]; K/V appended
        h = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(g, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
        x = _rms(h, w["input_layernorm.weight"], eps)
        q = _rope((x @ w["self_attn.q_proj.weight"].T).view(len(x), heads, d), pos, rot, rope["rope_theta"])
        keys.append(_rope((x @ w["self_attn.k_proj.weight"].T).view(len(x), kv, d), pos, rot, rope["rope_theta"]))
        vals.append((x @ w["self_attn.v_proj.weight"].T).view(len(x), kv, dv) * cfg.attention_value_scale)
        kpos.append(pos)
        K = torch.cat(keys).repeat_interleave(heads // kv, 1)
        V = torch.cat(vals).repeat_interleave(heads // kv, 1)
        P = torch.cat(kpos)
        s = torch.einsum("qhd,khd->hqk", q, K) * d**-0.5
        seen = (P[None, :] <= pos[:, None]) & (P[None, :] > pos[:, None] - W)  # W keys including itself
        s = s.masked_fill(~seen, float("-inf"))
        sink = w["self_attn.attention_sink_bias"][:, None, None].expand(heads, len(x), 1)
        p = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        o = torch.einsum("hqk,khd->qhd", p, V).reshape(len(x), heads * dv) @ w["self_attn.o_proj.weight"].T
        h = h + o
        m = _rms(h, w["pre_mlp_layernorm.weight"], eps)
        h = h + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        return _rms(h, w["final_layernorm.weight"], eps)

    def token(out):
        return int((out @ head.T).argmax())

    n = len(next_ids)
    out = layer(embed[next_ids], states, torch.arange(base, base + n))[-1:]
    drafts = [token(out)]
    for s in range(1, k):
        out = layer(embed[drafts[-1:]], out, torch.tensor([base + n - 1 + s]))
        drafts.append(token(out))
    return drafts


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(1, vocab, (7,), generator=g).tolist()
    return [motif * 5, torch.randint(1, vocab, (30,), generator=g).tolist(), motif[:3] * 4]


def test_mimo_mtp_drafts_match_reference_and_are_lossless(tmp_path):
    agree, total = mtp_run(tmp_path, "cpu")
    assert agree == total, f"{agree}/{total} proposals equal the reference"


def test_fp8_mimo_mtp_drafts_match_reference_and_are_lossless(tmp_path):
    agree, total = mtp_run(tmp_path, "cpu", family="mimo_v2_flash_fp8")
    assert agree == total, f"{agree}/{total} proposals equal the reference"


def mtp_run(tmp_path, device: str, tp: int = 1, family: str = "mimo_v2_flash", **engine_options
            ) -> tuple[int, int]:
    """Plain vs MTP greedy on `device` (fp32), two rounds (the second hits the prefix cache): lossless,
    every pool empty after, SWA slots of the layer evicted; (proposals equal to the reference, all).
    `tp`: both engines' tensor-parallel size; `family` `mimo_v2_flash_fp8`: a block-FP8 target with its
    MTP layers in `FP8_STORED` form, the reference run on the head's dequantised weights."""
    target_dir = tmp_path / "target"
    hf = make_hf_model(family, target_dir)
    cfg = hf.config
    fp8_layout = family.endswith("_fp8")
    layers = add_mtp_weights(target_dir, cfg, fp8_layout=fp8_layout)
    prompts = prompts_for(cfg.vocab_size)
    assert max(map(len, prompts)) > 3 * cfg.sliding_window
    options = {**OPTIONS, "tensor_parallel_size": tp, **engine_options}
    with Engine(str(target_dir), device=device, dtype="float32", **options) as plain_engine:
        plain = greedy_tokens(plain_engine, prompts, 20, plain_engine.check_integrity)

    engine = Engine(str(target_dir), device=device, dtype="float32", **options, speculative_method="mtp",
                    speculative_num_tokens=3)
    try:
        if fp8_layout:
            check_fp8_head(engine.scheduler.speculation.drafter)
        return _mtp_checks(engine, hf, layers, prompts, plain, device)
    finally:
        engine.close()


def check_fp8_head(drafter) -> None:
    """The head's projections are FP8 as `FP8_STORED` stores them, whole (rank 0's head is unsharded)."""
    head = getattr(drafter, "inner", drafter).head
    attn, mlp = head.layer.self_attn, head.layer.mlp
    assert attn.qkv_proj.weight.dtype == fp8.FP8 and mlp.gate_up_proj.weight.dtype == fp8.FP8
    assert mlp.down_proj.weight.dtype == fp8.FP8 and attn.o_proj.fp8 is None
    assert head.eh_proj.weight.dtype == attn.o_proj.weight.dtype == torch.float32
    cfg = head.hf_config
    kv = 2 * cfg.num_key_value_heads  # the sliding layers' K/V heads
    assert attn.qkv_proj.weight.shape[0] == cfg.num_attention_heads * cfg.head_dim + kv * (cfg.head_dim + cfg.v_head_dim)


def _mtp_checks(engine, hf, layers, prompts, plain, device) -> tuple[int, int]:
    cfg = hf.config
    drafter = engine.scheduler.speculation.drafter
    assert type(getattr(drafter, "inner", drafter)).__name__ == "MiMoMTPDrafter"  # (rank 0's alone under TP)
    if device == "cuda":  # the layer's chained decode steps and catch-up extends replay CUDA graphs
        assert drafter.rt.runner.graph_runner is not None and drafter.rt.runner.verify_graphs is not None
    assert drafter.rt.evictor is not None, "the MTP layer slides: its runtime frees out-of-window slots"
    records = spy_with_truth(drafter, plain)

    alloc = drafter.rt.allocator
    evicted = []

    def check():
        engine.check_integrity()
        drafter.cache.check_integrity()
        evicted.append(alloc.full.used() - alloc.swa.used())  # SWA slots freed, full ones kept

    for _ in range(2):
        assert greedy_tokens(engine, prompts, 20, check) == plain
    assert not drafter.seqs and not drafter.cache.rows, "the drafter forgets finished sequences"
    stats = engine.memory_stats()
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
    drafter.cache.check_integrity()  # no rows left: the MTP layer's pools own no slot
    assert alloc.full.used() == alloc.swa.used() == 0
    assert max(evicted) > 0, "the MTP layer's out-of-window SWA slots were freed"
    c = engine.counters()
    assert c["spec_draft_tokens_total"] == sum(len(d) for _, _, d in records) > 60
    assert c["spec_accepted_tokens_total"] > 60
    print(f"{len(records)} proposals, {sum(b > 0 for _, b, _ in records)} after a prefix-cache hit, "
          f"up to {max(evicted)} SWA slots of the MTP layer evicted; {c['spec_draft_tokens_total']} drafted, "
          f"{c['spec_accepted_tokens_total']} accepted")

    embed = hf.model.embed_tokens.weight.detach()
    head = hf.lm_head.weight.detach()
    agree = 0
    with torch.no_grad():
        for ids, base, drafts in records:
            states = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0][base:]
            ref = reference_drafts(cfg, layers[0], embed, head, states, ids[base + 1:], base, len(drafts))
            agree += ref == drafts
    # The reference with layer 1's weights disagrees somewhere: the drafter reads layer 0 only.
    ids, base, drafts = max(records, key=lambda r: len(r[0]))
    with torch.no_grad():
        states = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0][base:]
    alt = [reference_drafts(cfg, layers[1], embed, head, states[: j + 1], ids[base + 1 : base + j + 2], base, 3)
           for j in range(len(states))]
    own = [reference_drafts(cfg, layers[0], embed, head, states[: j + 1], ids[base + 1 : base + j + 2], base, 3)
           for j in range(len(states))]
    assert alt != own
    return agree, len(records)


def test_dummy_fp8_mtp_draws_fp8_and_is_lossless(tmp_path):
    """`load_format="dummy"` with a block-FP8 config: the head's projections FP8 as the config's ignore list
    says for the MTP layer's own names (its `model.layers.*` glob keeps the target's o_proj unquantised,
    not the head's), drawn and quantised as the target's are; greedy tokens as plain decoding's."""
    cfg = mimo_v2_flash()
    cfg.quantization_config = fp8_config(["model.layers.*.self_attn.o_proj"])
    cfg.num_nextn_predict_layers = 1
    cfg.architectures = ["MiMoV2FlashForCausalLM"]
    cfg.save_pretrained(tmp_path)
    prompts = prompts_for(cfg.vocab_size)
    options = {"device": "cpu", "dtype": "float32", "load_format": "dummy", **OPTIONS}
    with Engine(str(tmp_path), **options) as plain_engine:
        assert plain_engine.runner.model.model.layers[1].self_attn.o_proj.fp8 is None
        plain = greedy_tokens(plain_engine, prompts, 12)
    with Engine(str(tmp_path), **options, speculative_method="mtp", speculative_num_tokens=3) as engine:
        head = engine.scheduler.speculation.drafter.head
        params = dict(head.named_parameters())
        quantized = sorted(n for n, p in params.items() if p.dtype == fp8.FP8)
        assert quantized == [f"layer.{m}.weight" for m in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj",
                                                             "self_attn.qkv_proj")]
        for n in quantized:  # N(0, 0.02) drawn, then 128 x 128 blocks: scales about amax / 448
            scale = params[n.replace(".weight", ".weight_scale_inv")]
            assert scale.dtype == torch.float32 and ((scale > 1e-5) & (scale < 1e-3)).all(), n
        assert head.eh_proj.weight.dtype == torch.float32
        assert greedy_tokens(engine, prompts, 12, engine.check_integrity) == plain
        assert engine.counters()["spec_draft_tokens_total"] > 0


def test_fp8_mtp_loading_errors_are_clear(tmp_path):
    """The head loads an FP8 checkpoint's MTP layer in bf16 (e4m3 weights and float32 scales kept); a
    tensor that is unknown, misshapen or missing its FP8 partner is a ValueError naming it."""
    from transformers import AutoConfig

    from swaserve.models.mimo_v2_mtp import MTP_LAYER, MiMoMTPHead, head_config
    from swaserve.speculative.mimo_mtp import mtp_weights

    make_hf_model("mimo_v2_flash_fp8", tmp_path)
    add_mtp_weights(tmp_path, AutoConfig.from_pretrained(tmp_path), layers=1, fp8_layout=True)
    thf = AutoConfig.from_pretrained(tmp_path)
    weights = dict(mtp_weights(tmp_path))

    def load(changes: dict, dtype=torch.float32):
        w = {k: v for k, v in {**weights, **changes}.items() if v is not None}
        stored = {MTP_LAYER.match(n).group(2): t.dtype for n, t in w.items()}
        with torch.device("meta"):
            head = MiMoMTPHead(head_config(thf, stored))
        head = head.to(dtype=dtype).to_empty(device="cpu")
        head.load_weights(w.items())
        return head

    head = load({}, torch.bfloat16)
    assert head.layer.mlp.down_proj.weight.dtype == fp8.FP8 and head.eh_proj.weight.dtype == torch.bfloat16
    assert head.layer.mlp.down_proj.weight_scale_inv.dtype == torch.float32
    p = "model.mtp.layers.0."
    scale = weights[p + "eh_proj.weight_scale_inv"]
    cases = [
        ({p + "eh_proj.weight_scale_inv": None}, "eh_proj.weight' is stored as FP8 without its weight_scale_inv"),
        ({p + "eh_proj.weight_scale_inv": torch.cat([scale, scale])}, "eh_proj.weight': FP8 scales .* do not match"),
        ({p + "mlp.foo.weight_scale_inv": scale}, "an FP8 scale without its weight"),
        ({p + "self_attn.foo.weight": scale}, "unknown weight 'model.mtp.layers.0.self_attn.foo.weight'"),
        ({p + "self_attn.o_proj.weight_scale_inv": scale}, "o_proj.weight' is stored as torch.float32 but has a"),
        ({p + "self_attn.q_proj.weight": weights[p + "self_attn.v_proj.weight"]}, "expected shape"),
        ({p + "self_attn.o_proj.weight": None}, "missing 1 weights, e.g. .*o_proj"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            load(change)


def test_mtp_without_mtp_layers_is_refused(tmp_path):
    target_dir = tmp_path / "target"
    make_hf_model("mimo_v2_flash", target_dir)  # no model.mtp.* tensors
    with pytest.raises(ValueError, match="has no MTP layers"):
        Engine(str(target_dir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp")
    llama_dir = tmp_path / "llama"
    make_hf_model("llama", llama_dir)
    with pytest.raises(ValueError, match="needs a target whose checkpoint has MTP layers"):
        Engine(str(llama_dir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp")
