"""Layer specs that run on any device.

``get_gpt_layer_sdpa_spec`` is upstream's local (Transformer-Engine-free) GPT layer
spec with its ``core_attention`` replaced by ``SDPACoreAttention``; everything else
(parallel linears, norms, MLP, parameter names) is upstream's. The MTP block spec
is derived from it by upstream's ``get_gpt_mtp_block_spec``.
"""

from megatron.core.fork.sdpa_attention import SDPACoreAttention
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec


def get_gpt_layer_sdpa_spec(**local_spec_kwargs) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
