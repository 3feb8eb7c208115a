"""What a checkpoint's model must share with the model that loads it (spec section 9).

Distributed checkpoints load by key: a model with fewer MTP depths than the checkpoint
simply never asks for the extra depths' tensors, so a depth mismatch would load
silently. A trainer saves ``model_shape`` beside the weights and calls
``check_same_shape`` before loading any tensor. Isolation on or off
(``mtp_detach_heads``) is a training choice, not a shape: it is not compared.
"""

from megatron.core.utils import get_attr_wrapped_model

SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "mtp_num_layers",
    "mtp_use_repeated_layer",
)
# A config without the field (pristine megatron-core 0.16.1) has that shape.
ABSENT_MEANS = {"mtp_use_repeated_layer": False}


def model_shape(model) -> dict:
    """The shape of a GPTModel (or a wrapper of one: DDP, Float16Module): config sizes, MTP
    depths and mode, vocabulary, tied or untied output weights."""
    gpt = get_attr_wrapped_model(model, "share_embeddings_and_output_weights", return_model_obj=True)
    shape = {field: getattr(gpt.config, field, ABSENT_MEANS.get(field)) for field in SHAPE_FIELDS}
    shape["mtp_num_layers"] = shape["mtp_num_layers"] or 0  # None and 0 both mean no MTP
    shape["vocab_size"] = gpt.vocab_size
    shape["share_embeddings_and_output_weights"] = gpt.share_embeddings_and_output_weights
    return shape


def check_same_shape(saved: dict, current: dict) -> None:
    """Raise ValueError naming every field where the checkpoint and the model differ."""
    differences = [
        f"{field}: checkpoint {saved.get(field)!r}, model {current.get(field)!r}"
        for field in sorted(set(saved) | set(current))
        if saved.get(field) != current.get(field)
    ]
    if differences:
        raise ValueError(
            "the checkpoint holds a model of another shape (" + "; ".join(differences) + "). "
            "Build the model with the checkpoint's values to load it; mtp_detach_heads may differ."
        )
