"""The oracle as a Flax NNX module: a thin shell over the pure functions, for Flax and optax code.

    model = jaxref.nnx.Decoder.load("random:llama", policy="fp64")
    logits = model(tokens, positions, doc_ids, variant="anchor")                 # [B, T, V]
    grads = nnx.grad(lambda m: m.loss(tokens, positions, doc_ids, loss_mask, variant="anchor"))(model)

The parameters are one `nnx.Param` holding the same pytree as `jaxref.load_model`; the forward is
`jaxref.executor.decoder_forward` and the loss `jaxref.train.next_token_loss`, so the module can never
disagree with `jaxref.forward` / `jaxref.value_and_grad` beyond rounding. It always traces the JAX
attention path (`fused=False`: the fused CPU kernel has no backward rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anchor_core.spec import ModelSpec
from jaxref.executor import decoder_forward
from jaxref.loading import load_model
from jaxref.policy import DtypePolicy, get_policy
from jaxref.reference import Params
from jaxref.train import next_token_loss
from jaxref.variants import check_variant


class Decoder(nnx.Module):
    """A Llama-family decoder (docs/DESIGN.md §1-§4) under a dtype policy."""

    def __init__(self, params: Params, config: ModelSpec, policy: DtypePolicy | str = "fp32"):
        self.config = config
        self.policy = get_policy(policy)
        # held at the wider of the stored and the policy's param dtype (as jaxref.value_and_grad
        # differentiates): fp64 truth trains fp64 parameters
        self.params = nnx.Param(jax.tree_util.tree_map(
            lambda p: jnp.asarray(p, jnp.promote_types(p.dtype, self.policy.dtype("param"))), params))

    @classmethod
    def load(cls, name: str, *, seed: int = 0, policy: DtypePolicy | str = "fp32") -> "Decoder":
        """A model named as in docs/DESIGN.md §6 (`random:<preset>`, a folder, a .gguf, `default`)."""
        params, config = load_model(name, seed=seed)
        return cls(params, config, policy)

    def _seq_len(self, positions) -> int | None:
        if self.config.rope.kind != "dynamic":
            return None
        return int(np.max(np.asarray(positions))) + 1  # dynamic RoPE scales by the concrete length

    def __call__(self, tokens, positions, doc_ids, *, variant: str = "full"):
        """Logits [B, T, V] of tokens, positions, doc_ids int [B, T]."""
        variant = check_variant(variant)
        logits, _ = decoder_forward(
            self.params.get_value(), jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int64),
            jnp.asarray(doc_ids, jnp.int32), spec=self.config, policy=self.policy, variant=variant, tap=False,
            tap_rows=None, probe=None, seq_len=self._seq_len(positions), fused=False)
        return logits

    def loss(self, tokens, positions, doc_ids, loss_mask, *, variant: str = "full"):
        """The mean next-token cross-entropy over counted targets (as `jaxref.value_and_grad`)."""
        logits = self(tokens, positions, doc_ids, variant=variant)
        dtype = jnp.promote_types(jnp.float32, self.policy.dtype("head"))
        return next_token_loss(logits, jnp.asarray(tokens, jnp.int32), jnp.asarray(loss_mask, jnp.int32), dtype)
