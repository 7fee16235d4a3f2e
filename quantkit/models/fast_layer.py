"""Pre-norm decoder layers whose residual adds run inside the fused norm + quantization kernel.

A pre-norm decoder layer (Llama, Mistral, Qwen2, Qwen3 ...) adds each sublayer's output to the
residual stream and norms the sum for the next sublayer::

    h = x + attn(input_norm(x))       # the sum, then post_attention_norm(h) for the MLP
    y = h + mlp(post_attention_norm(h))   # the sum, then the next layer's input_norm(y)

With deferred norms (``fast_norm``) the normed sums only ever reach per-token quantized
projections, so each ``+`` can run inside the fused kernel (``ops.rms_norm_quant_per_token`` with
a residual): it reads both addends, writes the sum (the residual stream needs it in 16 bits) and
the quantized normed rows, instead of an add kernel writing the sum and the norm reading it back.

One mechanism, no per-model copies: a layer gets ``fused_forward`` only when its class's
``forward`` computes exactly the dataflow above, checked on the source's syntax tree against
``_PRE_NORM_FORWARD`` (same statements, names and call arguments; annotations, docstrings and
comments aside). Llama, Mistral, Qwen2 and Qwen3 of transformers 5 match; a layer that differs
in any statement (Gemma-3's four norms, Phi-3's dropouts, OLMo-2's post-norms) keeps its own
forward. ``fused_forward`` runs the same statements, except:

- the middle add and ``post_attention_layernorm`` are one ``FastRMSNorm.fused_add_norm``;
- the closing add and the *next* layer's ``input_layernorm`` are one ``fused_add_norm`` of that
  norm, whose deferred output is handed to its next call (``FastRMSNorm.prepare``) if that call
  gets the very tensor this layer returned, unchanged (identity and version counter); any other
  call computes its norm as usual. The returned sum is a real tensor, so hooks, hidden-state
  outputs and any caller between the layers see ordinary values; while forward hooks or pre-hooks
  sit between two layers (they may write the tensor past its version counter, e.g. through
  ``.data``) the closing add runs unfused.

A ``fused_add_norm`` declines (and the layer adds and norms as before) until the norm's consumer
has asked once for fused values (so the first forward learns the consumer's dtype and backend)
and wherever the norm would not defer (autograd, inference mode, tracing, a consumer that needed
16 bits). Numerics: the kernel adds in float32 and rounds once, as torch's 16-bit ``+`` does,
and quantizes the norm of that rounded sum, so outputs equal those of deferred norms without the
fusion (``optimize(exact=False, residual_add=False)``), bit for bit on the torch backend.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn
from torch.nn.modules import module as module_hooks

from quantkit.models.fast_norm import FastRMSNorm

# The pre-norm layer's forward as transformers 5 writes it (names included): the template the
# syntax-tree check compares against, and the statements ``fused_forward`` keeps.
_PRE_NORM_FORWARD = """
def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
            use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""


def _normalized(function: ast.FunctionDef) -> str:
    """The function's arguments, decorators and statements, without annotations or docstring."""
    function = ast.parse(ast.unparse(function)).body[0]  # a copy
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    arguments = function.args
    for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + [arguments.vararg, arguments.kwarg]:
        if argument is not None:
            argument.annotation = None
    function.body, function.returns, function.name = body, None, "forward"
    return ast.dump(function)


_TEMPLATE = _normalized(ast.parse(_PRE_NORM_FORWARD).body[0])
_MATCHES: dict = {}


def _is_checkpointing_wrapper(function) -> bool:
    # transformers' GradientCheckpointingLayer wraps every layer class's forward in one that only
    # acts when training with gradient checkpointing (fused_forward defers to the class then).
    code = getattr(function, "__code__", None)
    return (code is not None and code.co_name == "forward_with_checkpointing"
            and code.co_filename.replace("\\", "/").endswith("transformers/modeling_layers.py"))


