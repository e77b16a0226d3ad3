"""Test-side oracle for the kernels: dense masked attention in float64, a small hybrid-pool harness
that places known per-position K/V into full/SWA pools through shuffled slots, and a Gemma 4
attention layer with a recording backend to compare its fused and unfused K/V store paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def attend_ref(
    q: torch.Tensor,  # [M, H, Dk]
    k: torch.Tensor,  # [N, Hkv, Dk]
    v: torch.Tensor,  # [N, Hkv, Dv]
    visible: torch.Tensor,  # [M, N] bool
    scaling: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """Dense softmax attention; a row that sees nothing (and has no sink) is 0. Returns float64."""
    H, Hkv = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    # Invisible keys may hold NaN poison (dummy/out-of-window slots): zero them before any product.
    any_vis = visible.any(0)
    k = torch.where(any_vis[:, None, None], k, 0.0)
    v = torch.where(any_vis[:, None, None], v, 0.0)
    s = torch.einsum("mhd,nhd->hmn", q, k) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(H, s.shape[1], 1)], dim=2)
    mx = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - mx)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / denom.clamp_min(1e-300), 0.0)[..., : k.shape[0]]
    return torch.einsum("hmn,nhd->mhd", p, v)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The one window definition: a query at p sees keys p-W+1 .. p."""
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis &= q_pos[:, None] - k_pos[None, :] < window
    return vis


@dataclass
class HybridPools:
    """Requests with known K/V per position, stored in a full pool and an SWA pool.

    Full slots and SWA slots are random permutations (non-monotonic, as after allocator wrap-around);
    SWA slots are mapped only for positions >= `swa_from[b]` (older ones were evicted: full_to_swa = 0).
    Dummy slot 0 of both pools holds NaN unless `finite_dummy`, so a stray read poisons the output.
    """

    req_to_token: torch.Tensor  # [R+1, C] int32
    rows: torch.Tensor  # [bs] int64
    full_to_swa: torch.Tensor  # [F+2] int32
    k_full: torch.Tensor
    v_full: torch.Tensor
    k_swa: torch.Tensor
    v_swa: torch.Tensor
    k_true: list[torch.Tensor]  # per request [L_b, Hkv, Dk]
    v_true: list[torch.Tensor]


def make_pools(
    lens: list[int],
    hkv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str,
    swa_from: list[int] | None = None,
    finite_dummy: bool = False,
    max_context: int | None = None,
) -> HybridPools:
    bs = len(lens)
    total = sum(lens)
    F = total + 7
    S = total + 5
    C = max_context or max(max(lens), 1) + 3
    r2t = torch.zeros(bs + 2, C, dtype=torch.int32)
    rows = torch.randperm(bs + 1, generator=gen)[:bs] + 1  # rows in shuffled order
    full_perm = torch.randperm(F, generator=gen)[:total] + 1
    swa_perm = torch.randperm(S, generator=gen)[:total] + 1
    f2s = torch.zeros(F + 2, dtype=torch.int32)
    f2s[-1] = -1
    dummy = 0.0 if finite_dummy else float("nan")
    kf = torch.full((F + 1, hkv, dk), dummy, dtype=dtype)
    vf = torch.full((F + 1, hkv, dv), dummy, dtype=dtype)
    ks = torch.full((S + 1, hkv, dk), dummy, dtype=dtype)
    vs = torch.full((S + 1, hkv, dv), dummy, dtype=dtype)
    if finite_dummy:
        for t in (kf, vf, ks, vs):
            t[0] = torch.randn(t.shape[1:], generator=gen).to(dtype)
    k_true, v_true = [], []
    o = 0
    for b, L in enumerate(lens):
        kt = torch.randn(L, hkv, dk, generator=gen).to(dtype)
        vt = torch.randn(L, hkv, dv, generator=gen).to(dtype)
        fs = full_perm[o : o + L]
        ss = swa_perm[o : o + L]
        o += L
        r2t[rows[b], :L] = fs.int()
        kf[fs], vf[fs] = kt, vt
        lo = 0 if swa_from is None else swa_from[b]
        f2s[fs[lo:]] = ss[lo:].int()
        ks[ss[lo:]], vs[ss[lo:]] = kt[lo:], vt[lo:]
        k_true.append(kt)
        v_true.append(vt)
    to = lambda t: t.to(device)
    return HybridPools(to(r2t), to(rows), to(f2s), to(kf), to(vf), to(ks), to(vs), k_true, v_true)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """fp32: kernels compute in fp32 (ieee dots) vs a float64 oracle. bf16: inputs are bf16 in both,
    the kernel rounds probabilities to bf16 for the P.V dot and the output to bf16."""
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def gemma4_attention(form: str, hq: int, hk: int, d: int, dtype: torch.dtype, device: str, gen: torch.Generator,
                     hidden: int = 32, v_eps: float = 0.05):
    """A Gemma 4 `SelfAttention` (fp32-weight q/k norms, weightless V norm, proportional RoPE, scaling
    1.0) with random weights; `form` is "v_norm" (sliding layers), "k_eq_v" (full layers: V is the
    raw key projection) or "kv_shared" (q only)."""
    from swaserve.layers.attention import SelfAttention
    from swaserve.layers.rotary import rope_from_config

    hf = type("HF", (), {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e6,
                                             "partial_rotary_factor": 0.25}})()
    attn = SelfAttention(layer_id=0, hidden_size=hidden, num_heads=hq, num_kv_heads=hk, head_dim=d,
                         rotary=rope_from_config(hf, d), scaling=1.0, qk_norm={"eps": 1e-6, "fp32_weight": True},
                         v_norm={"eps": v_eps}, k_eq_v=form == "k_eq_v", kv_shared=form == "kv_shared")
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else hidden**-0.5))
    return attn.to(device, dtype)


class RecordingBackend:
    """Stands in for an attention backend: records what a layer hands it (`seen`), stores K/V itself
    like `store_kv` (negative slots skipped) when they are not stored yet, returns zeros."""

    def __init__(self, fused: bool, k_buf: torch.Tensor, v_buf: torch.Tensor, locs: torch.Tensor):
        self.fused_kv_store = fused
        self.k_buf, self.v_buf, self.locs = k_buf, v_buf, locs  # locs: [T] int, the pool's own slots
        self.seen: dict = {}

    def kv_target(self, spec, batch):
        return self.k_buf, self.v_buf, self.locs

    def kv_scales(self, spec):
        return None

    def forward(self, q, k, v, spec, batch, sinks=None, kv_stored=False):
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        self.seen = {"q": q.clone(), "k": copy(k), "v": copy(v), "kv_stored": kv_stored}
        if not kv_stored:
            ok = self.locs >= 0
            rows = self.locs[ok].long()
            self.k_buf[rows], self.v_buf[rows] = k[ok].to(self.k_buf.dtype), v[ok].to(self.v_buf.dtype)
        return torch.zeros(q.shape[0], spec.num_heads, spec.v_head_dim, dtype=q.dtype, device=q.device)


def run_both_paths(attn, hidden: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
                   make_pool) -> dict[bool, tuple[dict, torch.Tensor, torch.Tensor]]:
    """The layer on the same input with the unfused (False) and fused (True) K/V store: per path what
    the backend saw and the pools after, each path into fresh pools from `make_pool()`."""
    from types import SimpleNamespace

    res = {}
    for fused in (False, True):
        k_buf, v_buf = make_pool()
        backend = RecordingBackend(fused, k_buf, v_buf, locs)
        attn(hidden, SimpleNamespace(attn_backend=backend, positions=positions, scratch={}))
        res[fused] = (backend.seen, k_buf, v_buf)
    return res
