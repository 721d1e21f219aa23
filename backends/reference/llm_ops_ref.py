"""Float64 reference of the llm_ops kernels, in pure Python.

Every backend under backends/*/llm_ops/ is compared against these functions.
Tensors are flat row-major lists of Python floats; the caller rounds inputs to
the kernel's storage type first (to_f32, to_bf16_bits/from_bf16_bits), so the
reference sees exactly the values the kernel sees and computes in float64.

Ops (the C ABI is in backends/cpu/llm_ops/ops.h):
  rmsnorm(x, weight, rows, cols, eps)
      out[r][c] = x[r][c] / sqrt(mean_k(x[r][k]^2) + eps) * weight[c]
  silu_mul(gate_up, rows, cols)
      gate_up is [rows][2*cols]; out[r][c] = silu(gate_up[r][c]) * gate_up[r][cols+c]
  rope_cos_sin_cache(max_position, rotary_dim, base)
      [max_position][rotary_dim]: cos of position*inv_freq[i] in the first half,
      sin in the second half, inv_freq[i] = base^(-2i/rotary_dim)
  rope_neox(q, k, positions, cache, tokens, q_heads, k_heads, head_dim, rotary_dim)
      NeoX (rotate-half) layout on [tokens][heads][head_dim]; dimensions past
      rotary_dim pass through unchanged
  softmax(x, rows, cols)
      out[r][c] = exp(x[r][c] - max_r) / sum_k exp(x[r][k] - max_r)

make_case() draws the inputs of one op for a shape and returns them with the
expected output, so every backend's parity script runs the same cases.

Comparison: an output element passes when |out - ref| <= tol * max(1, |ref|);
scaled_errors() gives that ratio's numerator/denominator per element.
"""

import math
import struct

OPS = ("rmsnorm", "silu_mul", "rope_neox", "softmax")


def to_f32(values):
    """Round each value to the nearest float32 (as a Python float)."""
    packed = struct.pack("<%df" % len(values), *values)
    return list(struct.unpack("<%df" % len(values), packed))


def to_bf16_bits(values):
    """Round each value to bfloat16 (round to nearest even); return uint16 bit patterns."""
    words = struct.unpack("<%dI" % len(values), struct.pack("<%df" % len(values), *values))
    bits = []
    for word in words:
        if (word & 0x7F800000) == 0x7F800000 and (word & 0x007FFFFF):
            bits.append((word >> 16) | 0x0040)  # keep NaN a quiet NaN
            continue
        rounding = 0x7FFF + ((word >> 16) & 1)
        bits.append(((word + rounding) >> 16) & 0xFFFF)
    return bits


def from_bf16_bits(bits):
    """The float values of uint16 bfloat16 bit patterns."""
    words = [(b & 0xFFFF) << 16 for b in bits]
    return list(struct.unpack("<%df" % len(words), struct.pack("<%dI" % len(words), *words)))


def round_bf16(values):
    """Round each value to the nearest bfloat16 (as a Python float)."""
    return from_bf16_bits(to_bf16_bits(values))


def rmsnorm(x, weight, rows, cols, eps):
    out = []
    for r in range(rows):
        row = x[r * cols:(r + 1) * cols]
        mean_square = math.fsum(v * v for v in row) / cols
        inv_rms = 1.0 / math.sqrt(mean_square + eps)
        out.extend(v * inv_rms * w for v, w in zip(row, weight))
    return out


def silu(g):
    # Two branches so that exp never overflows for large |g|.
    if g >= 0:
        return g / (1.0 + math.exp(-g))
    e = math.exp(g)
    return g * e / (1.0 + e)


def silu_mul(gate_up, rows, cols):
    out = []
    for r in range(rows):
        base = r * 2 * cols
        gate = gate_up[base:base + cols]
        up = gate_up[base + cols:base + 2 * cols]
        out.extend(silu(g) * u for g, u in zip(gate, up))
    return out


def rope_cos_sin_cache(max_position, rotary_dim, base=10000.0):
    half = rotary_dim // 2
    inv_freq = [base ** (-2.0 * i / rotary_dim) for i in range(half)]
    cache = []
    for p in range(max_position):
        angles = [p * f for f in inv_freq]
        cache.extend(math.cos(a) for a in angles)
        cache.extend(math.sin(a) for a in angles)
    return cache


