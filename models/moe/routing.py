"""Top-k routing with expert capacity: which token goes to which expert slot, and the losses.

Pure functions of the router logits of fixed token groups, so the routing (and which
tokens drop) is the same whatever the mesh. The dispatch and combine tensors are GShard's:
``dispatch[g, s, e, c] = 1`` when token s of group g sits in slot c of expert e, and
``combine`` holds the token's gate there. Einsums with them move tokens to the experts' slots
and back; with the expert dim sharded, that movement is the all-to-all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardlib.core import ops


class Routing(NamedTuple):
    """Where each token goes, and the router's statistics for this layer (a pytree)."""

    dispatch: jax.Array
    """[groups, group tokens, experts, capacity] 0/1: token -> expert slot."""
    combine: jax.Array
    """[groups, group tokens, experts, capacity]: the gate of each kept assignment."""
    stats: dict
    """aux_loss, z_loss, dropped (count of dropped assignments), load [experts]."""

    @staticmethod
    def empty_stats(experts: int) -> dict:
        zero = jnp.zeros((), jnp.float32)
        return {"aux_loss": zero, "z_loss": zero, "dropped": zero, "load": jnp.zeros(experts)}


def _top_k(probs_GSE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """k rounds of argmax (lowest index wins ties), as ``jax.lax.top_k`` does.

    ``lax.top_k`` lowers to a sort that XLA's SPMD partitioner gathers over the batch axes;
    argmax is a plain reduction over the (whole) expert dim and stays sharded.
    """
    values, indices, masked = [], [], probs_GSE
    for _ in range(k):
        index_GS = jnp.argmax(masked, axis=-1)
        values.append(jnp.take_along_axis(probs_GSE, index_GS[..., None], axis=-1)[..., 0])
        indices.append(index_GS)
        masked = jnp.where(jax.nn.one_hot(index_GS, probs_GSE.shape[-1]) > 0, -1.0, masked)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def route(
    logits_GSE: jax.Array, *, top_k: int, capacity: int, first_choice_load: bool = False
) -> Routing:
    """GShard / Switch top-k routing of fp32 router logits [groups, tokens, experts].

    Gates: the router probability for k = 1 (Switch), renormalised over the chosen experts
    for k > 1 (GShard, Mixtral). Slots are filled in priority order: every token's first
    choice, in token order, before any second choice; an assignment beyond ``capacity``
    slots is dropped (its gate is lost, the token keeps its residual).
    """
    g, s, e = logits_GSE.shape
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    top_p_GSK, top_i_GSK = _top_k(probs_GSE, top_k)
    gates_GSK = top_p_GSK if top_k == 1 else top_p_GSK / top_p_GSK.sum(-1, keepdims=True)
    chosen_GSKE = jax.nn.one_hot(top_i_GSK, e, dtype=jnp.float32)

    # Slot of each assignment in its expert: count earlier assignments in priority order.
    chosen_GQE = chosen_GSKE.transpose(0, 2, 1, 3).reshape(g, top_k * s, e)  # Q = (k, s)
    slot_GQE = jnp.cumsum(chosen_GQE, axis=1) - 1.0
    slot_GSK = (slot_GQE * chosen_GQE).sum(-1).reshape(g, top_k, s).transpose(0, 2, 1)
    kept_GSK = (slot_GSK < capacity).astype(jnp.float32)
    slot_GSKC = jax.nn.one_hot(slot_GSK.astype(jnp.int32), capacity, dtype=jnp.float32)

    kept_GSKE = chosen_GSKE * kept_GSK[..., None]
    dispatch_GSEC = jnp.einsum("gske,gskc->gsec", kept_GSKE, slot_GSKC)
    combine_GSEC = jnp.einsum("gske,gskc,gsk->gsec", kept_GSKE, slot_GSKC, gates_GSK)

    # Load balancing (Switch / GShard): E * sum_e f_e * P_e, f = fraction of assignments,
    # P = mean router probability; 1 when balanced. Means run over all tokens of the batch.
    # (``ops.batch_mean``: the whole batch's means where a program holds only some rows)
    chosen_GSE = chosen_GSKE[:, :, 0] if first_choice_load else chosen_GSKE.sum(2) / top_k
    load_E = ops.batch_mean(chosen_GSE, (0, 1))
    aux_loss = e * jnp.sum(load_E * ops.batch_mean(probs_GSE, (0, 1)))
    z_loss = ops.batch_mean(jnp.square(jax.nn.logsumexp(logits_GSE, axis=-1)), (0, 1))
    dropped = ops.batch_sum(1.0 - kept_GSK)
    stats = {"aux_loss": aux_loss, "z_loss": z_loss, "dropped": dropped, "load": load_E}
    return Routing(dispatch_GSEC, combine_GSEC, stats)