def is_pre_norm_layer(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` is the pre-norm dataflow of ``_PRE_NORM_FORWARD``: no
    decorator and no wrapper (they could change what it computes) but transformers' checkpointing
    one."""
    forward = type(module).forward
    key = (type(module), forward)
    known = _MATCHES.get(key)
    if known is None:
        inner = forward.__wrapped__ if _is_checkpointing_wrapper(forward) else forward
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
            known = (not hasattr(inner, "__wrapped__") and isinstance(tree.body[0], ast.FunctionDef)
                     and _normalized(tree.body[0]) == _TEMPLATE)
        except (OSError, TypeError, SyntaxError, IndexError):
            known = False
        _MATCHES[key] = known
    return known


def fused_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                  use_cache=False, position_embeddings=None, **kwargs):
    """``_PRE_NORM_FORWARD`` with its two adds inside the fused norm kernels (module docs)."""
    attention_args = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                          use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if self.training:  # the class's forward (gradient checkpointing); the fused kernels have no backward
        return type(self).forward(self, hidden_states, **attention_args)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_args)
    post_norm = self.post_attention_layernorm
    fused = post_norm.fused_add_norm(hidden_states, residual) if type(post_norm) is FastRMSNorm else None
    if fused is None:
        residual = residual + hidden_states
        hidden_states = post_norm(residual)
    else:
        hidden_states, residual = fused
    hidden_states = self.mlp(hidden_states)
    following = self.__dict__.get("quantkit_next_layer")
    fused = None
    if following is not None:
        next_norm = following.input_layernorm
        if type(next_norm) is FastRMSNorm and not _hooked(self, following, next_norm):
            fused = next_norm.fused_add_norm(hidden_states, residual)
    if fused is None:
        return residual + hidden_states
    normed, summed = fused
    next_norm.prepare(summed, normed)
    return summed


def _hooked(layer: nn.Module, following: nn.Module, next_norm: nn.Module) -> bool:
    """Whether code may run between this layer's output and the next layer's input norm: forward
    hooks (this layer's or global ones) and pre-hooks (the next layer's or its norm's) can change
    the output in ways its version counter does not see (``.data``, NumPy views), so the closing
    add then runs unfused and the next norm reads whatever the tensor holds."""
    return bool(layer._forward_hooks or following._forward_pre_hooks
                or next_norm._forward_pre_hooks or module_hooks._global_forward_hooks
                or module_hooks._global_forward_pre_hooks)


def _deferring(norm) -> bool:
    return type(norm) is FastRMSNorm and norm.defer_output


def _is_fused(forward) -> bool:
    return isinstance(forward, functools.partial) and forward.func is fused_forward


def fuse_residual_adds(model: nn.Module, enabled: bool) -> list[str]:
    """Give each pre-norm decoder layer with a deferring ``post_attention_layernorm`` the fused
    forward (and a link to the next layer, whose deferring input norm its closing add feeds);
    with ``enabled=False``, take quantkit's forward off again. A layer whose instance already has
    another forward (accelerate's device hooks, a user's patch) keeps it, unfused. Returns the
    names of the fused layers. Run it (``optimize``) again after changing a model's layer list."""
    fused = []
    for name, stack in model.named_modules():
        if not isinstance(stack, nn.ModuleList):
            continue
        layers = list(stack)
        for index, layer in enumerate(layers):
            if not is_pre_norm_layer(layer):
                continue
            if _is_fused(layer.__dict__.get("forward")):
                del layer.__dict__["forward"]
            layer.__dict__.pop("quantkit_next_layer", None)
            if not (enabled and _deferring(layer.post_attention_layernorm)) or "forward" in layer.__dict__:
                continue
            following = layers[index + 1] if index + 1 < len(layers) else None
            if following is not None and is_pre_norm_layer(following) and _deferring(following.input_layernorm):
                # In __dict__, not as a submodule: the next layer is the list's, not this one's.
                layer.__dict__["quantkit_next_layer"] = following
            # A partial of a module-level function (not a bound method), so a pickled model loads.
            layer.__dict__["forward"] = functools.partial(fused_forward, layer)
            fused.append(f"{name}.{index}" if name else str(index))
    return fused
