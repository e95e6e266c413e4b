"""The two students of the recipe: the Hedgehog stage-1 student and the HedgeMamba stage-2 model.

Importing this package registers HedgeMamba with the transformers Auto classes
(``AutoConfig`` model_type "hedgemamba", ``AutoModelForCausalLM``).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .feature_map import HedgehogFeatureMap
from .hedgehog import HedgehogForCausalLM, hedgehog_layer_output, hedgehog_loss
from .hedgemamba import HedgeMambaCache, HedgeMambaConfig, HedgeMambaForCausalLM

try:
    AutoConfig.register("hedgemamba", HedgeMambaConfig)
except ValueError:  # already registered (re-import)
    pass
try:
    AutoModelForCausalLM.register(HedgeMambaConfig, HedgeMambaForCausalLM)
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
]