def _rope_heads(x, positions, cache, tokens, heads, head_dim, rotary_dim):
    half = rotary_dim // 2
    out = list(x)
    for t in range(tokens):
        row = cache[positions[t] * rotary_dim:(positions[t] + 1) * rotary_dim]
        cos, sin = row[:half], row[half:]
        for h in range(heads):
            base = (t * heads + h) * head_dim
            for i in range(half):
                x1 = x[base + i]
                x2 = x[base + half + i]
                out[base + i] = x1 * cos[i] - x2 * sin[i]
                out[base + half + i] = x2 * cos[i] + x1 * sin[i]
    return out


def rope_neox(q, k, positions, cache, tokens, q_heads, k_heads, head_dim, rotary_dim):
    """Return (q_out, k_out); the kernels do the same in place."""
    return (_rope_heads(q, positions, cache, tokens, q_heads, head_dim, rotary_dim),
            _rope_heads(k, positions, cache, tokens, k_heads, head_dim, rotary_dim))


def softmax(x, rows, cols):
    out = []
    for r in range(rows):
        row = x[r * cols:(r + 1) * cols]
        peak = max(row)
        exps = [math.exp(v - peak) for v in row]
        total = math.fsum(exps)
        out.extend(e / total for e in exps)
    return out


def max_scaled_error(out, ref):
    """max over elements of |out - ref| / max(1, |ref|): the quantity tolerances bound."""
    if len(out) != len(ref):
        raise ValueError("output has %d elements, reference %d" % (len(out), len(ref)))
    worst = 0.0
    for o, r in zip(out, ref):
        if math.isnan(o) or math.isnan(r):
            if not (math.isnan(o) and math.isnan(r)):
                return math.inf
            continue
        worst = max(worst, abs(o - r) / max(1.0, abs(r)))
    return worst


def make_case(op, shape, magnitude, rng, rounding=to_f32):
    """Random inputs of one op and the expected output.

    op is one of OPS; shape holds the op's size arguments (rows/cols, or
    tokens/q_heads/k_heads/head_dim/rotary_dim/max_position) and optionally
    "offset". Tensor inputs are uniform in [offset - magnitude, offset +
    magnitude) and rounded with `rounding` (to_f32 or round_bf16); the rope
    cos/sin cache and eps are always float32. Returns (inputs, expected):
    inputs maps argument names to flat lists or numbers, expected is the flat
    output (for rope_neox: q followed by k).
    """
    offset = shape.get("offset", 0.0)

    def draw(n, scale=magnitude, centre=offset):
        return rounding([centre + rng.uniform(-scale, scale) for _ in range(n)])

    if op == "rmsnorm":
        rows, cols = shape["rows"], shape["cols"]
        inputs = {"x": draw(rows * cols), "weight": draw(cols, 2.0, 0.0), "rows": rows,
                  "cols": cols, "eps": to_f32([1e-6])[0]}
        return inputs, rmsnorm(inputs["x"], inputs["weight"], rows, cols, inputs["eps"])
    if op == "silu_mul":
        rows, cols = shape["rows"], shape["cols"]
        inputs = {"gate_up": draw(rows * 2 * cols), "rows": rows, "cols": cols}
        return inputs, silu_mul(inputs["gate_up"], rows, cols)
    if op == "rope_neox":
        sizes = {key: shape[key] for key in ("tokens", "q_heads", "k_heads", "head_dim",
                                             "rotary_dim", "max_position")}
        positions = [rng.randrange(sizes["max_position"]) for _ in range(sizes["tokens"])]
        positions[-1] = sizes["max_position"] - 1
        inputs = dict(sizes, q=draw(sizes["tokens"] * sizes["q_heads"] * sizes["head_dim"]),
                      k=draw(sizes["tokens"] * sizes["k_heads"] * sizes["head_dim"]),
                      positions=positions,
                      cos_sin_cache=to_f32(rope_cos_sin_cache(sizes["max_position"],
                                                              sizes["rotary_dim"])))
        q_ref, k_ref = rope_neox(inputs["q"], inputs["k"], positions, inputs["cos_sin_cache"],
                                 sizes["tokens"], sizes["q_heads"], sizes["k_heads"],
                                 sizes["head_dim"], sizes["rotary_dim"])
        return inputs, q_ref + k_ref
    if op == "softmax":
        rows, cols = shape["rows"], shape["cols"]
        inputs = {"x": draw(rows * cols), "rows": rows, "cols": cols}
        return inputs, softmax(inputs["x"], rows, cols)
    raise ValueError("unknown op %r (expected one of %s)" % (op, ", ".join(OPS)))
