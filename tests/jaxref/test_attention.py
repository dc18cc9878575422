

def test_wide_einsum_is_fp32_products_of_16_bit_operands():
    """16-bit operands with an fp32 accumulator: the dot of the exactly widened operands (the products
    of two bf16 or two fp16 numbers are exact in fp32), within fp32 summation order of a dot in
    float64 rounded once; the cotangent of a bf16 operand comes back in bf16, rounded from fp32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxref.attention import wide_einsum

    rng = np.random.default_rng(0)
    for dt in (jnp.bfloat16, jnp.float16):
        a = jnp.asarray(rng.standard_normal((5, 97, 515)), dt)
        b = jnp.asarray(rng.standard_normal((33, 515)), dt)
        got = wide_einsum("xtI,OI->xtO", a, b, jnp.float32)
        exact = np.einsum("xti,oi->xto", np.asarray(a, np.float64), np.asarray(b, np.float64))
        assert got.dtype == jnp.float32
        scale = np.einsum("xti,oi->xto", np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
        rel = float((np.abs(np.asarray(got, np.float64) - exact) / scale).max())
        print(dt.__name__, "max error relative to the sum of |terms|:", rel)
        assert rel < 515 * 2.0 ** -24  # fp32 sums of 515 exact products (16-bit sums: ~2^-8)
    bb = b.astype(jnp.bfloat16)
    g = jax.grad(lambda a: wide_einsum("tI,OI->tO", a, bb, jnp.float32).sum())(
        jnp.asarray(rng.standard_normal((7, 515)), jnp.bfloat16))
    want = np.asarray(bb, np.float64).sum(0)  # 33 terms of 8 bits: exact in fp32
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(jnp.asarray(np.tile(want, (7, 1))).astype(jnp.bfloat16), np.float32))
    # fp32 and fp64 operands are left to the dot as they are
    x = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    np.testing.assert_array_equal(wide_einsum("ij,kj->ik", x, x, jnp.float32), jnp.einsum("ij,kj->ik", x, x))
