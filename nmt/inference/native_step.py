"""The CPU decoder step's layer stack as one C call (native_step.c): fp32, int8 and bf16.

Why: one sentence at a time, a step of beam search on a CPU spends more time dispatching
hundreds of small PyTorch ops than in its matrix products (docs/performance.md); the C step
runs the same kernels (the linears' own, nmt's attention and add + LayerNorm) from one
call, with the same results bit for bit.

What takes it: a post-norm model whose decoder linears are all ones C can call with float32
activations (`MklLinear`, an int8 `KernelLinear`) or all bf16 `KernelLinear`s (which of
them a CPU gets: nmt/inference/backends.py); decoding with the grouped cache
(nmt/inference/kv_cache.py) on rows that are whole groups, without the attention weights;
the kernels built and checked. Anything else returns None from `NativeStep.step`, and
decode_step (nmt/inference/decoding.py) runs the PyTorch layers. The embedding, the slot
mask and the output projection stay in PyTorch.
"""

from __future__ import annotations

import array
import ctypes
from typing import Protocol

import torch
from torch import Tensor

from nmt import kernels
from nmt.inference import add_norm, fused_attention, mkl_linear
from nmt.inference.kernel_linear import KernelLinear
from nmt.inference.mkl_linear import MklLinear
from nmt.model.layers import DecoderLayer
from nmt.model.transformer import Transformer

PARAMS = 46  # the header's length: P_COUNT of the C source
LAYER_PARAMS = 40  # one layer's block: L_COUNT of the C source (checked in `_agrees`)
CACHE_PARAMS = 4  # of which the layer's caches, filled in per step


