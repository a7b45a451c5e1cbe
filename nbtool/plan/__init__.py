"""Planning models (pure Python): memory, communication and a recommendation per strategy.

    from nbtool.plan import ModelShape, Training, HARDWARE_PRESETS, recommend
    rec = recommend(ModelShape.transformer(32, 4096, 32, 32000, 4096), Training(checkpointing="full"),
                    HARDWARE_PRESETS["8x A100-40GB NVLink"])
    print(rec)
"""
from .estimate import Estimate, activations, estimate
from .inputs import HARDWARE_PRESETS, MODEL_PRESETS, Hardware, ModelShape, Training
from .model_states import expected_ledger, paper_bytes
from .recommend import Recommendation, recommend

__all__ = ["Estimate", "HARDWARE_PRESETS", "Hardware", "MODEL_PRESETS", "ModelShape", "Recommendation",
           "Training", "activations", "estimate", "expected_ledger", "paper_bytes", "recommend"]
