"""The sampled tokens' logprobs and the policy's entropy from the final hidden states, a chunk of positions at a time.

Guarantee: the values and gradients are those of :func:`rlrun.training.reference_loss.token_logprobs` and
:func:`~rlrun.training.reference_loss.token_entropy` on the full ``[B, T, V]`` logits (float summation order aside), but
the logits are never all in memory: the LM head runs on ``chunk_tokens`` positions at a time, forward and again in
the backward (:class:`ChunkedHead` keeps only the hidden states, the log-sum-exp and, under top-p, the nucleus
threshold of each position). Peak memory of the head: a few ``[chunk_tokens, V]`` float32 tensors, whatever the
number of tokens. The same idea as verl's and TRL's chunked logprobs and prime-rl's chunked LM head.

The distribution is the one vLLM sampled from (``--logprobs-mode processed_logprobs``: vLLM's
``Sampler.sample``): logits in float32, divided by the temperature, then, with ``top_p < 1``, vLLM's top-p mask
(:func:`nucleus_threshold`, which mirrors ``apply_top_k_top_p_pytorch`` in
``vllm/v1/sample/ops/topk_topp_sampler.py``) and renormalised over the tokens kept. Computing the trainer's
logprobs over the whole vocabulary instead would make the on-policy importance ratio the nucleus's kept mass
``S < 1`` rather than 1 (TRL issue #6789: the bias is ``log S``). As prime-rl's trainer-side replay does (PR
#2601), the sampled token is always kept: a token vLLM sampled at the nucleus's floating-point boundary, which the
trainer's slightly different logits would mask, gets its own probability rather than ``-inf``. The mask is a
constant of the step (no gradient flows through which tokens are kept), as DeepSeek-V3.2's "Keep Sampling Mask"
(§3.1) trains under the sampler's mask.

Only the positions whose next token is trained are computed (:func:`token_stats` takes a boolean ``positions``
mask): prompt positions cost no LM head at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

#: Default positions per LM-head chunk (``spec.trainer.logprob_chunk_tokens``): at Qwen3's vocabulary
#: (151,936) one ``[chunk, V]`` float32 tensor is 78 MB, and a chunk holds a few of them.
DEFAULT_CHUNK_TOKENS = 128


def nucleus_threshold(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest logit vLLM's top-p mask keeps, per row: vLLM's rule (``apply_top_k_top_p_pytorch``, top-k
    off) sorts a row's logits ascending, takes the cumulative sum of their softmax and masks every entry whose
    cumulative probability is ``≤ 1 − top_p``, never the largest. The kept tokens are those with ``z ≥`` the value
    returned (a tie with the threshold keeps every tied token, where vLLM's sort order would drop some: a
    difference only between exactly equal logits).

    Args:
        z: ``[n, V]`` float32 logits, already divided by the temperature.
        top_p: in ``(0, 1]``.

    Returns:
        ``[n]`` float32.
    """
    ascending = z.sort(dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    masked = (cumulative <= 1 - top_p).sum(dim=-1)  # a prefix of the ascending order (the sum is non-decreasing)
    masked.clamp_(max=z.shape[-1] - 1)  # "at least one": vLLM never masks the largest
    return ascending.gather(-1, masked[:, None]).squeeze(-1)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``[n, V]`` float32 logits of one chunk divided by the temperature: the matmul in ``weight``'s dtype (the
    compute dtype, as vLLM's LM head runs in the dtype it serves), then float32, as vLLM's sampler converts."""
    logits = h.to(weight.dtype) @ weight.T
    if bias is not None:
        logits += bias
    return logits.float().div_(temperature)


def _keep(z: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor | None:
    """Mask ``z`` in place below ``threshold`` (None: no truncation); returns the kept mask, or None."""
    if threshold is None:
        return None
    kept = z >= threshold[:, None]
    z.masked_fill_(~kept, float("-inf"))
    return kept


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class ChunkedHead(torch.autograd.Function):
    """``(logprob of the target, entropy)`` at each of ``N`` positions from their hidden states, in chunks.

    Forward args: ``hidden [N, H]`` (any float dtype), ``weight [V, H]`` and ``bias [V] | None`` (the LM head's
    parameters, any float dtype), ``targets [N]`` int64, ``temperature``, ``top_p``, ``chunk_tokens`` and
    ``compute_dtype`` (the matmul's dtype: the head is cast to it once per pass, a copy that lives for that pass), and
    ``with_entropy`` (False: the entropy is not computed — NaN — and has no gradient, for a forward that needs only
    the logprobs, as the KL term's reference: it skips an exponential of every chunk's logits). Returns
    ``logprobs [N]`` and ``entropy [N]``, float32, nats. Backward: the gradients of both outputs with
    respect to ``hidden``, ``weight`` and ``bias``, the logits recomputed chunk by chunk; the head's gradient is
    accumulated in float32 and returned in its parameters' dtype (float32 master weights keep a float32 gradient).
    ``∂ log p_y / ∂ z_v = 1[v = y] − p_v`` and ``∂H / ∂ z_v = −p_v (log p_v + H)``, both divided by the
    temperature; 0 for a token outside the nucleus.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, top_p, chunk_tokens, compute_dtype, with_entropy):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs) if with_entropy else torch.full_like(logprobs, float("nan"))
        lse = torch.empty_like(logprobs)
        thresholds = torch.empty_like(logprobs) if top_p < 1.0 else None
        w, b = weight.to(compute_dtype), _cast(bias, compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes here are explicit
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                z = _chunk_logits(hidden[s:e], w, b, temperature)
                target_z = z.gather(-1, targets[s:e, None]).squeeze(-1)
                threshold = None
                if thresholds is not None:
                    # the sampled token is always kept (prime-rl PR #2601): the threshold is at most its logit
                    threshold = torch.minimum(nucleus_threshold(z, top_p), target_z)
                    thresholds[s:e] = threshold
                _keep(z, threshold)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                logprobs[s:e] = target_z - lse[s:e]
                if (
                    with_entropy
                ):  # entr(p) = −p log p with entr(0) = 0: a masked token adds 0, not NaN (as token_entropy)
                    entropy[s:e] = torch.special.entr(z.sub_(lse[s:e, None]).exp_()).sum(-1)
        del w, b
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, thresholds)
        ctx.temperature, ctx.chunk_tokens, ctx.compute_dtype = temperature, chunk_tokens, compute_dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, thresholds = ctx.saved_tensors
        none = (None,) * 6  # targets, temperature, top_p, chunk_tokens, compute_dtype, with_entropy
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, *none
        temperature, chunk = ctx.temperature, ctx.chunk_tokens
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        w, b = weight.to(ctx.compute_dtype), _cast(bias, ctx.compute_dtype)
        grad_hidden = torch.empty_like(hidden) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            z = _chunk_logits(h, w, b, temperature)
            kept = _keep(z, None if thresholds is None else thresholds[s:e])
            log_p = z.sub_(lse[s:e, None])  # in place: z is not needed any more
            p = log_p.exp()
            grad_z = torch.zeros_like(p)
            if grad_entropy is not None:
                if kept is not None:
                    log_p.masked_fill_(~kept, 0.0)  # p = 0 there: 0 · (−inf) would be NaN
                grad_z.addcmul_(p, log_p.add_(entropy[s:e, None]), value=-1.0).mul_(grad_entropy[s:e, None])
            if grad_logprobs is not None:
                g = grad_logprobs[s:e, None]
                grad_z.addcmul_(p, g, value=-1.0)
                grad_z.scatter_add_(-1, targets[s:e, None], g)
            grad_z.div_(temperature)
            gz = grad_z.to(w.dtype)
            if want_h:
                grad_hidden[s:e] = (gz @ w).to(hidden.dtype)
            if want_w:
                grad_weight += (gz.T @ h.to(w.dtype)).float()
            if want_b:
                grad_bias += grad_z.sum(0)
        return (
            grad_hidden,
            _cast(grad_weight, weight.dtype),
            _cast(grad_bias, bias.dtype) if bias is not None else None,
            *none,
        )


