"""A float lm_head whose plain-greedy rows are picked without the whole product, the same token (`greedy_head: int8`).

A greedy row needs only the first index of its largest logit. The head keeps, beside its float weight, an int8 copy
(per output row, the A8W8 rule: s_n = max|w_n| / 127) and for each row n two constants that bound, for any x, how
far the int8 product A_n (dynamic int8 activations, exact int32 sums, the A8W8 kernel) can be from the exact
kernel's logit Y_n = float_linear(x, w)[n]:

  |Y_n - A_n| <= B_n = (1 + 2^-10) (s_x C_n + |x|_2 D_n + 8u |A_n|) + eps,   u = 2^-24 (fp32's unit roundoff)

  with x = s_x q + r (the activations' quantization: |r_k| <= s_x (1/2 + 2^-12) for every rounding of x_k / s_x),
  w_n = s_n q_n + e_n (the weight's, e_n kept exactly in fp64 at load):
    sum_k x_k w_nk - s_x s_n <q, q_n> = s_n <r, q_n> + <x, e_n>
    |s_n <r, q_n>| <= s_x C_n,           C_n = s_n |q_n|_1 (1/2 + 2^-12)
    |<x, e_n>|     <= |x|_2 |e_n|_2      (Cauchy-Schwarz)
    the exact kernel's own rounding (one rounding per k, an FMA chain or vdpbf16ps' pairs):
                   <= gamma_K sum_k |x_k w_nk| <= gamma_K |x|_2 |w_n|_2,  gamma_K = K u / (1 - K u)
    so D_n = |e_n|_2 + gamma_K |w_n|_2 (fp64, rounded up to fp32);
  A_n's epilogue (int32 -> fp32, times s_x, times s_n) is within 3u |A_n| of s_x s_n <q, q_n>; 8u |A_n| also
  covers the fp32 roundings of A_n +- B_n below, the 2^-10 those of B_n itself; eps the flushed denormals.

With L = max_n (A_n - B_n), every row with A_n + B_n < L has Y_n < L <= Y_m for the m that attains L: the argmax is
among the candidates {n : A_n + B_n >= L}, and no candidate outside can tie it. The candidates' exact logits come from
the float kernel itself (Kernels.linear_rows: the same bits as the whole product's columns), and the pick is the
first index of their maximum: torch.argmax's rule over the whole row, so the token is exactly plain greedy's.

Cost per token: the int8 head (half the bytes of a bf16 one) plus ~32 KB of cache lines per candidate; the demo's
random-weight rows had 40-130 candidates of 151,936 (a tighter bound than the worst case would not change the token,
only the candidates). A row that cannot be certified (a non-finite x or logit, more than MAX_CANDIDATES candidates)
makes greedy_picks return None, and the caller computes the whole product as before (its errors included).
Memory: the int8 copy (vocab x hidden bytes) and two fp32 per row beside the float weight.
"""
from __future__ import annotations

import torch

from ..kernels import Kernels
from .linear import A8W8Linear, FloatLinear, int8_rows

U = 2.0 ** -24                  # fp32 unit roundoff
MARGIN = 1.0 + 2.0 ** -10       # B's own fp32 roundings
MAX_CANDIDATES = 2048           # union over a step's rows; past it the whole product is cheaper
COEF = 8 * U * MARGIN           # B's |A_n| term: A's epilogue and the fp32 roundings of A +- B (the top of this file)


