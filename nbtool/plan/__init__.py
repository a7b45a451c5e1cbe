"""Planning models (pure Python): memory and communication per strategy."""
from .model_states import expected_ledger, paper_bytes

__all__ = ["expected_ledger", "paper_bytes"]