def chunked_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)``, each ``[N]`` float32 nats, of ``targets [N]`` under the sampling distribution of
    the logits ``hidden [N, H] @ weight[V, H]ᵀ (+ bias)`` (module docstring), computed ``chunk_tokens`` positions
    at a time (:class:`ChunkedHead`; differentiable in ``hidden``, ``weight`` and ``bias``).

    ``compute_dtype`` (default ``weight``'s): the dtype of the LM head's matmul; ``bfloat16`` as vLLM serving bf16
    computes it, the softmax in float32 either way. ``with_entropy=False``: the entropy is NaN, not computed.

    Raises:
        ValueError: ``chunk_tokens < 1``, or ``top_p`` outside ``(0, 1]``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    dtype = compute_dtype or weight.dtype
    return ChunkedHead.apply(
        hidden, weight, bias, targets, float(temperature), float(top_p), int(chunk_tokens), dtype, bool(with_entropy)
    )


@contextmanager
def head_returns_token_stats(
    model: nn.Module,
    positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: float,
    chunk_tokens: int,
    compute_dtype: torch.dtype,
    with_entropy: bool = True,
) -> Iterator[list[torch.Tensor]]:
    """While active, ``model``'s LM head (``get_output_embeddings()``, an ``nn.Linear``) returns, instead of the
    ``[b, T, V]`` logits, ``[N, 2]``: (logprob, entropy) of :func:`chunked_token_stats` at the ``N`` positions
    where ``positions [b, T]`` (bool) is True, for ``targets [b, T]`` there (``with_entropy=False``: NaN entropy,
    not computed). The model's own ``forward`` thus runs
    the head inside it, which FSDP2 needs (the root unit's parameters, the head's among them, are gathered for the
    root's forward only). Yields a list that holds, after the forward, the tensor the head returned: the forward's
    ``logits`` must be that very tensor (a model that scales or soft-caps its logits after the head is not
    supported, and :mod:`rlrun.training.step` checks it).

    Raises:
        TypeError: the model's output embeddings are not an ``nn.Linear``.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__}: the LM head is a {type(head).__name__}, not an nn.Linear")
    selected = targets[positions]
    returned: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logprobs, entropy = chunked_token_stats(
            hidden[positions],
            head.weight,
            selected,
            temperature,
            top_p,
            chunk_tokens,
            head.bias,
            compute_dtype,
            with_entropy,
        )
        returned.append(torch.stack([logprobs, entropy], dim=-1))
        return returned[-1]

    head.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    try:
        yield returned
    finally:
        del head.forward
