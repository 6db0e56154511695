"""The CPU block kernels: plain-torch attention (``ReferenceKernel``: the oracle, the fallback, and the
kernel for what no fused op has) and torch's fused CPU flash op (``TorchCPUKernel``), with the band mask
both take (``band_mask``). ``BlockKernel`` (``hf_ring.ops.kernels``) is their contract; ``refuses``
says what a kernel cannot run (``get_kernel``'s "auto" asks it). This module imports only torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ReferenceKernel", "TorchCPUKernel", "band_mask"]


def band_mask(
    sq: int,
    sk: int,
    window: tuple[int, int],
    device: torch.device | str = "cpu",
    *,
    q0: int = 0,
    rows: int | None = None,
) -> Tensor:
    """``[Sq, Sk]`` bool, True where key ``j`` is visible to query ``i``: ``-left <= j - i - (Sk - Sq) <= right``
    (``window = (left, right)``, flash-attn's bottom-right alignment). ``q0``/``rows``: only query rows
    ``q0 ... q0 + rows - 1`` of the block (``[rows, Sk]``)."""
    left, right = window
    rows = sq - q0 if rows is None else rows
    d = torch.arange(sk, device=device)[None, :] - torch.arange(q0, q0 + rows, device=device)[:, None] - (sk - sq)
    return (d >= -left) & (d <= right)


class ReferenceKernel:
    """Plain-torch attention in float32 (float64 for float64 inputs): the oracle, the fallback, and the
    kernel for logit soft-capping where no fused kernel has it.

    ``softcap > 0`` caps the scaled scores as Gemma 2 does, ``s = softcap * tanh(scale * q.k / softcap)``,
    before the causal mask and the softmax; the backward applies the chain rule through the cap,
    ``dS_raw = dS * (1 - tanh^2)``, on the recomputed scores. Queries are processed in tiles of
    ``max(1, tile_elems // (B * Hq * Sk))`` rows, so a block holds at most ``tile_elems`` scores at once
    (O(S) memory per row of queries, like the fused kernels, not O(Sq * Sk)). Grouped-query heads are
    batched matmuls over ``[B, Hkv, Hq / Hkv, rows, D]`` views: K/V are never expanded.
    """

    name = "reference"
    heads_major = False
    softcap = True  # takes softcap > 0 (the fused CPU/CUDA torch ops do not)
    window = True  # takes window=(left, right)

    def __init__(self, tile_elems: int = 1 << 22) -> None:
        self.tile_elems = tile_elems

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can; plain torch runs any float dtype and shape)."""
        return ""

    def _tiles(self, q: Tensor, k: Tensor) -> range:
        b, sq, hq, _ = q.shape
        rows = max(1, self.tile_elems // max(1, b * hq * k.shape[1]))
        return range(0, sq, rows)

    @staticmethod
    def _grouped(t: Tensor, hkv: int, ct: torch.dtype) -> Tensor:
        """``[B, S, Hq, D]`` -> ``[B, Hkv, Hq / Hkv, S, D]`` in ``ct`` (query head h = g * rep + r)."""
        b, s, hq, d = t.shape
        return t.to(ct).view(b, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)

    @staticmethod
    def _ungrouped(t: Tensor) -> Tensor:
        """``[B, Hkv, rep, S, ...]`` -> ``[B, S, Hq, ...]``."""
        b, hkv, rep, s = t.shape[:4]
        return t.movedim(3, 1).reshape(b, s, hkv * rep, *t.shape[4:])

    @staticmethod
    def _scores(
        qg: Tensor,
        kt: Tensor,
        causal: bool,
        scale: float,
        softcap: float,
        q0: int,
        sq: int,
        window: tuple[int, int] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Scores ``[B, Hkv, rep, rows, Sk]`` of query rows ``q0 ...`` of a block of ``sq`` queries (``qg``
        grouped, ``kt [B, Hkv, 1, D, Sk]``), masked causally and/or to the band ``window``, and ``tanh`` of
        the capped ones (``None`` without a cap) for the backward's chain rule."""
        s = torch.matmul(qg, kt).mul_(scale)
        t = None
        if softcap:
            t = s.div_(softcap).tanh_()
            s = t * softcap
        if causal:
            rows, sk = s.shape[-2:]
            hide = torch.arange(sk, device=s.device)[None, :] > torch.arange(q0, q0 + rows, device=s.device)[:, None]
            s = s.masked_fill_(hide, float("-inf"))
        if window is not None:
            seen = band_mask(sq, s.shape[-1], window, s.device, q0=q0, rows=s.shape[-2])
            s = s.masked_fill_(~seen, float("-inf"))
        return s, t

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv = k.shape[2]
        kt = k.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        vh = v.to(ct).transpose(1, 2).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
        outs, lses = [], []
        tiles = self._tiles(q, k)
        for q0 in tiles:
            qg = self._grouped(q[:, q0 : q0 + tiles.step], hkv, ct)
            s, _ = self._scores(qg, kt, causal, scale, softcap, q0, q.shape[1], window)
            lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, rep, rows)
            p = s.sub_(lse[..., None]).exp_().nan_to_num_(0.0)  # rows with no key: all zero
            outs.append(self._ungrouped(torch.matmul(p, vh)).to(q.dtype))
            lses.append(self._ungrouped(lse))
            del s, p
        return torch.cat(outs, 1), torch.cat(lses, 1)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
        softcap: float = 0.0,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv = k.shape[2]
        kt = k.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        vt = v.to(ct).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
        dk = torch.zeros(k.shape[0], hkv, k.shape[1], k.shape[3], dtype=ct, device=k.device)  # (B, Hkv, Sk, D)
        dv, dqs = torch.zeros_like(dk), []
        tiles = self._tiles(q, k)
        for q0 in tiles:
            rows = slice(q0, q0 + tiles.step)
            qg = self._grouped(q[:, rows], hkv, ct)
            s, t = self._scores(qg, kt, causal, scale, softcap, q0, q.shape[1], window)
            lse_g = self._grouped(lse[:, rows, :, None], hkv, ct)  # (B, Hkv, rep, rows, 1)
            p = s.sub_(lse_g).exp_().nan_to_num_(0.0)
            do = self._grouped(dout[:, rows], hkv, ct)
            dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
            delta = (do * self._grouped(out[:, rows], hkv, ct)).sum(-1, keepdim=True)  # (B, Hkv, rep, rows, 1)
            ds = torch.matmul(do, vt).sub_(delta).mul_(p)  # p * (dP - delta)
            if t is not None:  # through s = softcap * tanh(s_raw / softcap): times 1 - tanh^2
                ds.mul_(t.square_().neg_().add_(1.0))
            dqs.append(self._ungrouped(torch.matmul(ds, kt.transpose(-1, -2)).mul_(scale)).to(q.dtype))
            dk += torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale)
            del s, t, p, ds
        return torch.cat(dqs, 1), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class TorchCPUKernel:
    """torch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``).

    Takes fewer K/V heads directly and ``[B, H, S, D]`` views over ``[B, S, H, D]`` memory, so
    nothing is copied or expanded on the way in. A band (``window``) goes in as an additive
    ``[Sq, Sk]`` mask in the inputs' dtype (the op's own ``attn_mask``; rows that see no key get
    ``lse = -inf`` here, where the op reports 0).
    """

    name = "torch"
    softcap = False
    window = True  # as an additive mask
    heads_major = True  # its backward reads K/V 3-5% faster from [B, H, S, D] memory (benchmarks/NOTES.md)

    def refuses(self, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int | None,
                softcap: bool, window: bool) -> str:  # fmt: skip
        """Why this kernel cannot run a layer (``""``: it can): any float dtype and head dim, no soft-capping."""
        return "torch's fused CPU op has no soft-capping" if softcap else ""

    @staticmethod
    def _mask(q: Tensor, k: Tensor, window: tuple[int, int] | None) -> tuple[Tensor | None, Tensor | None]:
        if window is None:
            return None, None
        seen = band_mask(q.shape[1], k.shape[1], window, q.device)
        return torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf")), seen

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor]:
        mask, seen = self._mask(q, k, window)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.transpose(1, 2)
        if seen is not None and not bool(seen.any(1).all()):
            lse = lse.masked_fill(~seen.any(1)[None, :, None], float("-inf"))
        return out.transpose(1, 2), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float,
        window: tuple[int, int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.transpose(1, 2).to(torch.float64 if q.dtype == torch.float64 else torch.float32),
            0.0,
            causal,
            attn_mask=self._mask(q, k, window)[0],
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
