"""The two students of the recipe: the Hedgehog stage-1 student and the HedgeMamba stage-2 model.

Importing this package registers HedgeMamba with the transformers Auto classes
(``AutoConfig`` model_type "hedgemamba", ``AutoModelForCausalLM``, ``AutoModel`` for the backbone alone).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .feature_map import HedgehogFeatureMap
from .hedgehog import HedgehogForCausalLM, hedgehog_layer_output, hedgehog_loss
from .hedgemamba import HedgeMambaCache, HedgeMambaConfig, HedgeMambaForCausalLM, HedgeMambaModel

try:
    AutoConfig.register("hedgemamba", HedgeMambaConfig)
except ValueError:  # already registered (re-import)
    pass
for auto, cls in ((AutoModelForCausalLM, HedgeMambaForCausalLM), (AutoModel, HedgeMambaModel)):
    try:
        auto.register(HedgeMambaConfig, cls)
    except ValueError:
        pass

__all__ = [
    "HedgehogFeatureMap",
    "HedgehogForCausalLM",
    "hedgehog_layer_output",
    "hedgehog_loss",
    "HedgeMambaCache",
    "HedgeMambaConfig",
    "HedgeMambaForCausalLM",
    "HedgeMambaModel",
]
