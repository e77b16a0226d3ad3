"""GGUF loader: header parsing vs the `gguf` package, dequantisation vs `gguf.quants`, and the
name-mapped config + state dict vs transformers' own GGUF import (embedded Gemma 3 270M and tiny
synthetic llama / qwen3 / gemma2 / gemma3 files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from swaserve.loader import gguf as G

CONFIG_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "sliding_window",
    "layer_types", "query_pre_attn_scalar", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "final_logit_softcapping", "attn_logit_softcapping", "rope_parameters",
)  # fmt: skip


@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    from swaserve.loader.default_model import default_model_path

    return default_model_path()


def hf_reference(path: Path, structure: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' GGUF import: the config AutoConfig builds and the tensors from_pretrained loads.

    One `load_gguf_checkpoint` call gives both (AutoConfig.from_pretrained(gguf_file=...) builds its
    config from the same call's dict, `CONFIG_MAPPING[model_type].from_dict`); each call costs
    transformers a >10 s GGUFReader pass on a 262k vocabulary. `structure` is the config used for the
    meta model whose parameter names transformers maps the GGUF names onto.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(structure)
    # from_pretrained(gguf_file=...) calls exactly this for these architectures (it needs accelerate).
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(parsed["config"])
    return config, parsed["tensors"]


def assert_config_matches(ours: Any, ref: Any) -> None:
    for field in CONFIG_FIELDS:
        a, b = getattr(ours, field, None), getattr(ref, field, None)
        assert a == pytest.approx(b, rel=1e-6) if isinstance(b, float) else a == b, (field, a, b)
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)


def assert_tensors_match(path: Path, ref: dict[str, torch.Tensor]) -> None:
    seen = set()
    for name, tensor in G.iter_gguf_tensors(path):
        assert name in ref, name
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name].float()), name
        seen.add(name)
    assert seen == set(ref)


# --- the embedded model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_matches_transformers_import(embedded_gguf: Path) -> None:
    config = G.load_gguf_config(embedded_gguf)
    ref_config, ref_tensors = hf_reference(embedded_gguf, config)
    assert_config_matches(config, ref_config)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.layer_types[5] == "full_attention" and config.layer_types.count("full_attention") == 3
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert_tensors_match(embedded_gguf, ref_tensors)


def test_embedded_quant_types_match_gguf_reference(embedded_gguf: Path) -> None:
    header = G.read_gguf_header(embedded_gguf)
    smallest: dict[Q, G.TensorInfo] = {}
    for info in header.tensors:
        if info.qtype not in smallest or info.nbytes < smallest[info.qtype].nbytes:
            smallest[info.qtype] = info
    assert {Q.Q4_K, Q.Q6_K, Q.Q8_0}.issubset(smallest)  # a Q4_K_M file
    data = np.memmap(embedded_gguf, mode="r", dtype=np.uint8)
    for qtype, info in smallest.items():
        raw = np.array(data[info.offset : info.offset + info.nbytes])
        ours = G.dequantize(torch.from_numpy(raw.copy()), qtype, info.shape)
        rows = raw.reshape(-1, info.nbytes // int(np.prod(info.shape[:-1])))
        ref = gguf.quants.dequantize(rows if qtype not in (Q.F32, Q.F16) else raw, qtype)
        assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref)).reshape(info.shape)), qtype.name


def test_bfloat16_request_is_a_cast(embedded_gguf: Path) -> None:
    name, first = next(G.iter_gguf_tensors(embedded_gguf))
    name16, first16 = next(G.iter_gguf_tensors(embedded_gguf, dtype=torch.bfloat16))
    assert name == name16 and first16.dtype == torch.bfloat16 and torch.equal(first16, first.bfloat16())


# --- dequantisation of every supported type -----------------------------------------------------------

_SCALE_FIELDS = {  # byte offsets of the float16 scales inside one block; the rest may be random
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, *_SCALE_FIELDS], ids=lambda q: q.name)
def test_dequantize_matches_gguf_quants(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = 8, 512
    if qtype in (Q.F32, Q.F16):
        raw = rng.standard_normal((rows, cols)).astype(np.float32 if qtype == Q.F32 else np.float16)
    else:
        raw = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
        for off in _SCALE_FIELDS.get(qtype, ()):
            raw[:, off : off + 2] = (
                (rng.standard_normal((len(raw), 1)) * 0.05).astype(np.float16).view(np.uint8)
            )
        if qtype == Q.BF16:
            raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.BF16)
        raw = raw.reshape(rows, -1)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))
    ours = G.dequantize(torch.from_numpy(raw.view(np.uint8).reshape(-1).copy()), qtype, (rows, cols))
    assert torch.equal(ours, ref)


def test_unsupported_quant_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"IQ2_XXS.*supported: .*Q4_K"):
        G.dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (256,))


# --- tiny synthetic files: every supported architecture against transformers ---------------------------


def write_gguf(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (array, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    _finish(w)
    return path


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_model(path: Path, arch: str, tied: bool = True) -> Path:
    rng = np.random.default_rng(0)
    # transformers reads head_dim from key_length (gemma), rope.dimension_count (llama) or not at all
    # (qwen3: default 128), and takes Gemma's query_pre_attn_scalar from its default (256, = head_dim
    # for all but the 27B models), so each file uses a head_dim on which every reader agrees.
    hd = {"llama": 16, "qwen3": 128}.get(arch, 256)
    hidden, heads, kv_heads, ffn, layers, vocab = 64, 4, 2, 96, 6, 64
    kv: dict[str, Any] = {
        f"{arch}.context_length": 256, f"{arch}.embedding_length": hidden, f"{arch}.block_count": layers,
        f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.attention.key_length": hd, f"{arch}.attention.value_length": hd,
        f"{arch}.rope.dimension_count": hd,
        f"{arch}.rope.freq_base": 500_000.0, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(vocab)], "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }  # fmt: skip
    if arch.startswith("gemma"):
        kv[f"{arch}.attention.sliding_window"] = 16
    if arch == "gemma2":
        kv.update({"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0})
    m = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1
    t: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (m(vocab, hidden), Q.F16),
        "output_norm.weight": (m(hidden) + 1, Q.F32),
    }
    if not tied:
        t["output.weight"] = (m(vocab, hidden), Q.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        t.update({
            p + "attn_norm.weight": (m(hidden) + 1, Q.F32), p + "ffn_norm.weight": (m(hidden) + 1, Q.F32),
            p + "attn_q.weight": (m(heads * hd, hidden), Q.Q8_0),
            p + "attn_k.weight": (m(kv_heads * hd, hidden), Q.Q4_0),
            p + "attn_v.weight": (m(kv_heads * hd, hidden), Q.Q5_0),
            p + "attn_output.weight": (m(hidden, heads * hd), Q.Q8_0),
            p + "ffn_gate.weight": (m(ffn, hidden), Q.Q8_0), p + "ffn_up.weight": (m(ffn, hidden), Q.Q4_1),
            p + "ffn_down.weight": (m(hidden, ffn), Q.Q5_1),
        })  # fmt: skip
        if arch in ("qwen3", "gemma3"):
            t.update(
                {p + "attn_q_norm.weight": (m(hd) + 1, Q.F32), p + "attn_k_norm.weight": (m(hd) + 1, Q.F32)}
            )
        if arch.startswith("gemma"):
            t.update(
                {
                    p + "post_attention_norm.weight": (m(hidden), Q.F32),
                    p + "post_ffw_norm.weight": (m(hidden), Q.F32),
                }
            )
    return write_gguf(path / f"tiny-{arch}.gguf", arch, kv, t)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True), ("gemma2", True), ("gemma3", True)])
def test_tiny_architectures_match_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    path = tiny_model(tmp_path, arch, tied)
    from transformers import AutoConfig

    assert G.gguf_architecture(path) == arch
    ref_config, ref_tensors = hf_reference(
        path, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    )
    auto = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    assert {k: v for k, v in ref_config.to_dict().items() if "name_or_path" not in k} == {
        k: v for k, v in auto.items() if "name_or_path" not in k
    }  # the shortcut hf_reference takes builds AutoConfig's config
    assert_config_matches(G.load_gguf_config(path), ref_config)
    assert_tensors_match(path, ref_tensors)


def test_llama_qk_rows_are_unpermuted(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "llama")
    stored = dict(G.iter_gguf_tensors(path))
    header = G.read_gguf_header(path)
    info = next(t for t in header.tensors if t.name == "blk.0.attn_k.weight")
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8)[info.offset : info.offset + info.nbytes].copy())
    as_stored = G.dequantize(raw, info.qtype, info.shape)  # llama.cpp's interleaved rotary layout
    hf = stored["model.layers.0.self_attn.k_proj.weight"]
    heads, half = 2, 16 // 2
    # llama.cpp's permute (convert_hf_to_gguf.py) applied to our output must give the file's rows back.
    repermuted = hf.reshape(heads, 2, half, -1).transpose(1, 2).reshape(hf.shape)
    assert torch.equal(repermuted, as_stored) and not torch.equal(hf, as_stored)


def test_header_parser_matches_gguf_reader(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "gemma3")
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "gemma3")
    samples = {V.UINT8: 200, V.INT8: -5, V.UINT16: 60000, V.INT16: -300, V.UINT32: 2**31, V.INT32: -(2**30),
               V.FLOAT32: 0.1, V.BOOL: True, V.UINT64: 2**60, V.INT64: -(2**40), V.FLOAT64: -1.25,
               V.STRING: "ü😀"}  # fmt: skip
    for vtype, value in samples.items():
        w.add_key_value(f"s.{vtype.name}", value, vtype)
        w.add_key_value(f"a.{vtype.name}", [value, value], V.ARRAY, vtype)
    w.add_tensor("t", np.arange(4, dtype=np.float32))
    _finish(w)
    for p in (path, tmp_path / "v.gguf"):
        reader = gguf.GGUFReader(p)
        strings = tuple(
            k
            for k, f in reader.fields.items()
            if f.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
        )
        ours = G.read_gguf_header(p, string_arrays=strings)
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = ours.metadata[key]
            expected = field.contents()
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == pytest.approx(expected), (
                key
            )
        assert [(t.name, t.qtype, t.offset, t.nbytes) for t in ours.tensors] == [
            (t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
        ]


# --- errors -----------------------------------------------------------------------------------------


def test_gemma4_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "g4.gguf", "gemma4", {"gemma4.block_count": 1}, {"token_embd.weight": (np.ones(32), Q.F32)}
    )
    with pytest.raises(ValueError, match="Gemma 4 is not supported for GGUF.*HF model directory"):
        G.load_gguf_config(path)


def test_unknown_architecture_names_supported_ones(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", "mamba", {"mamba.block_count": 1}, {"x.weight": (np.ones(32), Q.F32)}
    )
    assert G.gguf_architecture(path) == "mamba"
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba'; supported: gemma3, gemma2"):
        G.load_gguf_config(path)
    with pytest.raises(ValueError, match="supported"):
        G.iter_gguf_tensors(path)


def test_unsupported_tensor_type_in_file(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "qwen3")
    raw = np.random.default_rng(0).integers(0, 256, (64, 84), dtype=np.uint8)  # 64 rows of one Q2_K block
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "qwen3")
    for key, field in gguf.GGUFReader(path).fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(
                key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None
            )
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.Q2_K)
    _finish(w)
    with pytest.raises(
        ValueError, match=r"attn_q.weight: unsupported GGUF quant type Q2_K; supported: F32, F16"
    ):
        G.iter_gguf_tensors(tmp_path / "q2.gguf")  # raised at the call, before any tensor is yielded


def test_missing_or_non_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        G.load_gguf_config(tmp_path / "nope.gguf")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all, really")
    with pytest.raises(ValueError, match="not a GGUF file"):
        G.read_gguf_header(tmp_path / "x.gguf")
