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
  outputs and any caller between the layers see ordinary values.

A ``fused_add_norm`` declines (and the layer adds and norms as before) until the norm's consumer
has asked once for fused values (so the first forward learns the consumer's dtype and backend)
and wherever the norm would not defer (autograd, inference mode, tracing, a consumer that needed
16 bits). Numerics: the kernel adds in float32 and rounds once, as torch's 16-bit ``+`` does,
and quantizes the norm of that rounded sum, so outputs equal those of deferred norms without the
fusion (``optimize(exact=False, residual_add=False)``), bit for bit on the torch backend.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

from torch import nn

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
    """The function's arguments and statements, without annotations, docstring or decorators."""
    function = ast.parse(ast.unparse(function)).body[0]  # a copy
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    arguments = function.args
    for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + [arguments.vararg, arguments.kwarg]:
        if argument is not None:
            argument.annotation = None
    function.body, function.decorator_list, function.returns, function.name = body, [], None, "forward"
    return ast.dump(function)


_TEMPLATE = _normalized(ast.parse(_PRE_NORM_FORWARD).body[0])
_MATCHES: dict[type, bool] = {}


def is_pre_norm_layer(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` is the pre-norm dataflow of ``_PRE_NORM_FORWARD``."""
    cls = type(module)
    known = _MATCHES.get(cls)
    if known is None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
            known = isinstance(tree.body[0], ast.FunctionDef) and _normalized(tree.body[0]) == _TEMPLATE
        except (OSError, TypeError, SyntaxError, IndexError):
            known = False
        _MATCHES[cls] = known
    return known


def fused_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                  use_cache=False, position_embeddings=None, **kwargs):
    """``_PRE_NORM_FORWARD`` with its two adds inside the fused norm kernels (module docs)."""
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
    post_norm = self.post_attention_layernorm
    fused = post_norm.fused_add_norm(hidden_states, residual) if type(post_norm) is FastRMSNorm else None
    if fused is None:
        residual = residual + hidden_states
        hidden_states = post_norm(residual)
    else:
        hidden_states, residual = fused
    hidden_states = self.mlp(hidden_states)
    next_norm = self.__dict__.get("quantkit_next_norm")
    fused = next_norm.fused_add_norm(hidden_states, residual) if next_norm is not None else None
    if fused is None:
        return residual + hidden_states
    normed, summed = fused
    next_norm.prepare(summed, normed)
    return summed


def _defers(norm) -> bool:
    return type(norm) is FastRMSNorm and norm.defer_output


def fuse_residual_adds(model: nn.Module, enabled: bool) -> list[str]:
    """Give each pre-norm decoder layer with a deferring ``post_attention_layernorm`` the fused
    forward (and a link to the next layer's deferring input norm); with ``enabled=False``, put
    back the class's own forward. Returns the names of the fused layers."""
    fused = []
    for name, stack in model.named_modules():
        if not isinstance(stack, nn.ModuleList):
            continue
        layers = list(stack)
        for index, layer in enumerate(layers):
            if not is_pre_norm_layer(layer):
                continue
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop("quantkit_next_norm", None)
            if not (enabled and _defers(layer.post_attention_layernorm)):
                continue
            following = layers[index + 1] if index + 1 < len(layers) else None
            if following is not None and is_pre_norm_layer(following) and _defers(following.input_layernorm):
                # In __dict__, not as a submodule: the norm belongs to the next layer.
                layer.__dict__["quantkit_next_norm"] = following.input_layernorm
            layer.__dict__["forward"] = types.MethodType(fused_forward, layer)
            fused.append(f"{name}.{index}" if name else str(index))
    return fused