class ScreenedHead(FloatLinear):
    """FloatLinear (the exact head, and a tied embedding's rows) plus the int8 screen of its greedy rows."""

    def __init__(self, weight: torch.Tensor, kernels: Kernels, rows_per_chunk: int = 8192):
        super().__init__(weight, kernels)
        n, k = weight.shape
        q, scale = int8_rows(weight, rows_per_chunk)
        gamma = k * U / (1 - k * U)
        c = torch.empty(n, dtype=torch.float64)
        d = torch.empty(n, dtype=torch.float64)
        for r in range(0, n, rows_per_chunk):
            w = weight[r:r + rows_per_chunk].double()
            qd, sd = q[r:r + rows_per_chunk].double(), scale[r:r + rows_per_chunk].double()
            e = w - sd[:, None] * qd                     # exact in fp64 (bf16 / fp32 w, fp32 s, int8 q)
            c[r:r + rows_per_chunk] = sd * qd.abs().sum(1) * (0.5 + 2.0 ** -12)
            d[r:r + rows_per_chunk] = e.norm(dim=1) * (1 + 1e-12) + gamma * w.norm(dim=1) * (1 + 1e-12)
        self.finite = bool(torch.isfinite(c).all()) and bool(torch.isfinite(d).all())
        up = torch.tensor(float("inf"), dtype=torch.float32)
        self.c = torch.nextafter(c.float(), up)          # rounded up
        self.d = torch.nextafter(d.float(), up)
        self.wmax = float(weight.abs().max()) if n else 0.0
        self.screen = A8W8Linear(q, scale, kernels)
        self.stats = {"rows": 0, "fallbacks": 0, "candidates": 0}

    def screen_terms(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, terms) of x [B, K]: the int8 product, fp32 [B, N], and per row (s_x, |x|_2, eps) with B's margin,
        fp32 [B, 3], so that B = terms[:, 0] C + terms[:, 1] D + 8u (1 + 2^-10) |A| + terms[:, 2] (the top of this
        file); None where x is not finite."""
        xf = x.float()
        amax = xf.abs().amax(dim=1)
        s_x = torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax)).double() * (1 + 2.0 ** -20)  # 0: r = x = 0
        l2 = xf.double().norm(dim=1) * (1 + 2.0 ** -30)
        if not bool(torch.isfinite(l2).all()):
            return None
        eps = (x.shape[1] + 1) * 2.0 ** -125 * (1 + self.wmax) * (1 + amax.double())
        terms = torch.stack([s_x * MARGIN, l2 * MARGIN, eps], dim=1).float()
        return self.screen(xf), terms

    def screen_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B), fp32 [B, N] each, of x [B, K]: the int8 product and the bound on |Y - A| (the top of this file), or
        None where x or A is not finite. The formula in torch ops (Kernels.greedy_screen computes it fused)."""
        found = self.screen_terms(x)
        if found is None:
            return None
        a, terms = found
        if not bool(torch.isfinite(a).all()):
            return None
        bound = torch.addcmul(terms[:, :1] * self.c, terms[:, 1:2], self.d)
        bound.add_(a.abs(), alpha=COEF).add_(terms[:, 2:])
        return a, bound

    def candidates(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Per row of x [B, K] its candidate ids (ascending) and the union of them, or None where a row cannot be
        certified: the kernel set's greedy_screen where it has one, else the same test in torch ops."""
        if self.kernels.greedy_screen is not None:
            found = self.screen_terms(x)
            if found is None:
                return None
            a, terms = found
            ids, counts = self.kernels.greedy_screen(a, self.c, self.d, terms, COEF, MAX_CANDIDATES)
            counts = counts.tolist()
            if min(counts) < 0:
                return None
            rows = list(torch.split(ids, counts))
        else:
            found = self.screen_bound(x)
            if found is None:
                return None
            a, bound = found
            floor = (a - bound).amax(dim=1, keepdim=True)
            if not bool(torch.isfinite(floor).all()):
                return None
            keep = (a + bound) >= floor
            rows = [torch.nonzero(keep[b]).flatten() for b in range(keep.shape[0])]
        union = rows[0] if len(rows) == 1 else torch.unique(torch.cat(rows))
        if union.numel() > MAX_CANDIDATES:
            return None
        return rows, union

    def greedy_picks(self, x: torch.Tensor) -> list[int] | None:
        """Each row's first index of its largest logit (float_linear(x, w, fp32)'s argmax, torch's rule), or None:
        the caller takes the whole product (a row not certified, or a non-finite candidate logit)."""
        if not self.finite or x.shape[0] == 0:
            return None
        self.stats["rows"] += x.shape[0]
        if self.kernels.greedy_head_picks is not None:   # the set's one call for the steps below (the CPU set's C++)
            picks, union = self.kernels.greedy_head_picks(x, self.screen.prepared, self.c, self.d, self.wmax,
                                                          self.prepared, COEF, MARGIN, MAX_CANDIDATES)
            if union < 0:
                self.stats["fallbacks"] += x.shape[0]
                return None
            self.stats["candidates"] += union
            return picks.tolist()
        found = self.candidates(x)
        if found is None:
            self.stats["fallbacks"] += x.shape[0]
            return None
        rows, union = found
        vals = self.kernels.linear_rows(x, self.prepared, union)        # [B, C], the exact logits' bits
        if not bool(torch.isfinite(vals).all()):
            self.stats["fallbacks"] += x.shape[0]
            return None
        self.stats["candidates"] += union.numel()
        picks = []
        for b, ids in enumerate(rows):
            v = vals[b] if len(rows) == 1 else vals[b].index_select(0, torch.searchsorted(union, ids))
            picks.append(int(ids[int(torch.argmax(v))]))   # ids ascend: the first maximum is the lowest id
        return picks


__all__ = ["COEF", "MAX_CANDIDATES", "ScreenedHead"]
