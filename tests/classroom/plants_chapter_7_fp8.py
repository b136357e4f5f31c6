"""The planted mistakes and correct rewrites of chapter 7's eight-bit exercises (7b the saturating scaled
cast, its scale and each operand's format; 7c the MX scale and a block's amax over the ranks holding its
pieces), which test_classroom_mistakes.py plants (Plant: plants.py)."""

from __future__ import annotations

from plants import body, right, sub, wrong

PLANTS = [
    # ---- 7b the saturating scaled cast ------------------------------------------------------------
    wrong("7b", "a non-saturating cast: torch's own (1e30 becomes inf in E5M2)", "beyond the range",
          body(0, "return (x.float() * scale).to(fmt)")),
    wrong("7b", "divides by the scale instead of multiplying", "in range",
          sub("(x.float() * scale)", "(x.float() / scale)")),
    wrong("7b", "an inverted scale: amax / largest", "amax_scale",
          body(1, "return (amax.double().clamp(min=EPS) / LARGEST[fmt]).float()")),
    wrong("7b", "the scale divided in fp32 (rounded twice: off by an ulp)", "amax_scale",
          body(1, "return LARGEST[fmt] / amax.float().clamp(min=EPS)")),
    wrong("7b", "no floor on the amax: a tensor of zeros gets an infinite scale", "amax_scale",
          body(1, "return (LARGEST[fmt] / amax.double()).float()")),
    wrong("7b", "E4M3 for the gradients too (they overflow it)", "operand_format",
          body(2, "return E4M3")),
    right("7b", "clamps with torch.where against the largest value",
          body(0, """
              big = LARGEST[fmt]
              y = x.float() * scale
              y = torch.where(y > big, torch.full_like(y, big), torch.where(y < -big, torch.full_like(y, -big), y))
              return y.to(fmt)""")),
    # ---- 7c the MX scale and a block's amax over ranks ---------------------------------------------------
    wrong("7c", "an MX scale that is not a power of two: largest / amax", "a power of two",
          body(0, "return torch.where(amax > 0, LARGEST[fmt] / amax.float(), torch.ones_like(amax.float()))")),
    wrong("7c", "floor(log2 amax) without subtracting emax (the amax lands on 1, not 2^emax)", "mx_scale",
          sub("shared = (e - 1 - EMAX[fmt]).clamp(-127, 127)", "shared = (e - 1).clamp(-127, 127)")),
    wrong("7c", "log2 amax from frexp's exponent without the -1 (one binade off)", "mx_scale",
          sub("shared = (e - 1 - EMAX[fmt]).clamp(-127, 127)", "shared = (e - EMAX[fmt]).clamp(-127, 127)")),
    wrong("7c", "a block of zeros left to frexp (scale 2^8, not 1)", "a block of zeros",
          sub("shared = torch.where(amax > 0, shared, torch.zeros_like(shared))", "pass")),
    wrong("7c", "the amax over one tp shard only (no gather of the table)", "a tensor cut over tp",
          body(1, "pass")),
    wrong("7c", "the table summed over the ranks instead of maxed", "a tensor cut over tp",
          sub(".amax(dim=0)", ".sum(dim=0)")),
    right("7c", "floor(log2 amax) read from the fp32 exponent bits",
          body(0, """
              bits = amax.float().contiguous().view(torch.int32)
              shared = (((bits >> 23) & 0xFF) - 127 - EMAX[fmt]).clamp(-127, 127)
              shared = torch.where(amax > 0, shared, torch.zeros_like(shared))
              return torch.exp2(-shared.float())""")),
]
