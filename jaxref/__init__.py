"""jaxref: the numerical oracle. A JAX reference of the Llama-family decoder, RoPE and every
attention variant of CONTRACT §2, with a dtype policy per numerical stage (CONTRACT §4), so it
plays fp64 truth or emulates a bf16 stack. It never imports torch.
"""

import jax

# fp64 is the oracle's truth; every array in jaxref is created with an explicit dtype.
jax.config.update("jax_enable_x64", True)
