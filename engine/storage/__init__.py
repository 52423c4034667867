"""Storage tiers (gpu/cpu/disk), tensor handles, budgets, the one copy function, placement rules."""
from engine.storage.copy import copy
from engine.storage.placement import split_ranges, weight_tiers
from engine.storage.tiers import BudgetExceeded, Handle, MemoryBudget, Stored, Tier

__all__ = ["copy", "split_ranges", "weight_tiers", "BudgetExceeded", "Handle", "MemoryBudget", "Stored", "Tier"]