class StepState(Protocol):
    """What the native step reads and writes of a decoding state: the grouped cache's
    layout (nmt/inference/kv_cache.py `GroupedCache`, the only state decode_step hands it;
    the caches stay decoding's business)."""

    self_k: list[Tensor]  # per layer (groups, heads, capacity, g, d_k)
    self_v: list[Tensor]  # per layer (groups, heads, capacity, g, d_v)
    cross_k: list[Tensor]  # per layer (groups, heads, d_k, src_len): keys transposed
    cross_v: list[Tensor]  # per layer (groups, heads, src_len, d_v)
    cross_mask: Tensor | None  # (groups, 1, 1, src_len) additive
    group_size: int
    position: int

    def open_step(self, live: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """Room for this position, and its slot mask and fed groups (see GroupedCache)."""
        ...


class NativePlan:
    """What a model's native step needs that stays the same from step to step: the
    kernels' addresses, the sizes, and each decoder layer's weight addresses (the packed
    weights of its linears, the biases and LayerNorm parameters, which it keeps alive).
    One per model (the workspace keeps it); `stepper()` per decoder."""

    def __init__(self, model: Transformer, lib: ctypes.CDLL, compute: int, attention: int,
                 norm: int) -> None:
        cfg = model.config
        self.model, self.lib = model, lib
        self.heads, self.d_k, self.d_v = cfg.heads, cfg.head_dim_k, cfg.head_dim_v
        self.d_model, self.d_ff = cfg.d_model, cfg.d_ff
        self.width = 2 * self.heads * self.d_k + self.heads * self.d_v  # a fused q/k/v row
        self.dtype = _activations(model.decoder[0])
        norm_dtype = model.decoder[0].res_self.norm.weight.dtype
        self.kernels = (compute, attention, norm, int(self.dtype == torch.bfloat16),
                        int(norm_dtype == torch.bfloat16))
        eps = model.decoder[0].res_self.norm.eps
        self.eps_bits = kernels.float_bits(eps)
        self.scale_bits = kernels.float_bits(self.d_k ** -0.5)
        self.layers = [_layer_addresses(layer) for layer in model.decoder]
        assert all(len(block) + CACHE_PARAMS == LAYER_PARAMS for block in self.layers)
        self._made_from = _what_it_reads(model)  # holds the layers: their memory stays

    def stepper(self) -> NativeStep | None:
        """A step runner with scratch memory of its own (one per decoder); None when the
        model's decoder is no longer what the plan read (a layer swapped, a parameter moved
        by `.to()`): then the PyTorch layers decode, never stale addresses."""
        if _what_it_reads(self.model) != self._made_from:
            return None
        return NativeStep(self)


class NativeStep:
    """Runs a `NativePlan`'s step for one decoder, in scratch memory that grows with the
    rows (the layers' activations: two (rows, d_model) buffers, the fused q/k/v, the
    attention context and the feed-forward's hidden rows)."""

    def __init__(self, plan: NativePlan) -> None:
        self.plan = plan
        self._scratch = torch.empty(0)

    def step(self, tokens: Tensor, state: StepState, positions: Tensor,
             live: Tensor | None = None) -> Tensor | None:
        """Feed `tokens` (m,) at `state.position` (`positions` (1, d_model) its encoding)
        through the decoder layers, write the caches, advance the position, and return the
        last layer's features (m, d_model), valid until the next step; None (nothing done)
        when this state or these rows are not the native step's (see module docstring)."""
        plan = self.plan
        if not _layout_fits(state, plan):
            return None
        g = state.group_size
        m = tokens.numel()
        if live is not None and m % g:
            return None  # not whole groups: the PyTorch layers handle any rows
        mask, entries = state.open_step(live)
        x0 = plan.model.embed_tokens(tokens[:, None], positions)  # (m, 1, d_model)
        d, per_row = plan.d_model, 2 * plan.d_model + plan.width + plan.heads * plan.d_v
        if (self._scratch.numel() < m * (per_row + plan.d_ff)
                or self._scratch.dtype != plan.dtype):
            self._scratch = torch.empty(m * (per_row + plan.d_ff), dtype=plan.dtype)
        scratch = self._scratch
        x = scratch[: m * d].view(m, d)
        x.copy_(x0.view(m, d))
        o = scratch[m * d: 2 * m * d].view(m, d)
        size = scratch.element_size()  # the C step's offsets below are in bytes
        qkv_at, ctx_at, hid_at = (size * 2 * m * d, size * (2 * m * d + m * plan.width),
                                  size * m * per_row)
        fed = m // g
        keys0, values0 = state.self_k[0], state.self_v[0]  # (groups, heads, cap, g, d)
        cross_k, cross_v = state.cross_k[0], state.cross_v[0]  # (groups, heads, d_k, S), V
        cross_mask = state.cross_mask  # (groups, 1, 1, S) additive, or None
        if entries is not None:
            entries = entries.contiguous()
        params = array.array("q", (
            *plan.kernels, m, g, 0 if entries is None else entries.data_ptr(), fed,
            plan.heads, plan.d_k, plan.d_v, d, plan.d_ff, cross_v.size(2), state.position,
            plan.eps_bits, plan.scale_bits, torch.get_num_threads(),
            *_mask_params(mask, per_query=True), *_mask_params(cross_mask, per_query=False),
            *keys0.stride()[:4], *values0.stride()[:4],
            cross_k.stride(0), cross_k.stride(1), cross_k.stride(3),
            *cross_v.stride()[:3],
            x.data_ptr(), o.data_ptr(), scratch.data_ptr() + qkv_at,
            scratch.data_ptr() + ctx_at, scratch.data_ptr() + hid_at,
            len(plan.layers)))
        for weights, keys, values, k_t, v in zip(plan.layers, state.self_k, state.self_v,
                                                 state.cross_k, state.cross_v, strict=True):
            params.extend(weights)
            params.extend((keys.data_ptr(), values.data_ptr(), k_t.data_ptr(), v.data_ptr()))
        which = plan.lib.nmt_decoder_step(params.buffer_info()[0])
        if which < 0:
            raise MemoryError("native decoder step: no memory for the attention's scratch")
        state.position += 1
        return x if which == 0 else o


def plan_for(model: Transformer) -> NativePlan | None:
    """The native step's plan for `model`, or None where it does not apply: a model it does
    not take (see module docstring), or a kernel missing."""
    if not takes(model):
        return None
    lib = KERNEL.library()
    return None if lib is None else _plan(model, lib)


def takes(model: Transformer) -> bool:
    """Whether the native step can run `model`'s decoder here (the C library aside):
    post-norm, in inference mode, its decoder linears all of one activation dtype that C
    can call (`_activations`), LayerNorms of one eps and dtype with weights and biases, a
    model width the kernels take; the attention and add + LayerNorm kernels there."""
    if model.training or model.config.pre_norm:
        return False
    if model.dec_norm is not None or not 0 < model.config.d_model <= add_norm.MAX_D:
        return False
    norms = [norm for layer in model.decoder for norm in _norms(layer)]
    if len({(norm.eps, norm.weight.dtype if norm.weight is not None else None)
            for norm in norms}) != 1:
        return False
    if not all(_norm_fits(norm) for norm in norms):
        return False
    activations = {_activations(layer) for layer in model.decoder}
    if len(activations) != 1 or None in activations:
        return False
    return fused_attention.enabled() and add_norm.enabled()


def _plan(model: Transformer, lib: ctypes.CDLL) -> NativePlan:
    """The plan over `lib` (the checks of `takes` passed)."""
    functions = mkl_linear.mkl()  # not None where an MklLinear was made
    attention, norm = fused_attention.KERNEL.library(), add_norm.KERNEL.library()
    assert attention is not None and norm is not None
    return NativePlan(model, lib, 0 if functions is None else kernels.address(functions.compute),
                      kernels.address(attention.nmt_attention), kernels.address(norm.nmt_add_norm))


def _linears(layer: DecoderLayer) -> tuple:
    """A decoder layer's six per-step linears, in the C source's order."""
    return (layer.self_attn.qkv, layer.self_attn.out, layer.cross_attn.q,
            layer.cross_attn.out, layer.ffn.fc1, layer.ffn.fc2)


def _norms(layer: DecoderLayer) -> tuple:
    return layer.res_self.norm, layer.res_cross.norm, layer.res_ffn.norm


def _norm_fits(norm: torch.nn.LayerNorm) -> bool:
    """An affine LayerNorm whose weight and bias are contiguous and of one dtype (float32
    or bfloat16), as the add + LayerNorm kernel reads them."""
    return (norm.weight is not None and norm.bias is not None
            and norm.weight.dtype in (torch.float32, torch.bfloat16)
            and norm.bias.dtype == norm.weight.dtype
            and norm.weight.is_contiguous() and norm.bias.is_contiguous())


def _activations(layer: DecoderLayer) -> torch.dtype | None:
    """The dtype a decoder layer's linears take and give: float32 (MKL, an int8 kernel's),
    bfloat16 (the AMX bf16 kernel's), or None where they are not all C's of one dtype."""
    def dtype(linear: torch.nn.Module) -> torch.dtype | None:
        if isinstance(linear, KernelLinear):
            return linear.spec.dtype
        return torch.float32 if isinstance(linear, MklLinear) else None

    dtypes = {dtype(linear) for linear in _linears(layer)}
    return dtypes.pop() if len(dtypes) == 1 else None


def _layer_addresses(layer: DecoderLayer) -> list[int]:
    """The layer's weights in the C source's order (L_QKV .. L_N3B): each linear's block
    (`_linear_entry`), each LayerNorm's weight and bias."""
    qkv, out, q, out2, fc1, fc2 = _linears(layer)
    n1, n2, n3 = _norms(layer)
    addresses = []
    for linears, norm in (((qkv, out), n1), ((q, out2), n2), ((fc1, fc2), n3)):
        for linear in linears:
            addresses += _linear_entry(linear)
        addresses += [norm.weight.data_ptr(), norm.bias.data_ptr()]
    return addresses


def _what_it_reads(model: Transformer) -> list[object]:
    """The modules and addresses a plan reads, to compare: each decoder layer's linears
    (the objects: their packed weights never move) and its LayerNorms' parameter
    addresses."""
    found: list[object] = []
    for layer in model.decoder:
        found += _linears(layer)
        found += [t.data_ptr() for norm in _norms(layer) for t in (norm.weight, norm.bias)
                  if t is not None]
    return found


def _linear_entry(linear: MklLinear | KernelLinear) -> list[int]:
    """A linear's block (LIN_FN .. LIN_SCALE of the C source): the C function and op of
    the layer's own kernel (0, 0 for MKL's sgemm, which the header names), packed weight,
    bias and int8 scales (0 where absent)."""
    bias = 0 if linear.bias is None else linear.bias.data_ptr()
    if isinstance(linear, MklLinear):
        return [0, 0, linear.address, bias, 0]
    scale = 0 if linear.scale is None else linear.scale.data_ptr()
    return [*linear.c_entry(), linear.packed.data_ptr(), bias, scale]


def _layout_fits(state: StepState, plan: NativePlan) -> bool:
    """Whether the state's tensors are laid out as the C step reads them: caches in the
    activations' dtype, contiguous (groups, heads, capacity, g, d) self-attention buffers,
    cross keys stored d_k-contiguous (the attention kernel's layout) and values
    d_v-contiguous, all layers alike; an additive source mask of that dtype."""
    keys0, k_t0 = state.self_k[0], state.cross_k[0]
    if keys0.dtype != plan.dtype or k_t0.dtype != plan.dtype:
        return False
    if state.cross_mask is not None and state.cross_mask.dtype != plan.dtype:
        return False
    if k_t0.stride(2) != 1 or state.cross_v[0].stride(3) != 1:
        return False
    if keys0.size(-1) != plan.d_k or state.self_v[0].size(-1) != plan.d_v:
        return False
    strides = (keys0.stride(), state.self_v[0].stride(), k_t0.stride(),
               state.cross_v[0].stride())
    return (keys0.is_contiguous() and state.self_v[0].is_contiguous()
            and all((k.stride(), v.stride(), ck.stride(), cv.stride()) == strides
                    for k, v, ck, cv in zip(state.self_k, state.self_v, state.cross_k,
                                            state.cross_v, strict=True)))


def _mask_params(mask: Tensor | None, per_query: bool) -> tuple[int, ...]:
    """Address and (entry, query, position) strides of a (groups, 1, g or 1, L) additive
    mask, 0 for each when there is none; a slot mask (`per_query`) has a row per query, a
    source mask one for all (no query stride given)."""
    if mask is None:
        return (0,) * (4 if per_query else 3)
    strides = (mask.stride(0), mask.stride(2), mask.stride(3))
    return mask.data_ptr(), *(strides if per_query else strides[::2])


def _agrees(lib: ctypes.CDLL) -> bool:
    """Whether the C step reads the parameter blocks this module writes (its header's and a
    layer's length). Its own code only moves data and applies ReLU: every product it makes is
    a kernel's that checks itself against PyTorch when it loads (the linears', the attention's
    and the add + LayerNorm's), and tests/inference/test_native_step.py holds whole steps to
    the PyTorch layers'."""
    lib.nmt_decoder_step_layer_params.restype = ctypes.c_int64
    return lib.nmt_decoder_step_layer_params() == LAYER_PARAMS


KERNEL = kernels.Kernel("native_step", "nmt_decoder_step", PARAMS, _agrees)
